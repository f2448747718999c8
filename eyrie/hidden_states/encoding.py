"""The dtype of the hidden-state files: as the server holds them (bfloat16), or fp8 in speculators' own format.

The fp8 format is the one speculators 0.9.0's `fp8` hidden-states backend reads (its `hs_connectors` package:
`FP8HiddenStatesConnector` writes it, `FP8Transfer` dequantizes it on read; upstream PR #1028):

    hidden_states         float8_e4m3fn [T, n_layers, H]
    hidden_states_scales  float32       [T, 1, 1]   one scale per token over all its layers: amax / 448
    token_ids             int64         [T]

Decoding is `hidden_states.to(bf16) * scales.to(bf16)`. `FP8Transfer` returns a file without scales unchanged, so
the trainer reads bf16 and fp8 files alike with `--hidden-states-backend fp8` (`reader_arguments`).

Only torch here: the vLLM connector (eyrie/vllm/plugin/connector.py) and the trainer both import this module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it is used: a run whose files are done imports none
    import torch

BFLOAT16 = "bfloat16"
FP8 = "float8_e4m3fn"
DTYPES = (BFLOAT16, FP8)
SCALES_KEY = "hidden_states_scales"  # hs_connectors.fp8_utils.SCALES_KEY
# The extraction server's connector reads the dtype from this variable (set in the server's environment, so a
# change of dtype is a change of the server's identity and starts a new one).
ENV = "EYRIE_HIDDEN_STATES_DTYPE"
READER_BACKEND = "fp8"  # speculators' `--hidden-states-backend` that dequantizes fp8 files and passes others through


def fp8_unavailable() -> str | None:
    """Why this torch cannot write or read fp8 hidden states, or None when it can."""
    import torch

    dtype = getattr(torch, FP8, None)
    if dtype is None:
        return f"torch {torch.__version__} has no torch.{FP8}"
    try:
        x = torch.tensor([[1.5, -3.0]], dtype=torch.bfloat16)
        back = (x.float() / 2).to(dtype).to(torch.bfloat16) * 2
    except Exception as err:  # noqa: BLE001 - any failure of the cast means the same: unusable here
        return f"torch {torch.__version__} cannot cast to and from {FP8} on CPU ({err})"
    if not torch.equal(back, x):
        return f"torch {torch.__version__} casts {FP8} wrongly on CPU"
    return None


def quantize(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`[T, ...]` -> (fp8 values, float32 scales `[T, 1, ...]`): one scale per token, amax / 448, computed in float32.
    The same arithmetic as hs_connectors.fp8_utils.quantize_tensor_to_fp8, so files are alike byte for byte."""
    import torch

    fp8 = getattr(torch, FP8)
    x = hidden.float()
    amax = x.abs().amax(dim=tuple(range(1, x.dim())), keepdim=True)
    scales = (amax / torch.finfo(fp8).max).clamp(min=1e-12)
    return (x / scales).to(fp8), scales


