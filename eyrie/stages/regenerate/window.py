"""The request slots of one regeneration server, shared by the shards regenerating from it at the same time."""

from __future__ import annotations

import contextlib
import heapq
import itertools
import threading
from collections.abc import Iterator

from eyrie.vllm.client import ServerClient

# How many of its own slots a shard's threads may hold at most: a shard sends more than `regenerate.concurrency`
# requests only with slots another running shard leaves idle (its tail, its rows being written), and two shards at a
# time (the flow's task runner) make that twice its own; four leaves room for more shard tasks at once.
SHARE_LIMIT = 4


def shard_threads(concurrency: int, conversations: int) -> int:
    """Threads of a shard's pool: one per conversation, up to `SHARE_LIMIT` times its own slots."""
    return max(1, min(conversations, SHARE_LIMIT * concurrency))


def client_connections(concurrency: int) -> int:
    """Pooled connections of a shard task's `ServerClient`: as many as its threads may have requests in flight."""
    return max(10, SHARE_LIMIT * concurrency)


class _Window:
    """Requests in flight to one server from the shards regenerating from it in this process. Each shard brings its
    slots (`share`) and no request starts while every slot is taken; a shard's idle slots (its last conversations
    finishing, its rows being written) serve the other running shards' conversations, so the server keeps its queue
    across a shard boundary. Slots go in order: the shard that joined first, then the conversation (`take`'s
    position), so the shard that started first finishes first and its tail overlaps the next one's full window.

    A shard that returns leaves its slots in the window, spare, until a shard joins and takes them over: the gap
    before the flow starts the next shard task, and the last shard of a run alone, keep the load the shard tasks
    running at once put on the server, never more (the most slots the running shards brought at once). The window
    closes with its last shard."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._capacity = 0
        self._spare = 0  # of the capacity: the slots of shards that left, not yet taken over by a shard that joined
        self._busy = 0
        # Waiting requests, in the order they get slots: ((shard, position), arrival).
        self._queue: list[tuple[tuple[int, int], int]] = []
        self._arrivals = itertools.count()
        self._shards = itertools.count()
        self.users = 0

    def join(self, slots: int) -> int:
        """A shard adds `slots`, first taking over those a shard that left kept in the window; returns its rank
        (earlier shards first)."""
        with self._changed:
            taken = min(self._spare, slots)
            self._spare -= taken
            self._capacity += slots - taken
            self._changed.notify_all()
            return next(self._shards)

    def leave(self, slots: int) -> None:
        """A shard is done: its slots stay, spare, for the shards still running or the next to join."""
        with self._changed:
            self._spare += slots

    def take(self, shard: int, position: int, stop: threading.Event) -> bool:
        """Wait for a slot, in (shard, position) order; False, with no slot, once `stop` is set (`wake` it)."""
        with self._changed:
            entry = ((shard, position), next(self._arrivals))
            heapq.heappush(self._queue, entry)
            while not stop.is_set() and not (self._queue[0] == entry and self._busy < self._capacity):
                self._changed.wait()
            if self._queue[0] == entry:
                heapq.heappop(self._queue)
            else:  # given up while others were ahead
                self._queue.remove(entry)
                heapq.heapify(self._queue)
            held = not stop.is_set()
            self._busy += held
            self._changed.notify_all()  # the next in line may take a slot still free
            return held

    def give(self) -> None:
        """A slot `take` returned is free again."""
        with self._changed:
            self._busy -= 1
            self._changed.notify_all()

    def wake(self) -> None:
        """Every waiter checks its `stop` again."""
        with self._changed:
            self._changed.notify_all()

    def waiting(self) -> int:
        """Requests waiting for a slot."""
        with self._changed:
            return len(self._queue)


class Share:
    """One shard's place in its server's window: its rank and its `gone` event (the server stopped answering)."""

    def __init__(self, window: _Window, rank: int):
        self.window = window
        self.rank = rank
        self.gone = threading.Event()

    @contextlib.contextmanager
    def slot(self, position: int) -> Iterator[bool]:
        """A slot for a request of the shard's conversation `position`, held for the block; False (no slot) once the
        shard is abandoned."""
        held = self.window.take(self.rank, position, self.gone)
        try:
            yield held
        finally:
            if held:
                self.window.give()

    def abandon(self) -> None:
        """The server is gone: this shard's waiting requests give up (`slot` yields False)."""
        self.gone.set()
        self.window.wake()


_windows: dict[tuple, _Window] = {}
_windows_lock = threading.Lock()


@contextlib.contextmanager
def shared_window(client, slots: int) -> Iterator[Share]:
    """The shard's share of the window for `client`'s server, `slots` of it its own while the block runs; the window
    is opened by its first user and dropped by its last. Each shard task builds a ServerClient of its own: clients of
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
