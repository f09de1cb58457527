"""The seam between the model's torch math and faster implementations of some of its steps.

A function of the model that a kernel may stand in for is marked `@replaceable("family")`; its body is the torch
reference, the code a reader reads and the tests compare against. Every call says which kernels it may use, as an
argument:

    @replaceable("slots")
    def sort_slots(ids_TK, n_experts): ...torch...        # moe_rl/model/moe.py

    slots = sort_slots(ids_TK, n_experts, kernels=kernels)  # kernels=None: the torch reference

`kernels` is a kernel set (moe_rl.kernels.KernelSet: this machine's measured choice), which the model is given when
it is built (moe_rl/rl/build.py) and hands down its forward calls. The dispatcher asks it for the implementation of
the function in its family; that implementation returns NotImplemented for arguments it does not serve (another
device or dtype, autograd where it has no backward, widths it cannot vectorise), and then the reference runs. A
reference that calls other replaceable functions takes `kernels` too and passes it on.

The model never imports moe_rl.kernels: the kernels sit above it (they use the model's types and measure with it).
`sort_slots.reference` is the torch function itself; REPLACEABLE lists every replaceable function and its family.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Protocol

REPLACEABLE: dict[str, str] = {}  # function name -> its kernel family (declarations, filled as the model is imported)


class Kernels(Protocol):
    """What the dispatcher asks of a kernel set."""

    def implementation(self, op: str, family: str) -> Callable | None:
        """The fast implementation of function `op` if its `family` may run, else None."""


def replaceable(family: str):
    """Mark a torch reference function as one a kernel of `family` may replace (see the module docstring)."""

    def wrap(reference: Callable) -> Callable:
        op = reference.__name__
        REPLACEABLE[op] = family
        passes_kernels = "kernels" in inspect.signature(reference).parameters

        @functools.wraps(reference)
        def dispatch(*args, kernels: Kernels | None = None, **kwargs):  # on the hot path: one call, one dict get
            if kernels is not None:
                fast = kernels.implementation(op, family)
                out = fast(*args, **kwargs) if fast is not None else NotImplemented
                if out is not NotImplemented:
                    return out
            if passes_kernels:
                return reference(*args, kernels=kernels, **kwargs)
            return reference(*args, **kwargs)

        dispatch.reference = reference
        dispatch.family = family
        return dispatch

    return wrap
