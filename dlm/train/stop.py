"""Safe stops: SIGINT / SIGTERM become a flag the training loop checks after each optimizer step.

The first signal asks for a safe stop (finish the step, save, exit 128 + its number). A second one
means "stop now": it raises `SignalStop`, which the CLI turns into one line and the same exit code,
except while a checkpoint is being written, where it is held back until the write is complete, so
that no file is ever left half-written by an impatient Ctrl-C.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any


class SignalStop(BaseException):
    """A second SIGINT / SIGTERM: stop without saving (the last checkpoint on disk is kept).

    A BaseException, like KeyboardInterrupt, so that no `except Exception` swallows it; not a
    KeyboardInterrupt, which the CLI framework would turn into "Aborted!" and exit code 1.
    """

    def __init__(self, number: int) -> None:
        self.signal_number = number
        self.exit_code = 128 + number
        super().__init__(f"stopped by a second {signal.Signals(number).name}")


class StopSignals:
    """Installs the handlers for its `with` block (main thread only) and restores the old ones.

    With `restore=False` (the CLI, whose process ends with the run) signals are ignored after the
    block instead: one that lands during interpreter teardown would otherwise kill the process with
    the raw signal instead of 128 + N.
    """

    def __init__(self, restore: bool = True) -> None:
        self.signal_number: int | None = None
        self._previous: dict[int, Any] = {}
        self._writing = 0
        self._settled = False
        self._restore = restore

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for number in (signal.SIGINT, signal.SIGTERM):
                self._previous[number] = signal.signal(number, self._handle)
        return self

    def _handle(self, number: int, frame: object) -> None:
        if self.signal_number is None:
            self.signal_number = number
        elif not self._writing and not self._settled:
            # The exit code is the first signal's: the one that decided how the run ends. One
            # SignalStop at most: a third signal must not interrupt the handling of the second.
            self._settled = True
            raise SignalStop(self.signal_number)

    def settle(self) -> None:
        """The run is over (its files are complete): from now on a signal changes nothing, so the
        result is reported in full and the exit code stays the one the run ended with."""

        self._settled = True

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        """Hold back a second signal until the block (a checkpoint write) is complete; the loop
        stops right after it anyway, since the first signal's flag is set."""

        self._writing += 1
        try:
            yield
        finally:
            self._writing -= 1

    def __exit__(self, *exc_info: object) -> None:
        if not self._restore:
            # The run is over whatever happens next. Ignored at the C level: interpreter teardown
            # resets Python-level handlers to the default, and a signal then would kill the process
            # with the raw signal instead of the exit code the run ended with.
            self._settled = True
            if self._previous:
                for number in self._previous:
                    signal.signal(number, signal.SIG_IGN)
            return
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous.clear()

    @property
    def exit_code(self) -> int:
        return 128 + (self.signal_number or 0)
