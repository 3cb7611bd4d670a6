"""Items handed from the engine thread to the event loop's queues, with one wake-up per batch.

`loop.call_soon_threadsafe` wakes the event loop by writing to its self-pipe: a system call, paid by
the calling thread. The engine thread streams a text update for every request at every step, so a
wake-up each would put a system call per request per step on the engine's time, between passes that
every request waits for. A `LoopMailbox` wakes the loop for the first item of a batch only; the
items put before the loop runs are delivered with it, each queue's in the order they were put.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any


class LoopMailbox:
    """Items for `asyncio.Queue`s of one event loop, put from any thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[asyncio.Queue[Any], Any]] = []

    def put(self, queue: asyncio.Queue[Any], item: Any) -> None:
        """`queue.put_nowait(item)` on the loop's thread, soon; RuntimeError once the loop has closed
        (as `call_soon_threadsafe` raises), also while an earlier wake-up it never ran is pending."""

        with self._lock:
            if self.loop.is_closed():  # nothing will read these, and nothing must ride on them
                self._items.clear()
                raise RuntimeError("the event loop is closed")
            self._items.append((queue, item))
            if len(self._items) > 1:  # a wake-up is already on its way: this item rides with it
                return
        try:
            self.loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # closed since the check above
            with self._lock:
                self._items.clear()
            raise

    def _deliver(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        for queue, item in items:
            queue.put_nowait(item)
