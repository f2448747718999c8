"""The requests regeneration's shards share on one server (eyrie/stages/regenerate/window.py): conversations in order
of shard then position, never more in flight than the slots the shards running at once brought, a shard's idle slots
serving the other (and, once it returned, the shards after it), a failing conversation failing its shard without
starting the rest, and the window's loop ending with it."""

from __future__ import annotations

import asyncio
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

    async def run():
        with meter.held():
            while not go.is_set():
                await asyncio.sleep(0.001)

    return run


def in_thread(share, conversations) -> tuple[threading.Thread, dict]:
    """`share.run(conversations)` in a thread of its own, as a shard task runs it; its outcome in the dict."""
    outcome: dict = {}

    def run():
        try:
            outcome["results"] = share.run(conversations)
        except BaseException as err:
            outcome["error"] = err

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, outcome


def test_slots_go_to_the_earlier_shard_then_the_earlier_conversation():
    client = object()
    order: list[tuple[str, int]] = []
    go = threading.Event()

    def note(name, position):
        async def run():
            order.append((name, position))
            return position

        return run

    with shared_window(client, 1) as a, shared_window(client, 0) as b:  # a joined first; one slot in all
        window = a.window
        assert b.window is window and a.rank < b.rank and window.slots == 1
        first, _ = in_thread(a, [(0, held_until(Meter(), go))])  # the only slot taken: the rest waits in line
        until(lambda: window.waiting() == 0)
        tb, b_out = in_thread(b, [(0, note("b", 0)), (1, note("b", 1))])
        until(lambda: window.waiting() == 2)
        ta, a_out = in_thread(a, [(5, note("a", 5)), (3, note("a", 3))])
        until(lambda: window.waiting() == 4)
        go.set()
        for t in (first, ta, tb):
            t.join(5)
    # The earlier shard's conversations first, each shard's in position order; not the arrival order. Results come
    # back in the order each shard gave its conversations.
    assert order == [("a", 3), ("a", 5), ("b", 0), ("b", 1)]
    assert a_out == {"results": [5, 3]} and b_out == {"results": [0, 1]}
    assert not _windows  # the last shard to leave drops the window


def test_two_shards_never_exceed_their_slots_together():
    client = object()
    meter = Meter()

    async def conversation():
        for _ in range(3):  # turns: the conversation keeps its slot
            with meter.held():
                await asyncio.sleep(0.002)

    with shared_window(client, 3) as a, shared_window(client, 3) as b:
        threads = [in_thread(s, [(i, conversation) for i in range(20)])[0] for s in (a, b)]
        for t in threads:
            t.join(10)
    assert meter.peak == 6  # 3 + 3, never more, though 40 conversations were waiting at once


def test_a_shards_idle_slots_serve_the_other_shard():
    client = object()
    meter, go_a, go_b = Meter(), threading.Event(), threading.Event()
    with shared_window(client, 2) as a, shared_window(client, 2) as b:
        window = a.window
        tail, _ = in_thread(a, [(0, held_until(meter, go_a))])  # a's last conversation: one of its slots idle
        until(lambda: meter.now == 1)
        tb, _ = in_thread(b, [(i, held_until(meter, go_b)) for i in range(4)])
        until(lambda: meter.now == 4 and window.waiting() == 1)  # b's two and a's idle one
        go_a.set()
        tail.join(5)
        until(lambda: meter.now == 4 and window.waiting() == 0)  # a's tail done: both of a's slots serve b
        go_b.set()
        tb.join(5)


def test_a_returned_shards_slots_stay_spare_until_the_next_shard_joins():
    client = object()
    meter, go = Meter(), threading.Event()
    first = shared_window(client, 2)
    first.__enter__()
    with shared_window(client, 2) as b:
        first.__exit__(None, None, None)  # a returned; the flow's next shard task has not started yet
        threads = [in_thread(b, [(i, held_until(meter, go)) for i in range(6)])[0]]
        until(lambda: meter.now == 4 and b.window.waiting() == 2)  # b keeps the server at the two shards' four
        with shared_window(client, 2) as c:  # the next shard takes a's slots over: four in all, not six
            assert c.window.slots == 4
            threads.append(in_thread(c, [(i, held_until(meter, go)) for i in range(2)])[0])
            until(lambda: b.window.waiting() == 4)
            assert meter.now == 4
            go.set()
            for t in threads:
                t.join(5)
    assert meter.peak == 4 and not _windows
    # A window opened again holds its first shard's slots only.
    with shared_window(client, 2) as d:
        meter, go = Meter(), threading.Event()
        t, _ = in_thread(d, [(i, held_until(meter, go)) for i in range(4)])
        until(lambda: meter.now == 2 and d.window.waiting() == 2)
        go.set()
        t.join(5)
    assert meter.peak == 2


def test_a_failing_conversation_fails_its_shard_and_the_rest_never_starts():
    ran: list[str] = []

    async def slow():
        await asyncio.sleep(0.05)
        ran.append("slow")  # already running when the other failed: waited for

    async def failing():
        raise ZeroDivisionError

    async def later():
        ran.append("later")

    with shared_window(object(), 2) as a:
        with pytest.raises(ZeroDivisionError):
            a.run([(0, slow), (1, failing), (2, later)])
        assert ran == ["slow"] and a.gone.is_set()
        assert a.run([]) == []


def test_the_windows_loop_ends_with_it():
    def loops():
        return [t for t in threading.enumerate() if t.name == "eyrie-regen-requests"]

    before = len(loops())
    with shared_window(object(), 3) as a:
        assert len(loops()) == before + 1

        async def one():
            return 1

        assert a.run([(0, one)]) == [1]
    until(lambda: len(loops()) == before)


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


def test_a_shard_whose_conversations_all_fail_raises_one_error_and_logs_none():
    """A server gone fails every conversation of the shard: the first error is raised, the others read, so asyncio
    reports no "exception was never retrieved" for them (a traceback per conversation in the user's log)."""
    import gc

    async def gone():
        await asyncio.sleep(0.01)  # in flight together, as requests to a server that is gone
        raise ConnectionError("no answer")

    unread: list[dict] = []
    raised = False
    with shared_window(object(), 4) as a:
        a.window._loop.loop.set_exception_handler(lambda loop, context: unread.append(context))
        try:
            a.run([(i, gone) for i in range(8)])
        except ConnectionError:  # dropped here, as a caller that logs it and goes on: its futures with it
            raised = True
    del a
    gc.collect()
    assert raised
    assert not [c for c in unread if "never retrieved" in c.get("message", "")], unread
