"""The seam between the model's torch math and faster implementations of some of its steps.

A function of the model that a kernel may stand in for is marked `@replaceable("family")`; its body is the torch
reference, the code a reader reads and the tests compare against. At each call the dispatcher asks whether the
family is on for this machine and, if so, calls the implementation registered under the function's name, which
returns NotImplemented for arguments it does not serve (another device or dtype, autograd where it has no backward,
widths it cannot vectorise); then the reference runs.

    @replaceable("slots")
    def sort_slots(ids_TK, n_experts): ...torch...       # moe_rl/model/moe.py

    @implements("sort_slots")
    def sort_slots(ids_TK, n_experts): ...C...            # moe_rl/kernels/rows.py

The implementations live in moe_rl.kernels, a layer above the model (it imports the model's types and measures
with the model), loaded here on the first call that could use one; it decides per machine which families are on
(moe_rl/kernels/selection.py). `sort_slots.reference` is the torch function itself.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable

_FAST: dict[str, Callable] = {}  # function name -> its fast implementation
_FAMILY_OF: dict[str, str] = {}  # function name -> its kernel family
_switch: dict[str, Callable[[str], bool]] = {}  # "enabled": family -> on?, installed by moe_rl.kernels


def implements(name: str):
    """Register the decorated function as the fast implementation of the replaceable function `name`."""

    def register(fast: Callable) -> Callable:
        _FAST[name] = fast
        return fast

    return register


def install(enabled: Callable[[str], bool]) -> None:
    """Called by moe_rl.kernels once its implementations are registered: which families are on."""
    _switch["enabled"] = enabled


def replaceable(family: str):
    """Mark a torch reference function as one a kernel of `family` may replace (see the module docstring)."""

    def wrap(reference: Callable) -> Callable:
        op = reference.__name__
        _FAMILY_OF[op] = family

        @functools.wraps(reference)
        def dispatch(*args, **kwargs):  # on the hot path (every layer, every decode step): one switch call, one get
            if family_enabled(family):
                fast = _FAST.get(op)
                out = fast(*args, **kwargs) if fast is not None else NotImplemented
                if out is not NotImplemented:
                    return out
            return reference(*args, **kwargs)

        dispatch.reference = reference
        dispatch.family = family
        return dispatch

    return wrap


def family_enabled(family: str) -> bool:
    """Whether the kernels of `family` are on (for a kernel that chooses between two of its own paths)."""
    return (_switch.get("enabled") or _load_kernels())(family)


def _load_kernels() -> Callable[[str], bool]:
    """Import moe_rl.kernels by name: the model's modules sit below it (tests/test_house.py) and never import it."""
    importlib.import_module("moe_rl.kernels")
    return _switch["enabled"]
