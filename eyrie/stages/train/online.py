"""Online hidden states (`train.hidden_states: online`): the trainer asks the running extraction server for each
sample's hidden states as it trains, and nothing is kept on disk.

It is speculators' own on-missing `generate` path (`speculators.train.data.ArrowDataset` with `--on-missing
generate`), pointed at Eyrie's extraction server: the request is the one Eyrie's extraction sends (`/v1/completions`
with the prompt as token ids, `max_tokens` 1, `return_token_ids`), Eyrie's connector (a subclass of vLLM's example
hidden-states connector) answers with `kv_transfer_params.hidden_states_path`, and speculators' `FileTransfer` waits
on the file's lock, loads it, checks token ids, shape and finiteness, and deletes the file and its lock. The only
differences from speculators' stock client are in `eyrie.stages.train.online_dataset`: the served model name (`target`)
and the
server's API key.

The server writes those transient files to its storage path, which in online mode is on tmpfs (`/dev/shm`, or
`$EYRIE_ONLINE_TMPFS`), so no hidden-state byte reaches a persistent disk. Requests in flight when a trainer is
killed leave files behind; `clean` removes them before the trainer (re)starts and after it ends.

Resuming is the offline mode's: speculators' checkpoint (epoch, step, optimizer) plus its data order, which is a
function of the seed and the epoch (the packing sampler), so a resumed run skips the batches it trained on without
asking the server for them and asks for the rest in the same order. The server is reused when it is still up (it
runs in its own process group and outlives a killed flow) and started again otherwise.

This module imports nothing heavy: the flow and the unit tests use it without torch or speculators.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

TMPFS_ENV = "EYRIE_ONLINE_TMPFS"
DEFAULT_TMPFS = "/dev/shm"  # noqa: S108 - tmpfs, by design: the files live a few milliseconds
TMPFS_TYPES = ("tmpfs", "ramfs")

# train_entry's switch: replace speculators' dataset with eyrie.stages.train.online_dataset.OnlineDataset.
ONLINE_FLAG = "--eyrie-online"
# ... and the variable holding the server's API key, when it has one (the key itself never goes on a command line).
API_KEY_ENV_FLAG = "--eyrie-online-api-key-env"
CONCURRENCY_FLAG = "--eyrie-online-concurrency"  # a packed batch's samples asked for at once (extraction.concurrency)


def staging_dir(run_root: Path, node: str | None = None, tmpfs: str | None = None) -> Path:
    """Where the extraction server writes each request's file in online mode: a folder on tmpfs named after the run
    folder (and node), so two runs on one machine never share it."""
    base = Path(tmpfs or os.environ.get(TMPFS_ENV) or DEFAULT_TMPFS)
    tag = hashlib.sha256(f"{Path(run_root).resolve()}|{node or ''}".encode()).hexdigest()[:12]
    return base / f"eyrie-online-{tag}"


def filesystem_type(path: Path) -> str | None:
    """The type of the filesystem holding `path` (its nearest existing parent), from /proc/mounts."""
    p = Path(path).resolve()
    while not p.exists() and p != p.parent:
        p = p.parent
    best, kind = "", None
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return None
    for line in mounts:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        if (str(p) == point or str(p).startswith(point.rstrip("/") + "/")) and len(point) > len(best):
            best, kind = point, fields[2]
    return kind


def on_tmpfs(path: Path) -> bool:
    return filesystem_type(path) in TMPFS_TYPES


def transient_files(staging: Path) -> list[Path]:
    if not staging.exists():
        return []
    return [p for p in staging.iterdir() if p.name.endswith((".safetensors", ".lock"))]


def leftover_bytes(staging: Path) -> int:
    """Bytes of hidden-state files (and locks) the server wrote that nobody has read and deleted."""
    total = 0
    for p in transient_files(staging):
        try:
            total += p.stat().st_size
        except FileNotFoundError:
            pass
    return total


def clean(staging: Path) -> tuple[int, int]:
    """Remove the files of requests nobody will read (a killed trainer's requests in flight): (files, bytes)."""
    n = size = 0
    for p in transient_files(staging):
        try:
            size += p.stat().st_size
            p.unlink()
            n += 1
        except FileNotFoundError:
            pass
    return n, size


def online_plan(config, run, report: dict, data_dir: Path):
    """What online training needs from extraction, with nothing extracted: the shard keys extraction would give
    (target identity, captured layers, shard fingerprint: the train key's data keys), the extraction server's spec
    (its storage path on tmpfs, see `ExtractionPlan.staging`) and its folder."""
    from eyrie.stages.extract import ExtractionPlan  # here, not above: eyrie.stages.extract imports this module
    from eyrie.stages.preflight import PreflightReport
    from eyrie.stages.prepare import load_shards

    return ExtractionPlan(config, run, PreflightReport(**report), load_shards(data_dir))


def endpoint(base_url: str) -> str:
    """speculators' `--vllm-endpoint` (the OpenAI client's base URL) for a server's base URL."""
    return base_url.rstrip("/") + ("" if base_url.rstrip("/").endswith("/v1") else "/v1")


def online_args(
    base_url: str, staging: Path, request_timeout_s: float, api_key_env: str | None, concurrency: int = 8
) -> list[str]:
    """The trainer's arguments for online hidden states (replacing the offline `--on-missing raise`).

    `--hidden-states-path` is the server's tmpfs staging folder: speculators first looks there for a cached
    `hs_<i>.safetensors`, which never exists (the server names files by request id), and then generates."""
    args = [
        "--hidden-states-path",
        str(staging),
        "--on-missing",
        "generate",
        "--vllm-endpoint",
        endpoint(base_url),
        "--request-timeout",
        str(request_timeout_s),
        # A sample that failed every attempt (3 HTTP retries, 3 whole round trips) fails the run, which resumes from
        # its checkpoint: speculators' default (20 in a row) trains on without up to 19 samples, silently.
        "--max-consecutive-generation-failures",
        "1",
        ONLINE_FLAG,
        CONCURRENCY_FLAG,
        str(concurrency),
    ]
    if api_key_env:
        args += [API_KEY_ENV_FLAG, api_key_env]
    return args
