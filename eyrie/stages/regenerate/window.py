"""The request slots of one regeneration server, shared by the shards regenerating from it at the same time."""

from __future__ import annotations

import contextlib
import heapq
import itertools
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

from eyrie.vllm.client import ServerClient


def client_connections(concurrency: int) -> int:
    """Pooled connections of a shard task's `ServerClient`: a shard's conversations may hold every slot of the window
    while the other shard running beside it has none waiting (two shard tasks at a time: twice its own), and more
    shard tasks at once make more slots; four times its own leaves room."""
    return max(10, 4 * concurrency)


class _Job:
    """A conversation waiting for a slot: its place in line (shard, position, arrival) and the work it does there."""

    __slots__ = ("order", "run", "future")

    def __init__(self, order: tuple[int, int, int], run: Callable[[], Any]):
        self.order = order
        self.run = run
        self.future: Future = Future()

    def __lt__(self, other: _Job) -> bool:
        return self.order < other.order


class _Window:
    """Conversations in flight to one server from the shards regenerating from it in this process. Each shard brings
    its slots (`join`); the window has one worker thread per slot, each taking the next conversation in line and
    running it to its end, so no more conversations are in flight than the slots and a freed slot wakes exactly one
    thread. A shard's idle slots (its last conversations finishing, its rows being written) serve the other running
    shards' conversations, so the server keeps its queue across a shard boundary. The line's order: the shard that
    joined first, then the conversation (`submit`'s position), so the shard that started first finishes first and its
    tail overlaps the next one's full window. The workers last as long as the window: a shard that joins finds them
    started.

    A shard that returns leaves its slots in the window, spare, until a shard joins and takes them over: the gap
    before the flow starts the next shard task, and the last shard of a run alone, keep the load the shard tasks
    running at once put on the server, never more (the most slots the running shards brought at once). The window
    closes with its last shard."""

    def __init__(self) -> None:
        self._ready = threading.Condition()
        self._queue: list[_Job] = []  # a heap: the next to get a slot first
        self._workers: list[threading.Thread] = []
        self._spare = 0  # of the slots: those of shards that left, not yet taken over by a shard that joined
        self._closed = False
        self._arrivals = itertools.count()
        self._shards = itertools.count()
        self.users = 0

    @property
    def slots(self) -> int:
        return len(self._workers)

    def join(self, slots: int) -> int:
        """A shard adds `slots`, first taking over those a shard that left kept in the window; returns its rank
        (earlier shards first)."""
        with self._ready:
            taken = min(self._spare, slots)
            self._spare -= taken
            started = [
                threading.Thread(target=self._work, name=f"eyrie-regen-{len(self._workers) + i}", daemon=True)
                for i in range(slots - taken)
            ]
            self._workers += started
            rank = next(self._shards)
        for worker in started:  # outside the lock: the running workers keep taking conversations meanwhile
            worker.start()
        return rank

    def leave(self, slots: int) -> None:
        """A shard is done: its slots stay, spare, for the shards still running or the next to join."""
        with self._ready:
            self._spare += slots

    def submit(self, shard: int, position: int, run: Callable[[], Any]) -> Future:
        """`run` in the next free slot, in (shard, position) order; its Future holds what it returns or raises (a
        Future cancelled before its slot came never runs)."""
        job = _Job((shard, position, next(self._arrivals)), run)
        with self._ready:
            heapq.heappush(self._queue, job)
            self._ready.notify()
        return job.future

    def close(self) -> None:
        """The last shard left: the workers end (nothing is waiting: each shard waited for its conversations)."""
        with self._ready:
            self._closed = True
            self._ready.notify_all()

    def waiting(self) -> int:
        """Conversations waiting for a slot."""
        with self._ready:
            return len(self._queue)

    def _work(self) -> None:
        while True:
            with self._ready:
                while not self._queue and not self._closed:
                    self._ready.wait()
                if not self._queue:
                    return
                job = heapq.heappop(self._queue)
            if not job.future.set_running_or_notify_cancel():
                continue
            try:
                result = job.run()
            except BaseException as err:  # the shard's thread raises it from the Future
                job.future.set_exception(err)
            else:
                job.future.set_result(result)


class Share:
    """One shard's place in its server's window: its rank and its `gone` event (the server stopped answering)."""

    def __init__(self, window: _Window, rank: int):
        self.window = window
        self.rank = rank
        self.gone = threading.Event()

    def submit(self, position: int, run: Callable[[], Any]) -> Future:
        """The shard's conversation `position`, run in a slot of the window."""
        return self.window.submit(self.rank, position, run)

    def abandon(self) -> None:
        """The server is gone: this shard's conversations send no more requests (their `generate` checks `gone`)."""
        self.gone.set()


_windows: dict[tuple, _Window] = {}
_windows_lock = threading.Lock()


@contextlib.contextmanager
def shared_window(client, slots: int) -> Iterator[Share]:
    """The shard's share of the window for `client`'s server, `slots` of it its own while the block runs; the window
    is opened by its first user and closed by its last. Each shard task builds a ServerClient of its own: clients of
    one URL and API key share a window; any other client (a test double) has one of its own."""
    if isinstance(client, ServerClient):
        key: tuple = (client.base_url, client.session.headers.get("Authorization"))
    else:
        key = (id(client),)
    with _windows_lock:
        window = _windows.get(key)
        if window is None:
            window = _windows[key] = _Window()
        window.users += 1
    rank = window.join(slots)
    try:
        yield Share(window, rank)
    finally:
        window.leave(slots)
        with _windows_lock:
            window.users -= 1
            if window.users == 0:
                del _windows[key]
                window.close()
