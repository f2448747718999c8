"""The environment of the processes Eyrie starts: vLLM servers and the trainer.

Both run code that is not Eyrie's (vLLM, speculators, torch's compilers and, with `target.trust_remote_code`, the
target's own Python), and the flow's environment holds what that code has no business reading: Prefect's
PREFECT_API_KEY and PREFECT_API_AUTH_STRING (the whole Prefect server), the hub token, cloud and database credentials.
So a child gets an allow-list: the variables that configure the accelerator stack, the libraries it runs and the
process itself (`PREFIXES`, `NAMES`), minus any of those whose name says it holds a secret (`SECRET`), plus what the
caller passes explicitly (vLLM's key, the server's `extraction.server_env`, the trainer's settings).

The operator widens it with $EYRIE_PASS_ENV, a comma-separated list of names passed as they are: HF_TOKEN when vLLM
must download a gated target itself, a site's own variables. A secret kept in a file the user can read (the hub's
token file under HF_HOME) stays readable by the same user's code: that needs another user or a container.

Children get the environment as it was when the run started (`started`), not as it is when they start: importing
vLLM sets TORCHINDUCTOR_COMPILE_THREADS=1, PYTORCH_NVML_BASED_CUDA_CHECK, TRITON_CACHE_AUTOTUNING and
TORCHINDUCTOR_CACHE_DIR in the flow's own process, and a trainer started after it compiled on one thread, which the
same trainer started by hand never did. `eyrie run` takes the snapshot first thing, before its config loads; a flow
run by a Prefect worker takes it when the flow starts (each deployment's flow function opens with `started()`): the
worker runs each flow run in a fresh process whose flow modules import neither torch nor vLLM
(tests/unit/test_finished_fast_path.py proves the imports), so nothing has written into the environment yet. A flow
nested in another, or in `eyrie run`, keeps the outer snapshot.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager

PASS_ENV = "EYRIE_PASS_ENV"

PREFIXES = (
    # The accelerator stack: CUDA, its libraries, NCCL and the fabrics under it; ROCm's counterparts.
    "CUDA_",
    "NVIDIA_",
    "NCCL_",
    "NVSHMEM_",
    "CUBLAS",
    "CUDNN_",
    "NVTE_",
    "UCX_",
    "FI_",
    "GLOO_",
    "ROCM_",
    "HIP_",
    "HSA_",
    # The libraries: vLLM, torch and its compilers, the hub and its caches, CPU math threads.
    "VLLM_",
    "TORCH",
    "PYTORCH_",
    "TRITON_",
    "HF_",
    "HUGGINGFACE_",
    "TRANSFORMERS_",
    "TOKENIZERS_",
    "SAFETENSORS_",
    "ATEN_",  # ATEN_CPU_CAPABILITY: torch's CPU kernels' instruction set
    "OMP_",
    "KMP_",
    "MKL_",
    "OPENBLAS_",
    "ONEDNN_",
    "DNNL_",
    # The process: Python, the loader, locale, the job scheduler's description of the allocation, Eyrie's own.
    "PYTHON",
    "LD_",
    "LC_",
    "XDG_",
    "SLURM_",
    "COVERAGE_",
    "EYRIE_",
)
NAMES = frozenset(
    {
        "PATH",
        "HOME",
        "USER",
        "LOGNAME",
        "SHELL",
        "LANG",
        "LANGUAGE",
        "TERM",
        "TMPDIR",
        "TZ",
        "HOSTNAME",
        "PWD",
        "VIRTUAL_ENV",
        "CONDA_PREFIX",
        "CONDA_DEFAULT_ENV",
        "CC",
        "CXX",
        "MASTER_ADDR",
        "MASTER_PORT",
        "WORLD_SIZE",
        "RANK",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        # Downloads (a hub target vLLM fetches itself) go through the site's proxy and trust its certificates.
        "http_proxy",
        "https_proxy",
        "no_proxy",
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "NO_PROXY",
        "SSL_CERT_FILE",
        "SSL_CERT_DIR",
        "REQUESTS_CA_BUNDLE",
        "CURL_CA_BUNDLE",
    }
)
# A name that says it holds a secret is left out even under an allowed prefix (HF_TOKEN, VLLM_API_KEY, ...).
SECRET = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|API_KEY|AUTH|PRIVATE|SESSION", re.IGNORECASE)


_STARTED: dict[str, str] | None = None


def snapshot() -> dict[str, str]:
    """This process's environment now (what `started` keeps for the children)."""
    return dict(os.environ)


@contextmanager
def started(environ: Mapping[str, str] | None = None) -> Iterator[dict[str, str]]:
    """Inside, children get `environ` (a `snapshot` taken earlier; by default this process's environment now)
    instead of this process's environment at the time they start. Nested: the outermost snapshot holds."""
    global _STARTED
    if _STARTED is not None:
        yield _STARTED
        return
    _STARTED = dict(os.environ if environ is None else environ)
    try:
        yield _STARTED
    finally:
        _STARTED = None


def run_environment() -> Mapping[str, str]:
    """The environment children inherit from: the run's start snapshot inside `started`, else this process's."""
    return os.environ if _STARTED is None else _STARTED


def passed_by_operator(environ: Mapping[str, str] | None = None) -> set[str]:
    env = os.environ if environ is None else environ
    return {n.strip() for n in env.get(PASS_ENV, "").split(",") if n.strip()}


def allowed(name: str) -> bool:
    """Whether a child inherits `name` without being told to."""
    return (name in NAMES or name.startswith(PREFIXES)) and not SECRET.search(name)


def child_environment(
    extra: Mapping[str, str] | None = None, passed: Iterable[str] = (), environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The environment for a vLLM server or the trainer: the allowed variables of `environ` (this process's), those
    named in `passed` and $EYRIE_PASS_ENV, then `extra` over them. By default `environ` is the run's start
    snapshot (`run_environment`)."""
    env = run_environment() if environ is None else environ
    wanted = set(passed) | passed_by_operator(env)
    out = {k: v for k, v in env.items() if k in wanted or allowed(k)}
    out.update(extra or {})
    return out
