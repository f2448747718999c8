"""The capture proof: a shard's hidden states are the target's own residual stream, checked before its manifest.

`check_shard` runs on every shard extraction writes, after its files are checked one by one (whole, finite, for the
right tokens: `eyrie.stages.extract.check_sample`) and before the manifest that vouches for them. On a sample of the
shard's files (`FILES_PER_SHARD`, spread over the shard) it proves three things, each failing the shard with a
message that names the layer:

1. **No dead rows.** A row that is all zero, or constant over the hidden dimension, at any captured layer (vLLM's
   extraction has written all-zero states on some targets; a residual stream never is one).
2. **The same statistics as the run's first shard.** Per captured layer, the median L2 norm of the rows (position 0,
   where attention sinks put outliers, left out). The first shard checked in a run sets the reference
   (`capture/baseline.json` beside the shard manifests); a later shard whose median is more than `NORM_FAR` times
   off it, either way, was captured from another layer, another contract or another server.
3. **The final captured layer is the target's own computation.** The layer id `num_hidden_layers` (the last decoder
   layer's output, before the final norm) is put through the target's own final norm and head, loaded from its
   checkpoint by the names preflight resolved (`report.target_facts["verifier_weights"]`, the trainer's own
   loader), and its top token compared with the token that follows at sampled positions. Where the tokens that follow
   are the target's own greedy choices (regeneration at temperature 0: the extraction source is `regenerate/`
   and every row was generated at 0), at least `GREEDY_MIN_AGREEMENT` must agree, counting as agreeing a token
   within `TIE_NATS` of the top one (near-ties, which the server's batch numerics decide: on the demo's target
   all of the 4% top-1 misses); a wrong layer, a double-counted residual or zeros cost far more. Where they are
   the data's own answers or sampled ones, the target need not reproduce them: the agreement is recorded and a low
   one is a warning in the log, not a failure (the run's capture proof, `eyrie.hidden_states.proof`, judged the
   server against its own ranking from the forward pass that captured its states, before the first shard).
4. **The aux layers are the target's own.** Each captured id below `num_hidden_layers`, on the first tokens of one
   of the shard's files, is compared with the target's own stream recomputed from its weights
   (`eyrie.hidden_states.proof.aux_problems`), so every shard is judged against the target, not only against the
   run's first shard (which may be stale in the same way).

A failed shard's files are removed (they are proved wrong, and a retry must not reuse them), so the next attempt
re-extracts it. Each shard's figures go to `capture/<shard>.json`, so a run shows what was measured.

The context (the target's checkpoint, its borrowed tensors' names, the norm's kind and epsilon, the captured ids) is
recorded by the extraction plan (`record_context`) in `capture/context.json`; a caller that extracts with no plan
(a bare `extract_shard`) gets checks 1 and 2 only.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eyrie.errors import ExtractionError
from eyrie.run.files import atomic_write_json, read_json, sha256_json
from eyrie.run.folder import sample_path

if TYPE_CHECKING:  # imported where used: the plan records the context with no torch
    import torch

FOLDER = "capture"  # under the extract stage's folder, beside `shards/` (no shard manifest lives here)
CONTEXT = "context.json"
BASELINE = "baseline.json"

FILES_PER_SHARD = 8  # files read again per shard (spread over it): the capture is systematic, not per file
ROWS_PER_FILE = 512  # rows per file whose norms are measured
POSITIONS_PER_SHARD = 256  # positions put through the target's norm and head
NORM_FAR = 1.5  # a layer's median row norm this many times off the first shard's, either way, fails
GREEDY_MIN_AGREEMENT = 0.9  # of greedy positions whose next token must be the top one (within TIE_NATS)
# A near-tie: the target's greedy token within this many nats of the top token recomputed from the stored states.
# On the demo's tiny target every one of its 4% top-1 misses is within 0.05 (the server's batch numerics and
# bf16 rounding of the stored stream decide ties); a wrong layer or a double-counted residual is far off.
TIE_NATS = 0.1
DATA_WARN_AGREEMENT = 0.5  # below this, on data the target did not generate, the log warns
MIN_POSITIONS = 8  # fewer sampled positions prove nothing either way: recorded, not judged
SMALL_HEAD = 1 << 27  # elements: heads up to this size are kept in float32 for the check


class CaptureError(ExtractionError):
    """The captured hidden states are not the target's residual stream; the message names the layer."""


