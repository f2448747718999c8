"""The request slots regeneration's shards share on one server (eyrie/stages/regenerate/window.py): conversations in
order of shard then position, never more in flight than the slots the shards running at once brought, a shard's idle
slots serving the other (and, once it returned, the shards after it), cancelled conversations never run, and the
window's threads end with it."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest

from eyrie.stages.regenerate.window import _windows, shared_window
from eyrie.vllm.client import ServerClient


def until(check, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


class Meter:
    """Conversations running at once, and at most."""

    def __init__(self):
        self.lock = threading.Lock()
        self.now = self.peak = 0

    @contextlib.contextmanager
    def held(self):
        with self.lock:
            self.now += 1
            self.peak = max(self.peak, self.now)
        try:
            yield
        finally:
            with self.lock:
                self.now -= 1


def held_until(meter: Meter, go: threading.Event):
    """A conversation that keeps its slot until `go`."""

    def run():
        with meter.held():
            assert go.wait(5)

    return run


def regen_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("eyrie-regen-")]


def test_slots_go_to_the_earlier_shard_then_the_earlier_conversation():
    client = object()
    order: list[tuple[str, int]] = []
    go = threading.Event()
    with shared_window(client, 1) as a, shared_window(client, 0) as b:  # a joined first; one slot in all
        window = a.window
        assert b.window is window and a.rank < b.rank and window.slots == 1
        first = a.submit(0, held_until(Meter(), go))  # the only slot taken: everything below waits in line
        until(lambda: window.waiting() == 0)
        futures = [
            share.submit(position, lambda name=name, p=position: order.append((name, p)))
            for name, share, position in [("b", b, 0), ("a", a, 5), ("b", b, 1), ("a", a, 3)]
        ]
        assert window.waiting() == 4
        go.set()
        for f in [first, *futures]:
            f.result(5)
    # The earlier shard's conversations first, each shard's in position order; not the arrival order.
    assert order == [("a", 3), ("a", 5), ("b", 0), ("b", 1)]
    assert not _windows  # the last shard to leave drops the window


def test_two_shards_never_exceed_their_slots_together():
    client = object()
    meter = Meter()

    def conversation():
        for _ in range(3):  # turns: the conversation keeps its slot
            with meter.held():
                time.sleep(0.002)

    with shared_window(client, 3) as a, shared_window(client, 3) as b:
        futures = [s.submit(i, conversation) for s in (a, b) for i in range(20)]
        for f in futures:
            f.result(10)
    assert meter.peak == 6  # 3 + 3, never more, though 40 conversations were waiting at once


def test_a_shards_idle_slots_serve_the_other_shard():
    client = object()
    meter, go_a, go_b = Meter(), threading.Event(), threading.Event()
    with shared_window(client, 2) as a, shared_window(client, 2) as b:
        window = a.window
        tail = a.submit(0, held_until(meter, go_a))  # a's last conversation: one of its two slots idle
        until(lambda: meter.now == 1)
        bs = [b.submit(i, held_until(meter, go_b)) for i in range(4)]
        until(lambda: meter.now == 4 and window.waiting() == 1)  # b's two and a's idle one
        go_a.set()
        tail.result(5)
        until(lambda: meter.now == 4 and window.waiting() == 0)  # a's tail done: both of a's slots serve b
        go_b.set()
        for f in bs:
            f.result(5)


def test_a_returned_shards_slots_stay_spare_until_the_next_shard_joins():
    client = object()
    meter, go = Meter(), threading.Event()
    first = shared_window(client, 2)
    first.__enter__()
    with shared_window(client, 2) as b:
        first.__exit__(None, None, None)  # a returned; the flow's next shard task has not started yet
        futures = [b.submit(i, held_until(meter, go)) for i in range(6)]
        until(lambda: meter.now == 4 and b.window.waiting() == 2)  # b keeps the server at the two shards' four
        with shared_window(client, 2) as c:  # the next shard takes a's slots over: four in all, not six
            assert c.window.slots == 4
            futures += [c.submit(i, held_until(meter, go)) for i in range(2)]
            until(lambda: b.window.waiting() == 4)
            assert meter.now == 4
            go.set()
            for f in futures:
                f.result(5)
    assert meter.peak == 4 and not _windows
    # A window opened again holds its first shard's slots only.
    with shared_window(client, 2) as d:
        meter, go = Meter(), threading.Event()
        futures = [d.submit(i, held_until(meter, go)) for i in range(4)]
        until(lambda: meter.now == 2 and d.window.waiting() == 2)
        go.set()
        for f in futures:
            f.result(5)
    assert meter.peak == 2


def test_a_cancelled_conversation_never_runs_and_errors_reach_the_shard():
    client = object()
    ran: list[int] = []
    go = threading.Event()
    with shared_window(client, 1) as a:
        first = a.submit(0, held_until(Meter(), go))
        until(lambda: a.window.waiting() == 0)
        cancelled = a.submit(1, lambda: ran.append(1))
        failing = a.submit(2, lambda: 1 / 0)
        kept = a.submit(3, lambda: ran.append(3) or "done")
        assert cancelled.cancel()
        go.set()
        with pytest.raises(ZeroDivisionError):
            failing.result(5)
        assert kept.result(5) == "done" and first.result(5) is None
    assert ran == [3] and cancelled.cancelled()


def test_the_windows_threads_end_with_it():
    before = len(regen_threads())
    with shared_window(object(), 3) as a:
        assert len(regen_threads()) == before + 3
        a.submit(0, lambda: None).result(5)
    until(lambda: len(regen_threads()) == before)


def test_clients_of_one_server_share_a_window():
    one, same = ServerClient("http://h:1", "k"), ServerClient("http://h:1", "k")
    other_key, fake = ServerClient("http://h:1", "j"), object()
    with (
        shared_window(one, 1) as a,
        shared_window(same, 1) as b,
        shared_window(other_key, 1) as c,
        shared_window(fake, 1) as d,
    ):
        assert a.window is b.window and len({id(s.window) for s in (a, c, d)}) == 3
    assert not _windows
