"""The requests to one extraction server, shared by the shards extracting from it at the same time."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

from eyrie.run.loop import LoopThread


# Threads that check, hash and move the files answered (extract_shard), beside the requests in flight: one per four
# cores, two at least and eight at most. On a 2-core CPU server two keep up (0.3-0.5 ms of CPU a file) and eight
# measured 5-9% slower (benchmarks/extract_throughput.py), holding the GIL away from the request loop and the cores
# away from the server. A GPU server answers far faster than the files it writes can be hashed on two threads:
# a 25 MB file (1536 tokens x 4 layers x 2048, bf16) costs ~20 ms of CPU here, most of it the sha256 (14 ms;
# benchmarks/extract_client_cost.py), while an H200 answers 96 such requests in 0.53 s; a 16-core host gets four.
def _file_threads() -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 2
    return max(2, min(8, cores // 4))


FILE_THREADS = _file_threads()


def _one_thread() -> None:
    import torch  # here: a run whose shards are done never starts these threads, and imports no torch

    torch.set_num_threads(1)


@contextlib.asynccontextmanager
async def _extractor(
    client, concurrency: int
) -> AsyncIterator[Callable[[list[int], float, str | None], Awaitable[str]]]:
    """`client.extract` as a coroutine taking the key the file is made under: ServerClient's own (one aiohttp
    session, the key sent for the connector to record), else the client's blocking call in a thread per request in
    flight (test doubles, which know no key: extraction records it in their files itself)."""
    if hasattr(client, "async_extractor"):
        async with client.async_extractor(concurrency) as extract:
            yield extract
        return
    loop = asyncio.get_running_loop()
    with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="eyrie-request") as pool:

        async def extract(ids: list[int], timeout_s: float, key: str | None = None) -> str:
            return await loop.run_in_executor(pool, client.extract, ids, timeout_s)

        yield extract


class _Window:
    """The requests of every shard this process extracts from one server: one asyncio loop (in a thread of its own),
    one session, at most `concurrency` requests in flight over all those shards, and the file threads.

    Shards extracting at the same time (the flow runs two shard tasks at once) share it, so a shard's last requests
    and its finalisation (fsyncs, manifest) overlap the next shard's requests instead of draining the server's queue
    at every shard boundary, and the server sees `concurrency` requests in flight, not `concurrency` per shard.
    Slots are taken in the order requests were queued: the shard that started first finishes first."""

    def __init__(self, client, concurrency: int):
        self._loop = LoopThread("eyrie-requests")
        self.run = self._loop.run
        self.files = ThreadPoolExecutor(
            max_workers=min(concurrency, FILE_THREADS), thread_name_prefix="eyrie-files", initializer=_one_thread
        )
        self.users = 0
        self._session = contextlib.AsyncExitStack()

        async def start() -> None:
            self.slots = asyncio.Semaphore(concurrency)
            self.extract = await self._session.enter_async_context(_extractor(client, concurrency))

        try:
            self.run(start())
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        try:
            self.run(self._session.aclose())
        finally:
            self._loop.stop()
            self.files.shutdown()


_windows: dict[tuple, _Window] = {}
_windows_lock = threading.Lock()


@contextlib.contextmanager
def _shared_window(client, concurrency: int):
    """The window for `client`'s server, opened by its first user and closed by its last. Each shard task builds a
    ServerClient of its own: clients of one URL and API key share a window; any other client (a test double) has
    one of its own."""
    if hasattr(client, "async_extractor"):
        key: tuple = (client.base_url, client.session.headers.get("Authorization"), concurrency)
    else:
        key = (id(client), concurrency)
    with _windows_lock:
        window = _windows.get(key)
        if window is None:
            window = _windows[key] = _Window(client, concurrency)
        window.users += 1
    try:
        yield window
    finally:
        with _windows_lock:
            window.users -= 1
            last = window.users == 0
            if last:
                del _windows[key]
        if last:
            window.close()
