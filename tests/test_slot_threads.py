"""The threads that serve a worker's run slots (everystep/slot_threads.py)."""

from __future__ import annotations

import threading

import pytest

from everystep.slot_threads import SlotThreads
from tests.support.processes import wait_for


def pool_threads(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(f"{name}_")]


def test_calls_go_to_idle_threads_and_no_more_threads_than_the_size_start():
    slots = SlotThreads(2, "slot-test-size")
    gate, started, done = threading.Event(), threading.Semaphore(0), []

    def call(i: int) -> None:
        started.release()
        gate.wait(10)
        done.append(i)

    try:
        for i in range(5):
            slots.submit(call, i)
        assert started.acquire(timeout=10) and started.acquire(timeout=10)
        assert not started.acquire(timeout=0.3)  # two threads, both busy: the three others wait
        assert len(pool_threads("slot-test-size")) == 2
        gate.set()
        for _ in range(3):
            assert started.acquire(timeout=10)
        wait_for(lambda: len(done) == 5, 10, what="the five calls done")
        assert sorted(done) == [0, 1, 2, 3, 4]
        # Idle threads take the next calls: no third thread starts.
        for i in range(5, 9):
            slots.submit(call, i)
        for _ in range(4):
            assert started.acquire(timeout=10)
        assert len(pool_threads("slot-test-size")) == 2
    finally:
        gate.set()
        slots.shutdown()


def test_shutdown_drops_the_calls_not_started_and_the_threads_end():
    slots = SlotThreads(1, "slot-test-stop")
    gate, ran = threading.Event(), []

    def call(i: int) -> None:
        ran.append(i)
        gate.wait(10)

    slots.submit(call, 0)
    slots.submit(call, 1)
    slots.submit(call, 2)
    wait_for(lambda: ran, 10, what="the first call started")
    slots.shutdown()
    gate.set()
    for thread in pool_threads("slot-test-stop"):
        thread.join(10)
        assert not thread.is_alive()
    assert ran == [0]  # the two calls waiting were dropped
    with pytest.raises(RuntimeError):
        slots.submit(call, 3)
