"""The kernels' side of the model's replaceable seam (moe_rl/model/replaceable.py): which function each kernel
implements, and the kernel set a model is handed.

    @implements("sort_slots")
    def sort_slots(ids_TK, n_experts): ...C...            # moe_rl/kernels/rows.py

A `KernelSet` answers the model's dispatcher: the implementation of a function if its family may run. An
implementation that makes choices of its own among families (the MKL products choose the C loop of
`exact_products` where it is on) takes the set as its `kernels` argument.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

IMPLEMENTATIONS: dict[str, Callable] = {}  # function name -> its fast implementation (filled as the kernels import)


def implements(name: str):
    """Register the decorated function as the fast implementation of the replaceable function `name`."""

    def register(fast: Callable) -> Callable:
        IMPLEMENTATIONS[name] = fast
        return fast

    return register


class KernelSet:
    """The fast implementations a forward may use: those whose family `enabled(family)` says runs."""

    def __init__(self, enabled: Callable[[str], bool]):
        self.enabled = enabled
        # function name -> (its implementation, the same given this set where it asks)
        self._bound: dict[str, tuple] = {}

    def implementation(self, op: str, family: str) -> Callable | None:
        fast = IMPLEMENTATIONS.get(op)
        if fast is None or not self.enabled(family):
            return None
        bound = self._bound.get(op)
        if bound is None or bound[0] is not fast:  # (a test may have put another implementation in its place)
            bound = self._bound[op] = (fast, self._bind(fast))
        return bound[1]

    def _bind(self, fast: Callable) -> Callable:
        if "kernels" not in inspect.signature(fast).parameters:
            return fast
        return lambda *args, **kwargs: fast(*args, kernels=self, **kwargs)

    def __repr__(self) -> str:
        return f"KernelSet({getattr(self.enabled, '__qualname__', self.enabled)})"

    def __deepcopy__(self, memo) -> KernelSet:  # a model's deep copy (the reference model) shares its kernel set
        return self