def capture_folder(manifest_path: Path) -> Path:
    """`<run>/extract/capture` for a shard manifest at `<run>/extract/shards/<shard>.json`."""
    return Path(manifest_path).parent.parent / FOLDER


# ---------------------------------------------------------------------------------------------------------------
# The context: what the head check needs from the target, recorded by the extraction plan


def _norm_eps(cfg: dict) -> float:
    for key in ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps", "norm_epsilon", "epsilon"):
        if isinstance(cfg.get(key), (int, float)):
            return float(cfg[key])
    return 1e-6


def context_for(config, report) -> dict:
    """What `check_shard` reads of the target, from the pipeline config and preflight's report."""
    from eyrie.target.metadata import read_target_config, text_config, verifier_name

    try:
        full = read_target_config(config.target)
    except Exception:  # noqa: BLE001 - an unreadable config was preflight's to refuse; the check then skips the head
        full = {}
    cfg = text_config(full)
    return {
        "model": verifier_name(config.target.model),
        "revision": config.target.revision,
        "num_layers": report.num_layers,
        "layer_ids": list(report.captured_layer_ids),
        "verifier_weights": dict(report.target_facts.get("verifier_weights", {})),
        "final_norm": report.final_norm,
        "norm_eps": _norm_eps(cfg),
        # What the capture proof rebuilds the first layers from (eyrie.hidden_states.proof)
        "text_config": cfg,
        "quantized": bool(full.get("quantization_config") or cfg.get("quantization_config")),
        "unproven_aux_layers": config.extraction.unproven_aux_layers,  # the proof's policy for ids it cannot rebuild
    }


def record_context(extract_dir: Path, config, report) -> None:
    """Written by the extraction plan (`eyrie.stages.extract.ExtractionPlan`); rewritten only when it changed."""
    ctx = context_for(config, report)
    path = Path(extract_dir) / FOLDER / CONTEXT
    if read_json(path) != ctx:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, ctx)


# ---------------------------------------------------------------------------------------------------------------
# The target's own final norm and head


_HEADS: dict[tuple, tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]] = {}
_HEADS_LOCK = threading.Lock()