def dequantize(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """As speculators' FP8Transfer reads them (hs_connectors.fp8_utils.dequantize_fp8_tensor), in `dtype`
    (bfloat16 unless given)."""
    import torch

    dtype = dtype or torch.bfloat16
    return values.to(dtype) * scales.to(dtype)


def encode(tensors: dict[str, torch.Tensor], dtype: str) -> dict[str, torch.Tensor]:
    """The tensors of one file as written in `dtype`: unchanged for bfloat16 (the server's own dtype)."""
    if dtype == BFLOAT16:
        return tensors
    if dtype != FP8:
        raise ValueError(f"hidden-states dtype {dtype!r}; expected one of {', '.join(DTYPES)}")
    values, scales = quantize(tensors["hidden_states"])
    return {**tensors, "hidden_states": values, SCALES_KEY: scales}


def decode(data: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """A file's tensors as the trainer sees them: fp8 files dequantized (into `dtype`, bfloat16 unless given),
    others unchanged (FP8Transfer's rule)."""
    if SCALES_KEY not in data:
        return data
    out = {k: v for k, v in data.items() if k != SCALES_KEY}
    out["hidden_states"] = dequantize(data["hidden_states"], data[SCALES_KEY], dtype)
    return out


def check_encoding(data: dict[str, torch.Tensor], dtype: str) -> None:
    """Raise ValueError unless the file is in `dtype`'s encoding (shape and token checks are the caller's).

    fp8: values float8_e4m3fn without NaN (e4m3fn has no infinity), scales float32 `[T, 1, 1]`, finite and > 0.
    bfloat16: no scales and no fp8 values (a file of the other encoding is redone, not trained on)."""
    import torch

    hs = data["hidden_states"]
    is_fp8 = hs.dtype == getattr(torch, FP8, None)
    if dtype != FP8:
        if is_fp8 or SCALES_KEY in data:
            raise ValueError(f"an fp8 file ({SCALES_KEY}), but extraction.hidden_states_dtype is {dtype}")
        return
    if not is_fp8:
        raise ValueError(f"hidden_states are {hs.dtype}, expected torch.{FP8}")
    scales = data.get(SCALES_KEY)
    if scales is None:
        raise ValueError(f"an fp8 file without {SCALES_KEY}")
    want = (hs.shape[0],) + (1,) * (hs.dim() - 1)
    if scales.dtype != torch.float32 or tuple(scales.shape) != want:
        raise ValueError(f"{SCALES_KEY} {scales.dtype} {tuple(scales.shape)}, expected torch.float32 {want}")
    if not bool((torch.isfinite(scales) & (scales > 0)).all()):
        raise ValueError(f"{SCALES_KEY} hold values that are not finite and positive")
    if bool(((hs.view(torch.uint8) & 0x7F) == 0x7F).any()):  # e4m3fn's only NaN codes: S.1111.111
        raise ValueError("hidden_states hold NaN values")


def bytes_per_token(num_layers: int, hidden_size: int, dtype: str) -> int:
    """Tensor bytes one token takes in a file (the safetensors header, a few hundred bytes a file, aside)."""
    if dtype == FP8:
        return num_layers * hidden_size + 4 + 8  # fp8 values, a float32 scale, an int64 token id
    return num_layers * hidden_size * 2 + 8


def speculators_reads_fp8() -> bool:
    """True when the installed speculators has its `fp8` hidden-states backend (hs_connectors >= 0.9.0)."""
    try:
        from hs_connectors import HiddenStatesBackend
    except ImportError:
        return False
    return READER_BACKEND in HiddenStatesBackend.registry


def reader_arguments(argv: list[str]) -> list[str]:
    """speculators' trainer arguments reading bf16 and fp8 files alike: its `fp8` backend (FP8Transfer), unless the
    command chose a backend itself or the installed speculators lacks it (preflight refuses fp8 files then)."""
    if any(a == "--hidden-states-backend" or a.startswith("--hidden-states-backend=") for a in argv):
        return argv
    if not speculators_reads_fp8():
        return argv
    return [*argv, "--hidden-states-backend", READER_BACKEND]


def check_config(hidden_states_dtype: str) -> list[str]:
    """Preflight's problems with `extraction.hidden_states_dtype` in this environment (none for bfloat16)."""
    if hidden_states_dtype != FP8:
        return []
    problems = []
    if why := fp8_unavailable():
        problems.append(
            f"extraction.hidden_states_dtype is {FP8}, but {why}: install torch >= 2.1 or set it to {BFLOAT16}"
        )
    if not speculators_reads_fp8():
        problems.append(
            f"extraction.hidden_states_dtype is {FP8}, but the installed speculators has no `{READER_BACKEND}` "
            f"hidden-states backend (hs_connectors >= 0.9.0) to read such files: upgrade it or set {BFLOAT16}"
        )
    return problems
