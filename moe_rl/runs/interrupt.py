"""SIGINT and SIGTERM during `train` and `sft`: finish the step, save, and end with status `interrupted`.

    with StopOnSignal() as stop:
        for step in ...:
            ...one step...
            if stop.requested:            # SIGINT or SIGTERM arrived during the step
                save; run.mark_interrupted(stop.signal_name, step); break

The first signal is only noted, so the step in flight ends and the run stops at a step boundary with a checkpoint
(a resume then continues exactly). A second one raises `Interrupted` at once: the step is abandoned and the run
resumes from its last checkpoint. Either way the exit status is 128 + the signal's number (130 SIGINT, 143 SIGTERM),
as a shell reports a process a signal ended. Without handlers SIGINT printed a KeyboardInterrupt traceback from
inside the sampler, and SIGTERM ended the process with its manifest saying `running` forever.
"""

from __future__ import annotations

import signal
import threading

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """A second SIGINT or SIGTERM: stop now. A KeyboardInterrupt, so no `except Exception` on the way swallows it."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopOnSignal:
    """Catch SIGINT and SIGTERM while in the block (main thread only; elsewhere a no-op): the first sets
    `requested`, a second raises Interrupted. The previous handlers come back on exit."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""

    def _handle(self, signum: int, frame) -> None:
        if self.signum is not None:
            raise Interrupted(signum)
        self.signum = signum

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
        return self

    def __exit__(self, *exc_info) -> bool:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        return False


def exit_status(signal_name: str) -> int:
    """128 + the signal's number: 130 for SIGINT, 143 for SIGTERM."""
    return 128 + signal.Signals[signal_name].value
