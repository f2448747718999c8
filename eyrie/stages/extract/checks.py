"""One hidden-state file checked against its prepared sample: whole, finite, for exactly these tokens, in
the configured encoding.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from eyrie.hidden_states.encoding import BFLOAT16, FP8, check_encoding

if TYPE_CHECKING:
    import torch


def check_sample(
    data: dict, token_ids: list[int], num_layers: int, hidden_size: int, hidden_states_dtype: str = BFLOAT16
) -> None:
    """Raise ValueError unless `data` is one whole, finite sample for exactly these tokens, stored in
    `hidden_states_dtype`'s encoding (eyrie.hidden_states.encoding)."""
    if set(data) < {"hidden_states", "token_ids"}:
        raise ValueError(f"keys {sorted(data)}; expected hidden_states and token_ids")
    if data["token_ids"].tolist() != token_ids:
        raise ValueError("token ids differ from the prepared sample")
    hs = data["hidden_states"]
    want = (len(token_ids), num_layers, hidden_size)
    if tuple(hs.shape) != want:
        raise ValueError(f"hidden_states shape {tuple(hs.shape)}, expected {want} [T, n_layers, H]")
    check_encoding(data, hidden_states_dtype)  # fp8: its scales, and no NaN (e4m3fn has no infinity)
    if hidden_states_dtype != FP8 and not all_finite(hs):
        raise ValueError("hidden_states hold NaN or infinite values")


def all_finite(t: torch.Tensor) -> bool:
    """Every value finite, from the tensor's smallest and largest values in one pass (`torch.aminmax`, in its own
    dtype): torch's min and max propagate NaN, and an infinity is the smallest or the largest value. No float32
    copy and no overflow: 20x cheaper than a float32 sum on bf16 (1.4 ms against 29 ms for a 25 MB file, one core;
    benchmarks/extract_client_cost.py), which was the costliest step of a file's checks."""
    import torch  # here, not at the top: a run whose files are done imports no torch

    if t.numel() == 0:
        return True
    if t.is_floating_point() and t.element_size() == 1:  # float8: no aminmax kernel; bf16 holds every value exactly
        t = t.to(torch.bfloat16)
    low, high = torch.aminmax(t)
    return bool(torch.isfinite(low)) and bool(torch.isfinite(high))


def load_checked(
    path: Path, token_ids: list[int], num_layers: int, hidden_size: int, hidden_states_dtype: str = BFLOAT16
) -> None:
    from safetensors.torch import load_file

    try:
        data = load_file(str(path))
    except Exception as err:  # safetensors raises its own error types for truncated or garbled files
        raise ValueError(f"unreadable: {err}") from None
    check_sample(data, token_ids, num_layers, hidden_size, hidden_states_dtype)
