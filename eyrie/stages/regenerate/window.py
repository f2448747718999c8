"""The requests to one regeneration server, shared by the shards regenerating from it at the same time."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from eyrie.run.loop import LoopThread
from eyrie.vllm.client import ServerClient

# Threads for a client with no `async_generator` (test doubles), whose blocking `generate` runs in a thread per
# request in flight: more than the slots of any window a test opens.
_BLOCKING_THREADS = 64


@contextlib.asynccontextmanager
async def _generator(client) -> AsyncIterator[Callable[..., Awaitable[dict]]]:
    """`client.generate` as a coroutine: ServerClient's own (one aiohttp session), else its blocking call in a
    thread (test doubles)."""
    if hasattr(client, "async_generator"):
        async with client.async_generator() as generate:
            yield generate
        return
    loop = asyncio.get_running_loop()
    with ThreadPoolExecutor(max_workers=_BLOCKING_THREADS, thread_name_prefix="eyrie-regen-request") as pool:

        async def generate(*args, **kw) -> dict:
            return await loop.run_in_executor(pool, lambda: client.generate(*args, **kw))

        yield generate


class _Job:
    """A conversation waiting for a slot: its place in line (shard, position, arrival) and the coroutine it runs."""

    __slots__ = ("order", "run", "future")

    def __init__(self, order: tuple[int, int, int], run: Callable[[], Awaitable[Any]], future: asyncio.Future):
        self.order = order
        self.run = run
        self.future = future

    def __lt__(self, other: _Job) -> bool:
        return self.order < other.order


class _Window:
    """The conversations in flight to one server from the shards regenerating from it in this process: one asyncio
    loop in a thread of its own and one HTTP session, as extraction's window (a thread per request in flight cost the
    cores the server needs several times the CPU per request: requests' layers and the GIL, whose waiting threads
    crowd a small machine's run queue whenever answers arrive together).

    Each shard brings its slots (`join`): one worker per slot takes the next conversation in line and runs it to its
    end, so no more conversations are in flight than the slots. A shard's idle slots (its last conversations
    finishing, its rows being written) serve the other running shards' conversations, so the server keeps its queue
    across a shard boundary. The line's order: the shard that joined first, then the conversation's position, so the
    shard that started first finishes first and its tail overlaps the next one's full window.

    A shard that returns leaves its slots in the window, spare, until a shard joins and takes them over: the gap
    before the flow starts the next shard task, and the last shard of a run alone, keep the load the shard tasks
    running at once put on the server, never more (the most slots the running shards brought at once). The window
    closes with its last shard."""

    def __init__(self, client) -> None:
        self._loop = LoopThread("eyrie-regen-requests")
        self.run = self._loop.run
        self._session = contextlib.AsyncExitStack()
        self._workers: list[asyncio.Task] = []
        self._spare = 0  # of the slots: those of shards that left, not yet taken over by a shard that joined
        self._arrivals = itertools.count()
        self._shards = itertools.count()
        self.users = 0

        async def start() -> None:
            self._queue: asyncio.PriorityQueue[_Job] = asyncio.PriorityQueue()
            self.generate = await self._session.enter_async_context(_generator(client))

        try:
            self.run(start())
        except BaseException:
            self._loop.stop()
            raise

    @property
    def slots(self) -> int:
        return len(self._workers)

    def waiting(self) -> int:
        """Conversations waiting for a slot."""
        return self._queue.qsize()

    def join(self, slots: int) -> int:
        """A shard adds `slots`, first taking over those a shard that left kept in the window; returns its rank
        (earlier shards first)."""

        async def join() -> int:
            taken = min(self._spare, slots)
            self._spare -= taken
            self._workers += [asyncio.create_task(self._work()) for _ in range(slots - taken)]
            return next(self._shards)

        return self.run(join())

    def leave(self, slots: int) -> None:
        """A shard is done: its slots stay, spare, for the shards still running or the next to join."""

        async def leave() -> None:
            self._spare += slots

        self.run(leave())

    def submit(self, shard: int, position: int, run: Callable[[], Awaitable[Any]]) -> asyncio.Future:
        """On the loop: `run` in the next free slot, in (shard, position) order; its future holds what it returns or
        raises."""
        job = _Job((shard, position, next(self._arrivals)), run, self._loop.loop.create_future())
        self._queue.put_nowait(job)
        return job.future

    async def _work(self) -> None:
        while True:
            job = await self._queue.get()
            try:
                result = await job.run()
            except asyncio.CancelledError:  # the window closes
                job.future.cancel()
                raise
            except BaseException as err:  # the shard raises it
                job.future.set_exception(err)
            else:
                job.future.set_result(result)

    def close(self) -> None:
        """The last shard left (each waited for its conversations): the workers and the session end."""

        async def stop() -> None:
            for worker in self._workers:
                worker.cancel()
            await asyncio.gather(*self._workers, return_exceptions=True)
            await self._session.aclose()

        try:
            self.run(stop())
        finally:
            self._loop.stop()


class Share:
    """One shard's place in its server's window: its rank and its `gone` event (the server stopped answering)."""

    def __init__(self, window: _Window, rank: int):
        self.window = window
        self.rank = rank
        self.gone = threading.Event()

    async def generate(self, *args, **kw) -> dict:
        """`ServerClient.generate`'s answer, on the window's session (a coroutine of the window's loop)."""
        return await self.window.generate(*args, **kw)

    def run(self, conversations: list[tuple[int, Callable[[], Awaitable[Any]]]]) -> list[Any]:
        """Run each (position, coroutine function) in the window's slots and return their results in the order
        given. One that raises fails the shard: those not started never start, those running send nothing more
        (`gone`) and are waited for, and the first error in the order given is raised."""

        def guarded(run: Callable[[], Awaitable[Any]]) -> Callable[[], Awaitable[Any]]:
            async def go() -> Any:
                if self.gone.is_set():  # the shard failed: nothing more of it starts
                    return None
                try:
                    return await run()
                except BaseException:
                    self.abandon()
                    raise

            return go

        async def run_all() -> list[Any]:
            futures = [self.window.submit(self.rank, position, guarded(run)) for position, run in conversations]
            try:
                if futures:
                    await asyncio.wait(futures)
            except asyncio.CancelledError:  # the shard's thread stopped waiting
                self.abandon()
                raise
            # Every error read (asyncio logs "exception was never retrieved" for any left unread), the first raised.
            errors = [e for e in (f.exception() for f in futures) if e is not None]
            if errors:
                raise errors[0]
            return [f.result() for f in futures]

        return self.window.run(run_all())

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
            window = _windows[key] = _Window(client)
        window.users += 1
    rank = window.join(slots)
    try:
        yield Share(window, rank)
    finally:
        window.leave(slots)
        with _windows_lock:
            window.users -= 1
            last = window.users == 0
            if last:
                del _windows[key]
        if last:
            window.close()