def load_head(ctx: dict) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(norm weight, norm bias or None, head weight [V, H]), float32 but for a large head, by the checkpoint names
    preflight resolved, through speculators' loader (the one the trainer's `_load_verifier_weights_by` hands the same
    names). A tied head is the embedding. Loaded once per process and target."""

    names = ctx["verifier_weights"]
    key = (ctx["model"], ctx.get("revision"), tuple(sorted(names.items())))
    with _HEADS_LOCK:
        if key in _HEADS:
            return _HEADS[key]
        from speculators.utils.loading import load_model_layers

        norm_name = names["model.norm.weight"]
        head_name = names.get("lm_head.weight") or names["embed_tokens.weight"]
        wanted = [norm_name, head_name]
        if _is_layer_norm(ctx.get("final_norm")) and norm_name.endswith(".weight"):
            wanted.append(norm_name[: -len("weight")] + "bias")
        found: dict[str, torch.Tensor] = {}
        with contextlib.suppress(KeyError):  # a LayerNorm without a bias
            found = load_model_layers(wanted, ctx["model"])
        if norm_name not in found or head_name not in found:
            found = load_model_layers(wanted[:2], ctx["model"])
        bias = found.get(wanted[2]) if len(wanted) > 2 else None
        head = found[head_name]
        out = (
            found[norm_name].float(),
            bias.float() if bias is not None else None,
            # float32 for small heads; a large one (Kimi's: 163,840 x 7,168) stays in its checkpoint dtype
            head.float() if head.numel() <= SMALL_HEAD else head,
        )
        _HEADS[key] = out
        return out


def _is_layer_norm(norm_class: str | None) -> bool:
    name = (norm_class or "").lower()
    return "layernorm" in name and "rms" not in name


def apply_norm(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, ctx: dict) -> torch.Tensor:
    """The target's final norm over float32 rows: RMSNorm (Gemma's stores weight - 1), or LayerNorm."""
    import torch

    eps = float(ctx.get("norm_eps", 1e-6))
    norm_class = ctx.get("final_norm") or ""
    if _is_layer_norm(norm_class):
        return torch.nn.functional.layer_norm(h, (h.shape[-1],), weight, bias, eps)
    scale = 1.0 + weight if norm_class.lower().startswith("gemma") else weight
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * scale


# ---------------------------------------------------------------------------------------------------------------
# The check


def _sampled(n: int, k: int) -> list[int]:
    """`k` offsets spread evenly over `n` (first and last included)."""
    if n <= k:
        return list(range(n))
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})


def _load(path: Path) -> tuple[torch.Tensor, list[int]]:
    import torch
    from safetensors.torch import load_file

    from eyrie.hidden_states.encoding import decode

    data = decode(load_file(str(path)), torch.float32)
    return data["hidden_states"].float(), data["token_ids"].tolist()


def _greedy_source(prepare_dir: Path) -> bool:
    """The rows' answers are the target's own greedy tokens: regeneration's output, every row at temperature 0."""
    if Path(prepare_dir).name != "regenerate":
        return False
    temps = (read_json(Path(prepare_dir) / "stats.json") or {}).get("temperatures") or {}
    return bool(temps) and all(float(t) == 0.0 for t in temps)


def _masks(prepare_dir: Path, start: int, stop: int) -> list[list[int]] | None:
    try:
        from datasets import load_from_disk

        ds = load_from_disk(str(Path(prepare_dir) / "dataset")).with_format(None)
        return ds.select(range(start, stop))["loss_mask"]
    except Exception:  # noqa: BLE001 - no mask column (a test's own dataset): every next token is a position
        return None


def row_problems(hs: torch.Tensor, layer_ids: list[int], where: str) -> list[str]:
    """Dead rows per layer: all zero, or constant over the hidden dimension. `hs` [T, n_layers, H] float32."""
    import torch

    problems = []
    lo, hi = torch.aminmax(hs, dim=-1)  # [T, n_layers], one pass over the states
    magnitude = torch.maximum(lo.abs(), hi.abs())  # each row's largest |value|
    rows = hs.shape[0]
    for j, lid in enumerate(layer_ids):
        zero = int((magnitude[:, j] == 0).sum())
        spread = hi[:, j] - lo[:, j]
        constant = int(((spread <= 1e-6 * magnitude[:, j].clamp(min=1e-30)) & (magnitude[:, j] > 0)).sum())
        if zero:
            problems.append(f"layer {lid}: {zero} of {rows} rows are all zero ({where})")
        if constant:
            problems.append(f"layer {lid}: {constant} of {rows} rows are constant over the hidden size ({where})")
    return problems


