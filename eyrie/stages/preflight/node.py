"""Preflight's checks of the node: what a run needs of the machine and the filesystems it runs on (issue 22,
item 7): the GPUs, the run folder's flock, /dev/shm for online training, the disk for the hidden states."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from eyrie.config import DataConfig, ExtractionConfig, TargetConfig, TrainConfig
from eyrie.hidden_states.encoding import FP8, bytes_per_token


def hidden_state_bytes(tokens: int, num_captured: int, hidden_size: int, dtype_bytes: int = 2) -> int:
    """Bytes of hidden states for `tokens` tokens as the files hold them (`bytes_per_token`: the values, fp8's
    float32 scale per token, the int64 token id)."""
    return tokens * bytes_per_token(num_captured, hidden_size, FP8 if dtype_bytes == 1 else "bfloat16")


def bytes_still_to_write(train: TrainConfig, estimated_bytes: int, hidden_dir: Path) -> int:
    """What the disk check asks for: the estimated hidden states less those already on disk (a re-run of a half
    finished extraction, or a finished one, needs only the rest); nothing with online hidden states, which go
    through tmpfs and never reach the run folder."""
    if train.hidden_states == "online":
        return 0
    have = 0
    stack = [hidden_dir]
    while stack:  # os.scandir: one stat per file from the directory read itself, for 200,000 files
        try:
            with os.scandir(stack.pop()) as entries:
                for e in entries:
                    if e.is_dir(follow_symlinks=False):
                        stack.append(Path(e.path))
                    elif e.is_file(follow_symlinks=False):
                        have += e.stat(follow_symlinks=False).st_size
        except FileNotFoundError:
            continue
    return max(estimated_bytes - have, 0)


# The device nodes a CUDA (NVIDIA) or ROCm (AMD) GPU shows in /dev: torch can see no GPU where there are none.
GPU_DEVICE_NODES = ("nvidia[0-9]*", "kfd")


def gpu_count(dev: Path = Path("/dev")) -> int:
    """The GPUs this process may use (CUDA_VISIBLE_DEVICES applied), without creating a CUDA context. On a host with
    no GPU device node, 0 without importing torch (seconds of every preflight, a cached run's included)."""
    if not any(any(dev.glob(pattern)) for pattern in GPU_DEVICE_NODES):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_train_devices(train: TrainConfig, target: TargetConfig, gpus: int | None = None) -> list[str]:
    """train.devices no larger than the GPUs present, when training runs on GPUs; online, the extraction server's
    GPUs beside the trainer's too. A host with no GPU at all is not judged: preflight of a GPU config runs from a
    login node too, and the GPU node's preflight (each run's own) decides."""
    t = train
    if t.device == "cpu":
        return []
    gpus = gpu_count() if gpus is None else gpus
    if gpus == 0:
        return []
    need, what = t.devices, f"train.devices {t.devices}"
    if t.hidden_states == "online":  # the server stays up, on GPUs of its own, while the trainer runs
        need += target.tensor_parallel_size
        what += f" + target.tensor_parallel_size {target.tensor_parallel_size} (online: the server stays up)"
    if need > gpus:
        return [
            f"{what} need {need} GPUs, but {gpus} are visible here: lower train.devices (or the tensor "
            "parallelism), or run on a node with more GPUs"
        ]
    return []


def _unescape_mount(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), field)


def mount_of(path: Path, mounts: str | None = None) -> tuple[str, str, set[str]] | None:
    """(mount point, filesystem type, options) of the filesystem holding `path` (its nearest existing folder, with
    symlinks resolved), from /proc/mounts; from `mounts` instead (that text, `path` taken as it is written) when
    given. None when /proc/mounts cannot be read."""
    p = Path(os.path.abspath(path))
    if mounts is None:
        while not p.exists() and p != p.parent:
            p = p.parent
        p = Path(os.path.realpath(p))
        try:
            mounts = Path("/proc/mounts").read_text()
        except OSError:
            return None
    best = None
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 4:
            continue
        point = _unescape_mount(fields[1])
        if (p == Path(point) or Path(point) in p.parents) and (best is None or len(point) >= len(best[0])):
            best = (point, fields[2], set(fields[3].split(",")))
    return best


