"""The target's load, made as short as its storage allows, and checked before it starts.

Two things decide most of a large target's start-up besides the GPUs: how vLLM reads the weights, and whether the
compile cache survives a restart. Preflight warns (it does not refuse: a slower load still works) when:

- the checkpoint sits on a network filesystem (NFS, Lustre, GPFS, CephFS, a FUSE mount...) and the server is told no
  loading strategy: vLLM's default memory-maps each file and faults its pages in one by one over the network.
  `--safetensors-load-strategy prefetch` reads the files ahead in parallel (DeepSeek-V3 from 1,500 s to 435 s in
  vllm-project/vllm #36012), and `--load-format runai_streamer` streams them (object stores, network disks);
- the model is compiled (`extraction.enforce_eager: false`) and vLLM's compile cache (`VLLM_CACHE_ROOT`, else
  `~/.cache/vllm`) is on a network filesystem or not writable: a restart then compiles again, or nodes share one
  cache folder. The GPU worker's unit and image put it on the node's local disk (`/var/cache/eyrie/vllm`).
Whether the installed vLLM knows a flag and value is checked with the rest of the server arguments, by its own
`vllm serve` parser (eyrie.stages.preflight.check_server_arguments).
"""

from __future__ import annotations

import os
from pathlib import Path

from eyrie.hidden_states.staging import filesystem_type

NETWORK_FILESYSTEMS = ("nfs", "nfs4", "lustre", "gpfs", "ceph", "cifs", "smb3", "beegfs", "glusterfs", "9p")
LOAD_FLAGS = ("--safetensors-load-strategy", "--load-format")


def is_network_filesystem(path: Path) -> bool:
    kind = filesystem_type(path) or ""
    return kind in NETWORK_FILESYSTEMS or kind.startswith("fuse")


def _names_flag(server_args: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in server_args)


def compile_cache_root(env: dict[str, str]) -> Path:
    """Where vLLM keeps its torch.compile cache (vllm.envs: VLLM_CACHE_ROOT, else XDG_CACHE_HOME/vllm)."""
    if root := env.get("VLLM_CACHE_ROOT"):
        return Path(root).expanduser()
    return Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "vllm"


def weights_folder(target) -> str:
    """Where the server reads the target's weights from: the local folder, else the hub cache (HF_HOME)."""
    if Path(target.model).exists():
        return target.model
    return os.environ.get("HF_HUB_CACHE") or str(Path(os.environ.get("HF_HOME") or "~/.cache/huggingface") / "hub")


def load_warnings(
    model: str, server_args: list[str], enforce_eager: bool, server_env: dict[str, str], env=os.environ
) -> list[str]:
    """What would make this server's start slower than it needs to be; each line names the fix."""
    warnings = []
    local = Path(model).expanduser()
    if local.exists() and is_network_filesystem(local) and not any(_names_flag(server_args, f) for f in LOAD_FLAGS):
        warnings.append(
            f"the target's weights ({model}) are on a {filesystem_type(local)} filesystem and the server is given no "
            "loading strategy: add `--safetensors-load-strategy=prefetch` to extraction.server_args (it reads the "
            "files ahead in parallel) or `--load-format=runai_streamer`, or copy the checkpoint to local disk"
        )
    if not enforce_eager:
        root = compile_cache_root({**env, **server_env})
        if is_network_filesystem(root):
            warnings.append(
                f"vLLM's compile cache ({root}) is on a {filesystem_type(root)} filesystem: set VLLM_CACHE_ROOT to "
                "the node's local disk (the worker unit uses /var/cache/eyrie/vllm) so a restart compiles nothing"
            )
        else:
            existing = next((p for p in (root, *root.parents) if p.exists()), None)
            if existing is not None and not os.access(existing, os.W_OK):
                warnings.append(
                    f"vLLM's compile cache ({root}) is not writable here: every start compiles again; set "
                    "VLLM_CACHE_ROOT to a writable folder on the node's local disk"
                )
    return warnings + bytecode_warnings({**env, **server_env})


def bytecode_warnings(env: dict[str, str], package: str = "vllm") -> list[str]:
    """Where the server's Python may not write bytecode (PYTHONDONTWRITEBYTECODE) and the install wrote none (uv
    installs without .pyc unless asked), every vLLM process compiles vLLM's ~9,000 modules from source again: about
    40 s of CPU at each start on a 2-core machine, in the server's API process, its engine core and each worker."""
    import importlib.util

    if not env.get("PYTHONDONTWRITEBYTECODE"):
        return []
    spec = importlib.util.find_spec(package)  # the package's location; nothing of it is run
    if spec is None or spec.origin is None or Path(importlib.util.cache_from_source(spec.origin)).exists():
        return []
    return [
        f"PYTHONDONTWRITEBYTECODE is set and {package} was installed without bytecode ({Path(spec.origin).parent} "
        "has no __pycache__): every vLLM process compiles its modules again at start; unset the variable for "
        "Eyrie, or install with compiled bytecode (`uv pip install --compile-bytecode`, or pip, which compiles)"
    ]