def check_shard(
    hidden_dir: Path,
    manifest_path: Path,
    prepare_dir: Path,
    shard,
    layer_ids: list[int] | None = None,
    log=print,
) -> dict:
    """Prove the shard's captured states are the target's (see the module's docstring); raise CaptureError (the
    shard's files removed) if not. Returns the figures, also written to `capture/<shard>.json`."""
    import torch

    folder = capture_folder(manifest_path)
    ctx = read_json(folder / CONTEXT)
    n = shard.stop - shard.start
    offsets = _sampled(n, FILES_PER_SHARD)
    masks = _masks(prepare_dir, shard.start + offsets[0], shard.start + offsets[-1] + 1) if offsets else None
    problems: list[str] = []
    norms: dict[int, list[torch.Tensor]] = {}
    final_rows, next_tokens = [], []
    per_file = max(1, POSITIONS_PER_SHARD // max(len(offsets), 1))
    for off in offsets:
        idx = shard.start + off
        hs, ids = _load(sample_path(hidden_dir, idx))
        if layer_ids is None or len(layer_ids) != hs.shape[1]:
            ctx_ids = list(ctx["layer_ids"]) if ctx else []
            layer_ids = ctx_ids if len(ctx_ids) == hs.shape[1] else list(range(hs.shape[1]))
        problems += row_problems(hs, layer_ids, f"sample {idx}")
        rows = hs[1 : 1 + ROWS_PER_FILE] if hs.shape[0] > 1 else hs
        for j, lid in enumerate(layer_ids):
            norms.setdefault(lid, []).append(rows[:, j, :].norm(dim=-1))
        last = layer_ids.index(ctx["num_layers"]) if ctx and ctx["num_layers"] in layer_ids else None
        if last is not None:
            mask = masks[off - offsets[0]] if masks is not None else [1] * len(ids)
            positions = [t for t in range(len(ids) - 1) if mask[t + 1]]
            picked = [positions[i] for i in _sampled(len(positions), per_file)]
            final_rows.append(hs[picked, last, :])
            next_tokens += [ids[t + 1] for t in picked]
    medians = {lid: float(torch.cat(v).median()) for lid, v in norms.items() if v}
    figures: dict[str, Any] = {"shard": shard.name, "files_checked": len(offsets), "median_row_norm": medians}
    if ctx and offsets and layer_ids:
        # Every shard's aux layers against the target's own first layers, not only against the run's first shard
        problems += _aux_recomputed(ctx, sample_path(hidden_dir, shard.start + offsets[0]), layer_ids, figures)
    if ctx and next_tokens:
        # Judged only where the positions are those of generated tokens (the loss mask read): a prompt's next
        # token is the user's, not the target's.
        greedy = masks is not None and _greedy_source(prepare_dir)
        problems += _head_check(ctx, torch.cat(final_rows), next_tokens, greedy, figures, log)
    # The first shard sets the reference only if it passed the checks that need none.
    problems += _against_baseline(folder, shard.name, ctx, medians, figures, set_it=not problems)
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_json(folder / f"{shard.name}.json", {**figures, "problems": problems})
    if problems:
        for idx in range(shard.start, shard.stop):  # proved wrong: a retry must not reuse them
            sample_path(hidden_dir, idx).unlink(missing_ok=True)
        raise CaptureError(
            f"{shard.name}: the captured hidden states are not the target's residual stream:\n  - "
            + "\n  - ".join(problems[:12])
            + ("\n  - ..." if len(problems) > 12 else "")
            + f"\nThe shard's files were removed and it has no manifest. Figures: {folder / (shard.name + '.json')}. "
            "Zeros or a wrong layer come from the server's capture (a vLLM version whose extraction is broken for "
            "this architecture, or Eyrie's compatibility layer): check `eyrie preflight`'s EAGLE-3 path and the "
            "server log, fix the server, then run again."
        )
    return figures


def _aux_recomputed(ctx: dict, path: Path, layer_ids: list[int], figures: dict) -> list[str]:
    """The aux layers of one file's first tokens recomputed from the target's weights (eyrie.hidden_states.proof);
    a target the proof cannot rebuild was decided by the run's proof, and is recorded as such here."""
    from eyrie.hidden_states.proof import SHARD_PREFIX_TOKENS, Unrecomputable, aux_problems, recomputer

    if not any(i < ctx["num_layers"] for i in layer_ids):
        return []
    try:
        rec = recomputer(ctx)
    except Unrecomputable as err:
        figures["aux_check"] = {"unproven": str(err)}
        return []
    hs, ids = _load(path)
    n = min(len(ids), SHARD_PREFIX_TOKENS)
    problems, errs = aux_problems([(hs[:n], ids[:n])], layer_ids, ctx["num_layers"], rec)
    figures["aux_check"] = {"file": path.name, "tokens": n, "relative_l2": errs}
    return [f"{p} ({path.name})" for p in problems]


def _against_baseline(folder: Path, shard_name: str, ctx, medians: dict, figures: dict, set_it: bool) -> list[str]:
    """The run's first shard's medians (written by the first shard checked, under a lock), and this shard's ratios."""
    identity = sha256_json({"ctx": ctx, "layers": sorted(medians)})[:16]
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / BASELINE
    # The folder itself is the lock (flock on its descriptor): no lock file is left behind.
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        base = read_json(path)
        if not base or base.get("identity") != identity:
            if not set_it:
                return []
            atomic_write_json(path, {"identity": identity, "shard": shard_name, "median_row_norm": medians})
            figures["baseline"] = shard_name
            return []
    finally:
        os.close(fd)
    figures["baseline"] = base["shard"]
    problems = []
    for lid, m in medians.items():
        ref = base["median_row_norm"].get(str(lid))
        if ref is None or ref <= 0 or m <= 0:
            continue
        ratio = m / ref
        figures.setdefault("norm_ratio", {})[lid] = round(ratio, 4)
        if not 1 / NORM_FAR <= ratio <= NORM_FAR:
            problems.append(
                f"layer {lid}: median row norm {m:.4g} is {ratio:.2f}x the run's first shard's ({ref:.4g}, "
                f"{base['shard']}); more than {NORM_FAR}x either way means another layer or another capture"
            )
    return problems


def head_logits(ctx: dict, rows: torch.Tensor) -> torch.Tensor:
    """The target's own next-token logits [N, V] (float32) for last-layer rows [N, H]: its final norm and head,
    loaded from its checkpoint (`load_head`)."""
    weight, bias, head = load_head(ctx)
    normed = apply_norm(rows.float(), weight, bias, ctx)
    return (normed.to(head.dtype) @ head.T).float()


def head_logprobs(ctx: dict, rows: torch.Tensor) -> torch.Tensor:
    """`head_logits` as log-probabilities."""
    return head_logits(ctx, rows).log_softmax(-1)


def tie_agreement(logprobs: torch.Tensor, tokens: list[int]) -> tuple[float, float]:
    """(agreement, top-1) of `tokens` with the rows of `logprobs`: the token is the top one, or within TIE_NATS of
    it (agreement), or is the top one itself (top-1)."""
    import torch

    want = torch.tensor(tokens, dtype=torch.long)
    # How far the token is below the top one, in log-probability: 0 where it is the top token.
    below = logprobs.max(-1).values - logprobs.gather(1, want[:, None])[:, 0]
    return float((below <= TIE_NATS).float().mean()), float((below <= 0).float().mean())


def _head_check(ctx: dict, rows: torch.Tensor, next_tokens: list[int], greedy: bool, figures: dict, log) -> list[str]:
    agreement, top1 = tie_agreement(head_logprobs(ctx, rows), next_tokens)
    lid = ctx["num_layers"]
    figures["head_check"] = {
        "layer": lid,
        "positions": len(next_tokens),
        "agreement": round(agreement, 4),  # the token that followed is the top one, or within TIE_NATS of it
        "top1": round(top1, 4),
        "reference": "the target's greedy tokens (regeneration)" if greedy else "the data's next tokens",
    }
    if len(next_tokens) < MIN_POSITIONS:
        return []
    if greedy and agreement < GREEDY_MIN_AGREEMENT:
        return [
            f"layer {lid} (the last layer's output) through the target's own final norm and head gives the token "
            f"the target itself generated (or one within {TIE_NATS} nats of it) at only {agreement:.0%} of "
            f"{len(next_tokens)} positions (at least {GREEDY_MIN_AGREEMENT:.0%} expected; top-1 {top1:.0%}): it is "
            "not the stream the target's head reads"
        ]
    if not greedy and agreement < DATA_WARN_AGREEMENT:
        log(
            f"warning: layer {lid} through the target's own norm and head gives the data's next token at "
            f"{agreement:.0%} of {len(next_tokens)} positions; with answers the target did not generate this is not "
            "a verdict on the capture (the run's capture proof, capture/proof.json, judged the server against its "
            "own ranking from the same forward pass)"
        )
    return []