def check_lock_filesystem(run_dir: Path, mounts: str | None = None) -> list[str]:
    """The run lock (an flock on the run folder) must hold across nodes: refused on a filesystem whose flock is
    node-local (Lustre `localflock`, NFS `nolock` or `local_lock=flock|all`) or absent (Lustre without `flock`),
    where two nodes would both hold it and interleave their writes."""
    found = mount_of(run_dir, mounts)
    if found is None:
        return []
    point, fstype, options = found
    why = None
    if fstype == "lustre":
        if "localflock" in options:
            why = "Lustre mounted with `localflock`: flock is local to each client node"
        elif "flock" not in options:
            why = "Lustre mounted without `flock` (or with `noflock`): flock is not supported"
    elif fstype in ("nfs", "nfs4"):
        if "nolock" in options:
            why = "NFS mounted with `nolock`: locks are local to each client node"
        elif {"local_lock=flock", "local_lock=all"} & options:
            why = "NFS mounted with `local_lock`: flock is local to each client node"
    if why is None:
        return []
    return [
        f"the run folder {run_dir} is on {point} ({why}), so the run lock would not keep two runs (or a run and "
        "`eyrie verify`) on different nodes apart: use a --run-dir on a filesystem with cluster-wide flock (Lustre "
        "`-o flock`, NFS without `nolock`/`local_lock`, a node-local disk for a one-node run)"
    ]


def check_online_tmpfs(
    train: TrainConfig, data: DataConfig, extraction: ExtractionConfig, run_dir: Path, captured: int, hidden: int
) -> list[str]:
    """Online training keeps the requests in flight as files on tmpfs: it must hold them all at the longest sample
    (every request of extraction.concurrency, twice: those written and not yet read beside those being written)."""
    if train.hidden_states != "online" or not captured or not hidden:
        return []
    from eyrie.hidden_states.staging import staging_dir

    base = staging_dir(run_dir).parent
    try:
        free = shutil.disk_usage(base).free
    except OSError:
        return [f"online hidden states go through {base}, which does not exist: create it, or set $EYRIE_ONLINE_TMPFS"]
    per_sample = hidden_state_bytes(
        data.max_length, captured, hidden, 1 if extraction.hidden_states_dtype == "float8_e4m3fn" else 2
    )
    need = 2 * extraction.concurrency * per_sample
    if need > free:
        return [
            f"online training keeps up to {2 * extraction.concurrency} samples of up to "
            f"{per_sample / 2**20:.0f} MiB in flight on {base}, {need / 2**30:.2f} GiB, but it has "
            f"{free / 2**30:.2f} GiB free: enlarge it (`mount -o remount,size=... {base}`), point $EYRIE_ONLINE_TMPFS "
            "at a larger tmpfs, or lower extraction.concurrency or data.max_length"
        ]
    return []


def judge_host(
    train: TrainConfig, target: TargetConfig, runs_here: bool, gpus: int | None = None
) -> tuple[list[str], list[str]]:
    """(failures, not judged) of this host's GPUs for the run. `runs_here`: the run itself runs on this host (the
    flow's own preflight), so `train.device: cuda` with no GPU visible is refused (it would fail at the train stage,
    after extraction). Otherwise (`eyrie preflight` on a login node or a laptop, checking a config for a GPU node)
    what needs GPUs is said to be not judged here, never passed silently."""
    if train.device == "cpu":
        return [], []
    gpus = gpu_count() if gpus is None else gpus
    if gpus:
        return [], []  # check_train_devices counts them
    needs = [f"train.device {train.device}"] if train.device == "cuda" else []
    if train.devices > 1:
        needs.append(f"train.devices {train.devices}")
    if target.tensor_parallel_size > 1:
        needs.append(f"target.tensor_parallel_size {target.tensor_parallel_size}")
    if not needs:
        return [], []  # device auto, one device: training runs on this CPU
    if runs_here and train.device == "cuda":
        return [
            "train.device is cuda but no GPU is visible on this host (no GPU device node, or CUDA_VISIBLE_DEVICES "
            "hides them): run on a GPU node, or set train.device: cpu (or auto) for a CPU run"
        ], []
    return [], [
        f"the GPUs ({', '.join(needs)}): no GPU is visible here; the run's own preflight on its node judges them"
    ]
