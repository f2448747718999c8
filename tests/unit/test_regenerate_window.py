"""The request slots regeneration's shards share on one server (eyrie/stages/regenerate/window.py): slots in order
of shard then conversation, never more in flight than the slots the shards running at once brought, a shard's idle
slots serving the other (and, once it returned, the shards after it), and waiters that give up once their shard is
abandoned."""

from __future__ import annotations

import contextlib
import threading
import time

from eyrie.stages.regenerate.window import _windows, shard_threads, shared_window
from eyrie.vllm.client import ServerClient


def until(check, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


class Meter:
    """Slots held at once, and at most."""

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


def start(target, *args) -> threading.Thread:
    t = threading.Thread(target=target, args=args, daemon=True)
    t.start()
    return t


def test_slots_go_to_the_earlier_shard_then_the_earlier_conversation():
    client = object()
    order: list[tuple[str, int]] = []
    with shared_window(client, 1) as a, shared_window(client, 0) as b:  # a joined first; one slot in all
        window = a.window
        assert b.window is window and a.rank < b.rank

        def request(name, share, position):
            with share.slot(position) as held:
                assert held
                order.append((name, position))

        with a.slot(0):  # the only slot taken: every request below queues, in this arrival order
            threads = []
            for name, share, position in [("b", b, 0), ("a", a, 5), ("b", b, 1), ("a", a, 3)]:
                threads.append(start(request, name, share, position))
                until(lambda n=len(threads): window.waiting() == n)
        for t in threads:
            t.join(5)
    # The earlier shard's conversations first, each shard's in conversation order; not the arrival order.
    assert order == [("a", 3), ("a", 5), ("b", 0), ("b", 1)]
    assert not _windows  # the last shard to leave drops the window


def test_two_shards_never_exceed_their_slots_together():
    client = object()
    meter = Meter()

    def conversation(share, position):
        for _ in range(3):  # turns: a slot per request
            with share.slot(position) as held, meter.held():
                assert held
                time.sleep(0.002)

    with shared_window(client, 3) as a, shared_window(client, 3) as b:
        threads = [start(conversation, s, i) for s in (a, b) for i in range(shard_threads(3, 20))]
        for t in threads:
            t.join(10)
    assert meter.peak == 6  # 3 + 3, never more, though 24 conversations wanted slots at once


def held_until(share, position, meter, go):
    """A request of `share`'s conversation `position`: its slot held until `go`."""
    with share.slot(position) as held, meter.held():
        assert held
        go.wait(5)


def test_a_shards_idle_slots_serve_the_other_shard():
    client = object()
    with shared_window(client, 2) as a, shared_window(client, 2) as b:
        window, meter, go = a.window, Meter(), threading.Event()
        with a.slot(0):  # a's last conversation: one of its two slots taken, the other idle
            threads = [start(held_until, b, i, meter, go) for i in range(4)]
            until(lambda: meter.now == 3 and window.waiting() == 1)  # b's two and a's idle one
        until(lambda: meter.now == 4 and window.waiting() == 0)  # a's tail done: both of a's slots serve b
        go.set()
        for t in threads:
            t.join(5)


def test_a_returned_shards_slots_stay_spare_until_the_next_shard_joins():
    client = object()
    meter, go = Meter(), threading.Event()
    first = shared_window(client, 2)
    first.__enter__()
    with shared_window(client, 2) as b:
        first.__exit__(None, None, None)  # a returned; the flow's next shard task has not started yet
        threads = [start(held_until, b, i, meter, go) for i in range(6)]
        until(lambda: meter.now == 4 and b.window.waiting() == 2)  # b keeps the server at the two shards' four
        with shared_window(client, 2) as c:  # the next shard takes a's slots over: four in all, not six
            threads += [start(held_until, c, i, meter, go) for i in range(2)]
            until(lambda: b.window.waiting() == 4)
            assert meter.now == 4
            go.set()
            for t in threads:
                t.join(5)
    assert meter.peak == 4 and not _windows
    # A window opened again holds its first shard's slots only.
    with shared_window(client, 2) as d:
        meter, go = Meter(), threading.Event()
        threads = [start(held_until, d, i, meter, go) for i in range(4)]
        until(lambda: meter.now == 2 and d.window.waiting() == 2)
        go.set()
        for t in threads:
            t.join(5)
    assert meter.peak == 2


def test_an_abandoned_shards_waiters_give_up_and_the_others_keep_waiting():
    client = object()
    outcome: dict[str, bool] = {}

    def request(name, share):
        with share.slot(0) as held:
            outcome[name] = held

    with shared_window(client, 1) as a, shared_window(client, 0) as b:
        window = a.window
        with a.slot(0):  # the one slot taken: both wait
            tb = start(request, "b", b)
            until(lambda: window.waiting() == 1)
            ta = start(request, "a", a)
            until(lambda: window.waiting() == 2)
            b.abandon()  # b's server gone
            tb.join(5)
            assert outcome == {"b": False} and window.waiting() == 1  # b gave up without a slot; a still waits
            # and a request of the abandoned shard gives up at once
            request("b-later", b)
            assert outcome["b-later"] is False
        ta.join(5)
        assert outcome["a"] is True


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
    assert shard_threads(16, 5) == 5 and shard_threads(16, 1000) == 64 and shard_threads(16, 0) == 1
