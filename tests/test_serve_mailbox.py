"""Items from the engine thread to the event loop (`dlm.serving.mailbox.LoopMailbox`): all delivered,
each queue's in order, with one wake-up of the loop per batch instead of one per item."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from dlm.serving.mailbox import LoopMailbox


class CountingLoop:
    """The running loop, counting the wake-ups asked of it from other threads."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop, self.wakeups = loop, 0

    def is_closed(self) -> bool:
        return self.loop.is_closed()

    def call_soon_threadsafe(self, callback: Any, *args: Any) -> Any:
        self.wakeups += 1
        return self.loop.call_soon_threadsafe(callback, *args)


def test_items_put_from_another_thread_arrive_in_order_with_one_wakeup_per_batch() -> None:
    async def scenario() -> tuple[list[list[int]], int]:
        counting = CountingLoop(asyncio.get_running_loop())
        mailbox = LoopMailbox(counting)  # type: ignore[arg-type]
        queues: list[asyncio.Queue[int]] = [asyncio.Queue() for _ in range(3)]

        def engine() -> None:  # 3 steps of 3 requests' updates, each step put while the loop is busy
            for step in range(3):
                for queue in queues:
                    mailbox.put(queue, step)

        thread = threading.Thread(target=engine)
        thread.start()
        thread.join(5)  # the loop is held here (as by a busy callback): it delivers nothing until the end
        received = [[await asyncio.wait_for(queue.get(), 5) for _ in range(3)] for queue in queues]
        return received, counting.wakeups

    received, wakeups = asyncio.run(scenario())
    assert received == [[0, 1, 2]] * 3
    # The first item woke the loop and the other eight rode along.
    assert wakeups == 1


def test_a_put_after_delivery_wakes_the_loop_again() -> None:
    async def scenario() -> list[int]:
        mailbox = LoopMailbox(asyncio.get_running_loop())
        queue: asyncio.Queue[int] = asyncio.Queue()
        got = []
        for item in range(3):  # one at a time, each delivered before the next is put
            await asyncio.to_thread(mailbox.put, queue, item)
            got.append(await asyncio.wait_for(queue.get(), 5))
        return got

    assert asyncio.run(scenario()) == [0, 1, 2]


def refused_puts(mailbox: LoopMailbox, queue: asyncio.Queue[int], count: int) -> int:
    """Puts of `count` items from another thread, each alone; how many raised RuntimeError."""

    errors: list[BaseException] = []

    def put() -> None:
        try:
            mailbox.put(queue, 1)
        except RuntimeError as error:
            errors.append(error)

    for _ in range(count):
        thread = threading.Thread(target=put)
        thread.start()
        thread.join(5)
    return len(errors)


def test_a_closed_loop_refuses_and_leaves_nothing_behind() -> None:
    loop = asyncio.new_event_loop()
    mailbox = LoopMailbox(loop)
    queue: asyncio.Queue[int] = asyncio.Queue()
    loop.close()
    assert refused_puts(mailbox, queue, 2) == 2  # the second too: the first left no batch to ride on
    with pytest.raises(asyncio.QueueEmpty):
        queue.get_nowait()


def test_a_loop_closed_before_its_pending_wakeup_ran_refuses_the_items_after() -> None:
    loop = asyncio.new_event_loop()
    mailbox = LoopMailbox(loop)
    queue: asyncio.Queue[int] = asyncio.Queue()
    mailbox.put(queue, 0)  # a wake-up is scheduled, and the loop never runs it
    loop.close()
    assert refused_puts(mailbox, queue, 3) == 3  # not left to ride on a wake-up that will not come
