"""Preflight: every check that needs no weights, run in seconds before the expensive steps.

- `check`: the whole check (`run_preflight`), every failure found, not only the first;
- `target`: the target's layer ids, its vLLM class and the EAGLE-3 interface, its context, parallelism and serving,
  what the drafter borrows;
- `installed_vllm`: the installed vLLM against the config (version, server arguments, server variables);
- `node`: the machine and its filesystems (GPUs, the run lock's flock, /dev/shm, the disk);
- `report`: what was found (`preflight.json`, the markdown artifact).
"""

from eyrie.stages.preflight.check import run_preflight
from eyrie.stages.preflight.installed_vllm import (
    check_server_arguments,
    check_vllm_version,
    parse_server_arguments,
    serve_parser,
)
from eyrie.stages.preflight.node import (
    bytes_still_to_write,
    check_lock_filesystem,
    check_online_tmpfs,
    check_train_devices,
    mount_of,
)
from eyrie.stages.preflight.report import PreflightReport, report_markdown
from eyrie.stages.preflight.target import (
    captured_layer_ids,
    default_aux_layer_ids,
    probe_eagle3,
    resolve_vllm_class,
)

__all__ = [
    "PreflightReport",
    "bytes_still_to_write",
    "captured_layer_ids",
    "check_lock_filesystem",
    "check_online_tmpfs",
    "check_server_arguments",
    "check_train_devices",
    "check_vllm_version",
    "default_aux_layer_ids",
    "mount_of",
    "parse_server_arguments",
    "probe_eagle3",
    "report_markdown",
    "resolve_vllm_class",
    "run_preflight",
    "serve_parser",
]
