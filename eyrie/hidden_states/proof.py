"""The capture proved on every run: right after the extraction server is ready, before its first shard, the server
answers a few prompts of the run's own data greedily, its capture of those answers is read back, and every captured
layer is checked against the target itself. A failure stops the run minutes after the load, with the reason; a pass
is recorded with its figures in `capture/proof.json` (beside the shard figures, `eyrie.hidden_states.check`).

What is checked, on `PROOF_ROWS` prompts (the prompt part of rows spread over the data, at most `PROMPT_TOKENS`
tokens each) and `ANSWER_TOKENS` greedy tokens the server chose for each (with `ignore_eos`: the count is fixed, and
every token is still the top one), each captured with the server's own top-`SERVER_TOP_K` ranking at every position
of the same forward pass (`ServerClient.extract_ranked`: `prompt_logprobs` on the extraction request):

1. **The last layer through the target's own head, against the server's own ranking.** The captured id
   `num_hidden_layers` (the last layer's output, before the final norm) through the target's final norm and head,
   loaded from its checkpoint, in float32, must rank the tokens as the server did in the forward pass that captured
   it, at every position of prompt and answer (`rank_problems`: the server's top token at `GREEDY_MIN_AGREEMENT` of
   the positions, on average `RANK_MIN_OVERLAP` of its top K in the target's top K, near-ties on both sides within
   `RANK_TIE_NATS` or `RANK_TIE_ULPS` bf16 steps counted). The two sides differ by rounding alone, so near-flat
   logits pass; the greedy tokens, from other forward passes (decode steps, other kernels), are only a figure
   (`greedy_vs_forward`): on a GPU, near-ties of a tiny random target flipped between the passes and a correct
   capture agreed with 79% of them. Whatever the data: the answers are the server's own, so this is a proof on a
   run without regeneration too.
2. **Every aux layer within the rebuild budget recomputed from the target's weights.** The first layers of the target
   (up to one past the deepest such id) are built with transformers from the target's config and loaded from its
   checkpoint, and run on the same token ids in float32: each captured aux layer must be within `REL_MAX` (relative L2)
   of the recomputed stream entering its layer, and closer to it than to the streams entering the layers before and
   after it by `NEIGHBOUR_MARGIN` (an off-by-one capture is closer to its neighbour), so zeros, the stream plus the
   layer's input, another layer, another target or stale states cannot pass.
3. **No dead rows** at any captured layer (all zero, or constant over the hidden size).

What can be recomputed is decided from the target's config alone (`plan_aux`, no weights read): the largest prefix of
the target (embedding and first layers, every parameter of the rebuilt model counted) within `RECOMPUTE_MAX_PARAMS`, and
the aux ids within it (an id needs the stream entering it and the one after). A deeper id (on an 8B target L//2 and L-3,
on a 70B every id), or every id of a quantized checkpoint (its tensors are not the float weights transformers builds) or
of a config transformers cannot build, is unproven, with the reason. Preflight predicts this before any load
(`aux_refusal`): with `extraction.unproven_aux_layers: refuse` (the default) it refuses the run, naming the ids; with
`warn` the proof checks the ids it can, records the others as unproven in `proof.json` and the run's warnings. "Cannot
prove either way" is never a silent pass.

The same recomputation (`aux_problems`) judges each shard's aux layers (`check.check_shard`), on a prefix of one of
its files, so a shard written by another server or under another capture (a stale shard) is refused on its own, not
only when it differs from the run's first shard.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eyrie.hidden_states.check import (
    GREEDY_MIN_AGREEMENT,
    MIN_POSITIONS,
    CaptureError,
    head_logits,
    row_problems,
    tie_agreement,
)

if TYPE_CHECKING:
    import torch

PROOF = "proof.json"  # under the extract stage's `capture/` folder
PROOF_ROWS = 3  # prompts of the data the server answers for the proof
PROMPT_TOKENS = 96  # at most, from each prompt's start
ANSWER_TOKENS = 16  # greedy tokens the server generates for each
REL_MAX = 0.1  # captured vs recomputed relative L2; the compatibility matrix measures < 0.03 (bf16 vs float32)
NEIGHBOUR_MARGIN = 0.5  # the error to the captured layer must be below this times the error to either neighbour
RECOMPUTE_MAX_PARAMS = 2_000_000_000  # parameters of the rebuilt first layers (float32: 8 GB)
SHARD_PREFIX_TOKENS = 64  # tokens of one shard file recomputed per shard (causal: the prefix's states are exact)
AUX_POLICY = "unproven_aux_layers"  # the ctx's copy of extraction.unproven_aux_layers: "refuse" or "warn"
SERVER_TOP_K = 20  # the server's ranking asked for at every position (vLLM's default --max-logprobs is 20)
RANK_MIN_OVERLAP = 0.9  # mean share of the server's top-K that is in the target's own top-K (near-ties counted)
# A near-tie in the same forward pass (`tie_nats`): the server's logits are the target's rounded to bf16 (a step of
# 2^-8 of their magnitude) with bf16 kernels' error; the target's own, in float32 from the same captured stream,
# differ by a fraction of that. Far tighter than check.TIE_NATS (0.1 nats, for tokens of other forward passes):
# on a tiny random GPT-2, whose top 20 lie within 0.3 nats, 0.1 nats let another layer's states agree at 90%.
RANK_TIE_NATS = 0.02
RANK_TIE_ULPS = 2  # bf16 steps at the logits' magnitude, where more than RANK_TIE_NATS


class Unrecomputable(Exception):
    """The target's first layers cannot be rebuilt here; the message says why."""


# ---------------------------------------------------------------------------------------------------------------
# The target's first layers, rebuilt with transformers


def _truncated_config(text_cfg: dict, layers: int):
    """transformers' config for the target's decoder with its first `layers` layers (per-layer lists cut too)."""
    from transformers import AutoConfig

    model_type = str(text_cfg.get("model_type"))
    skip = ("model_type", "architectures", "auto_map", "quantization_config", "transformers_version")
    try:
        full = AutoConfig.for_model(model_type, **{k: v for k, v in text_cfg.items() if k not in skip})
        total = int(full.num_hidden_layers)  # `n_layer` and the like through the class's attribute map
        fields = {k: v for k, v in full.to_dict().items() if k not in skip}
        for k, v in fields.items():
            if isinstance(v, list) and len(v) == total:
                fields[k] = list(v[:layers])
        fields[_layers_key(full)] = layers
        cfg = AutoConfig.for_model(model_type, **fields)
    except Exception as err:  # noqa: BLE001 - a model type this transformers does not know, or a config it refuses
        raise Unrecomputable(
            f"transformers cannot read the target's config (model_type {model_type!r}: {err})"
        ) from None
    cfg._attn_implementation = "eager"
    return cfg


def _layers_key(cfg) -> str:
    """The config's own name for the layer count (GPT-2's `n_layer`)."""
    return dict(getattr(cfg, "attribute_map", {}) or {}).get("num_hidden_layers", "num_hidden_layers")


class Recomputer:
    """The target's decoder cut to its first `layers` layers, loaded from the checkpoint in float32.

    `streams(ids)` -> [layers, T, H]: entry k is the stream entering layer k (transformers' `hidden_states[k]`,
    which is vLLM's captured id k)."""

    def __init__(self, ctx: dict, text_cfg: dict, layers: int):
        import re

        import torch
        from transformers import AutoModelForCausalLM

        if ctx.get("quantized") or text_cfg.get("quantization_config"):
            raise Unrecomputable(
                "the checkpoint is quantized (its tensors are not the float weights transformers builds)"
            )
        self.layers = layers
        cfg = _truncated_config(text_cfg, layers + 1)  # one more: transformers norms its last entry
        try:
            with torch.device("meta"):
                shape = AutoModelForCausalLM.from_config(cfg)
        except Exception as err:  # noqa: BLE001
            raise Unrecomputable(f"transformers cannot build the decoder from the config ({err})") from None
        n = sum(p.numel() for p in shape.parameters())
        if n > RECOMPUTE_MAX_PARAMS:
            raise Unrecomputable(
                f"its first {layers + 1} layers hold {n / 1e9:.1f}B parameters, past the "
                f"{RECOMPUTE_MAX_PARAMS / 1e9:.0f}B this check rebuilds"
            )
        # The checkpoint's names for the decoder: the embedding's name there against transformers' name for it
        # (a multimodal wrapper keeps the decoder under a prefix of its own, e.g. `language_model.`).
        embed = ctx["verifier_weights"].get("embed_tokens.weight", "")
        emb_weight = shape.get_input_embeddings().weight
        mine = next((k for k, p in shape.named_parameters() if p is emb_weight), "")
        tail = _common_dotted_suffix(embed, mine)
        if not embed or not tail:
            raise Unrecomputable(f"the checkpoint's embedding {embed!r} is not {type(shape).__name__}'s {mine!r}")
        theirs_prefix, mine_prefix = embed[: -len(tail)], mine[: -len(tail)]
        mapping = {"^" + re.escape(theirs_prefix): mine_prefix} if theirs_prefix != mine_prefix else None
        del shape
        from transformers.utils import logging as transformers_logging

        said = transformers_logging.get_verbosity()
        transformers_logging.set_verbosity_error()  # its report lists every tensor past the cut as unexpected
        try:
            loaded: Any = AutoModelForCausalLM.from_pretrained(
                ctx["model"],
                config=cfg,
                revision=ctx.get("revision") or "main",
                dtype=torch.float32,
                key_mapping=mapping,
                output_loading_info=True,
            )
            model, info = loaded
        except Exception as err:  # noqa: BLE001
            raise Unrecomputable(f"cannot load the first layers from {ctx['model']} ({err})") from None
        finally:
            transformers_logging.set_verbosity(said)
        # Every tensor of the decoder must come from the checkpoint (a head the decoder never uses may be absent).
        missing = [k for k in info.get("missing_keys", []) if not k.startswith("lm_head")]
        if missing:
            raise Unrecomputable(
                f"the checkpoint lacks {len(missing)} tensors {type(model).__name__} needs (e.g. {sorted(missing)[:3]})"
            )
        self.model = model.eval()

    def streams(self, ids: list[int]) -> torch.Tensor:
        import torch

        with torch.no_grad():
            out = self.model(input_ids=torch.tensor([ids]), output_hidden_states=True, use_cache=False)
        return torch.stack([h[0].float() for h in out.hidden_states[: self.layers + 1]])


def _common_dotted_suffix(a: str, b: str) -> str:
    """The longest run of whole dotted parts that `a` and `b` both end with ("embed_tokens.weight")."""
    pa, pb = a.split("."), b.split(".")
    n = 0
    while n < min(len(pa), len(pb)) and pa[-1 - n] == pb[-1 - n]:
        n += 1
    return ".".join(pa[len(pa) - n :]) if n >= 2 else ""


@dataclass(frozen=True)
class AuxPlan:
    """Which aux ids the proof can recompute: `layers` streams rebuilt (entering layers 0..layers; None: nothing
    is rebuilt), the ids judged against them (`proven`), the others (`unproven`) and why they are not."""

    layers: int | None
    proven: list[int] = field(default_factory=list)
    unproven: list[int] = field(default_factory=list)
    reason: str | None = None


def _needed(lid: int, num_layers: int) -> int:
    """The streams to rebuild to judge aux id `lid`: its own and the one after (its neighbour), below the last."""
    return max(0, min(lid + 1, num_layers - 1))


def _prefix_params(text_cfg: dict, deepest: int) -> dict[int, int]:
    """{k: parameters of the model `Recomputer(..., k)` builds}, from meta-device builds (no memory, no weights),
    every parameter counted (embedding, the first k+1 layers, norm, head): for k up to `deepest`, or up to the
    first prefix past RECOMPUTE_MAX_PARAMS (the prefix grows by doubling: a deep model is not built whole)."""
    n = min(deepest, 3)
    while True:
        counts = _counts(text_cfg, n)
        if n >= deepest or counts[n] > RECOMPUTE_MAX_PARAMS:
            return counts
        n = min(2 * n + 1, deepest)


def _counts(text_cfg: dict, n: int) -> dict[int, int]:
    import torch
    from transformers import AutoModelForCausalLM

    cfg = _truncated_config(text_cfg, n + 1)
    try:
        with torch.device("meta"):
            shape = AutoModelForCausalLM.from_config(cfg)
    except Exception as err:  # noqa: BLE001
        raise Unrecomputable(f"transformers cannot build the decoder from the config ({err})") from None
    total = sum(p.numel() for p in shape.parameters())
    # The decoder's layers: the first module list as long as the layers built (pre-order: before any inner list).
    stack = next((m for m in shape.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == n + 1), None)
    if stack is None:  # layers not found: the whole build stands for every prefix (all or nothing)
        return {k: total for k in range(n + 1)}
    per_layer = [sum(p.numel() for p in layer.parameters()) for layer in stack]
    base = total - sum(per_layer)
    return {k: base + sum(per_layer[: k + 1]) for k in range(n + 1)}


def plan_aux(text_cfg: dict, layer_ids: list[int], num_layers: int, quantized: bool = False) -> AuxPlan:
    """Which of `layer_ids`' aux ids (those below `num_layers`) the proof can recompute, from the target's config
    alone: the largest prefix within RECOMPUTE_MAX_PARAMS, and the ids within it. Raises nothing."""
    aux = sorted({i for i in layer_ids if i < num_layers})
    if not aux:
        return AuxPlan(None)
    if quantized or text_cfg.get("quantization_config"):
        return AuxPlan(
            None,
            unproven=aux,
            reason="the checkpoint is quantized (its tensors are not the float weights transformers builds, so "
            "its layers cannot be rebuilt in the flow's process)",
        )
    deepest = max(_needed(i, num_layers) for i in aux)
    try:
        counts = _prefix_params(text_cfg, deepest)
    except Unrecomputable as err:
        return AuxPlan(None, unproven=aux, reason=str(err))
    layers = max((k for k, n in counts.items() if n <= RECOMPUTE_MAX_PARAMS), default=None)
    proven = [i for i in aux if layers is not None and _needed(i, num_layers) <= layers]
    unproven = [i for i in aux if i not in proven]
    reason = None
    if unproven:
        k = 0 if layers is None else layers + 1  # the smallest prefix past the budget
        reason = (
            f"the proof rebuilds at most {RECOMPUTE_MAX_PARAMS / 1e9:g}B parameters (float32, in the flow's "
            f"process) and the target's embedding, {'first layer' if k == 0 else f'first {k + 1} layers'} and head "
            f"hold {counts[k] / 1e9:.2f}B"
        )
    return AuxPlan(layers if proven else None, proven, unproven, reason)


_PLANS: dict[tuple, AuxPlan] = {}


def plan_for(ctx: dict) -> AuxPlan:
    """`plan_aux` for a capture context (`eyrie.hidden_states.check.context_for`), once per process and target."""
    key = (ctx["model"], ctx.get("revision"), bool(ctx.get("quantized")), tuple(ctx["layer_ids"]), ctx["num_layers"])
    with _LOCK:
        if key not in _PLANS:
            try:
                text_cfg = text_config_of(ctx)
            except Unrecomputable as err:
                aux = sorted({i for i in ctx["layer_ids"] if i < ctx["num_layers"]})
                _PLANS[key] = AuxPlan(None, unproven=aux, reason=str(err))
            else:
                _PLANS[key] = plan_aux(text_cfg, ctx["layer_ids"], ctx["num_layers"], bool(ctx.get("quantized")))
        return _PLANS[key]


def aux_refusal(cfg: dict, layer_ids: list[int], num_layers: int, policy: str) -> tuple[list[str], list[str]]:
    """Preflight's prediction from the target's config.json `cfg` (no weights read) of what the capture proof can
    recompute: (failures, warnings). `policy` is extraction.unproven_aux_layers: with "refuse", aux ids the proof
    cannot recompute fail preflight, named with the reason and the fix; with "warn" they are a warning."""
    from eyrie.target.metadata import text_config

    text_cfg = text_config(cfg)
    quantized = bool(cfg.get("quantization_config") or text_cfg.get("quantization_config"))
    plan = plan_aux(text_cfg, layer_ids, num_layers, quantized)
    if not plan.unproven:
        return [], []
    what = (
        f"the capture proof cannot recompute aux layer ids {plan.unproven} from the target's weights: {plan.reason}"
        + (f" (it proves ids {plan.proven})" if plan.proven else "")
    )
    if policy == "warn":
        return [], [f"{what}; extraction.unproven_aux_layers: warn records them as unproven"]
    return [
        f"{what}. A capture not proven is not trained on by default: set extraction.unproven_aux_layers: warn to "
        "accept them on the last layer's head check and the ids proven, or choose shallower extraction.layer_ids"
    ], []


_RECOMPUTERS: dict[tuple, Recomputer | Unrecomputable] = {}
_LOCK = threading.RLock()


def text_config_of(ctx: dict) -> dict:
    """The decoder's config.json as the context recorded it (or read from a local checkpoint)."""
    if isinstance(ctx.get("text_config"), dict):
        return ctx["text_config"]
    import json

    from eyrie.target.metadata import text_config

    path = Path(ctx["model"]) / "config.json"
    try:
        return text_config(json.loads(path.read_text()))
    except (OSError, ValueError) as err:
        raise Unrecomputable(f"cannot read the target's config ({err})") from None


def recomputer(ctx: dict) -> Recomputer:
    """The rebuilt first layers for the aux ids `plan_for(ctx)` can prove (one past the deepest of them, capped below
    the last layer), built once per process and target; raises Unrecomputable when none can be."""
    plan = plan_for(ctx)
    if plan.layers is None:
        raise Unrecomputable(plan.reason or "no aux layer to recompute")
    layers = plan.layers
    key = (
        ctx["model"],
        ctx.get("revision"),
        bool(ctx.get("quantized")),
        layers,
        tuple(sorted(ctx["verifier_weights"].items())),
    )
    with _LOCK:
        if key not in _RECOMPUTERS:
            try:
                _RECOMPUTERS[key] = Recomputer(ctx, text_config_of(ctx), layers)
            except Unrecomputable as err:
                _RECOMPUTERS[key] = err
        got = _RECOMPUTERS[key]
    if isinstance(got, Unrecomputable):
        raise got
    return got


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def aux_problems(
    captured: list[tuple[torch.Tensor, list[int]]], layer_ids: list[int], num_layers: int, rec: Recomputer
) -> tuple[list[str], dict]:
    """Each aux layer of `captured` ([(hs [T, n_layers, H] float32, token ids)]) within the rebuilt first layers:
    within REL_MAX of its own layer and nearer to it than to either neighbour (NEIGHBOUR_MARGIN). The problems, and
    the figures per layer (relative L2 to its own layer, to the one before and the one after)."""
    import torch

    errs: dict[int, dict[str, float]] = {}
    problems = []
    pairs: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for hs, ids in captured:
        ref = rec.streams(ids)  # [layers+1, T, H]
        for j, lid in enumerate(layer_ids):
            if lid >= num_layers or _needed(lid, num_layers) > rec.layers:
                continue  # the last layer (the head check's), or past the prefix rebuilt (unproven: `plan_aux`)
            pairs.setdefault(lid, []).append((hs[:, j, :], ref))
    for lid, items in pairs.items():
        got = torch.cat([h for h, _ in items])

        def ref_at(k: int, items=items) -> torch.Tensor | None:
            if not 0 <= k < items[0][1].shape[0]:
                return None
            return torch.cat([r[k] for _, r in items])

        own = _rel(got, ref_at(lid))  # type: ignore[arg-type]
        fig = {"own": round(own, 4)}
        near = []
        for name, k in (("before", lid - 1), ("after", lid + 1)):
            r = ref_at(k)
            if r is not None:
                fig[name] = round(_rel(got, r), 4)
                near.append((name, k, fig[name]))
        errs[lid] = fig
        closest = min(near, key=lambda x: x[2], default=None)
        if own > REL_MAX:
            problems.append(
                f"layer {lid}: the captured stream is {own:.3f} (relative L2) from the target's own stream entering "
                f"layer {lid}, recomputed from its weights (at most {REL_MAX} expected)"
                + (f"; {closest[2]:.3f} from the one entering layer {closest[1]}" if closest else "")
            )
        elif closest is not None and own > NEIGHBOUR_MARGIN * closest[2]:
            problems.append(
                f"layer {lid}: the captured stream is {own:.3f} from the target's stream entering layer {lid} but "
                f"{closest[2]:.3f} from the one entering layer {closest[1]}: not clearly layer {lid}'s input"
            )
    return problems, errs


# ---------------------------------------------------------------------------------------------------------------
# The proof on a running server


def proof_prompts(source_dir: Path, max_model_len: int, rows: int = PROOF_ROWS) -> list[list[int]]:
    """The prompt part (before the first trained token) of `rows` rows spread over the data, at most
    PROMPT_TOKENS tokens from its start, short enough for ANSWER_TOKENS more within `max_model_len`."""
    from datasets import load_from_disk

    ds = load_from_disk(str(Path(source_dir) / "dataset")).with_format(None)
    n = len(ds)
    if not n:
        raise CaptureError(f"{source_dir}: no rows to prove the capture on")
    picks = sorted({round(i * (n - 1) / max(rows - 1, 1)) for i in range(min(rows, n))})
    cap = max(1, min(PROMPT_TOKENS, max_model_len - ANSWER_TOKENS - 1))
    out = []
    for i in picks:
        row = ds[i]
        ids = list(row["input_ids"])
        mask = row.get("loss_mask")
        end = next((t for t, m in enumerate(mask) if m), len(ids)) if mask else len(ids) // 2
        prompt = ids[: max(1, min(end, cap))]
        out.append(prompt)
    return out


Ranking = list[tuple[list[int], list[float]] | None]  # per position: None, then (ids best first, log-probabilities)


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 numbers at |x| (8 significant bits): the rounding step of the server's bf16 logits."""
    import torch

    _, exp = torch.frexp(x.abs().clamp(min=2.0**-126))
    return torch.ldexp(torch.ones_like(x), exp - 8)


def tie_nats(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How close two logits of one position must be to be a near-tie in the same forward pass: RANK_TIE_NATS, or
    RANK_TIE_ULPS bf16 steps at their magnitude where more (a server's bf16 logits round by that much)."""
    import torch

    step = _bf16_ulp(torch.maximum(a.abs(), b.abs()))
    return torch.clamp(RANK_TIE_ULPS * step, min=RANK_TIE_NATS)


def rank_agreement(logits: torch.Tensor, server: list[tuple[list[int], list[float]]]) -> dict[str, Any]:
    """How the target's own logits `logits` [N, V] (float32: its head on the captured last layer) rank the
    vocabulary against the server's own ranking `server` (per row: its top token ids best first, and their
    log-probabilities) at the same N positions of the same forward pass. The two differ by rounding alone (the
    server's logits are bf16), so a near-tie (`tie_nats`: a few hundredths of a nat) is one on BOTH sides: two
    tokens that close in the target's logits and in the server's log-probabilities, which rounding orders either
    way (a capture whose logits are flat, zeros through the norm, has ties on its side only). Figures, over the N
    positions:

    - `top1_agreement`: the server's top token is the target's top one, or the two are a near-tie;
    - `top1_exact`: the server's top token is the target's top one;
    - `topk_overlap`: the mean share of the server's top K that the target ranks within its own top K, a token out
      of it counted in where it is a near-tie with the K-th on both sides;
    - `topk_overlap_exact`: the mean share of the server's top K in the target's top K;
    - `tie_nats_max`: the widest near-tie allowed at any position."""
    n, vocab = logits.shape
    if n != len(server):
        raise ValueError(f"{n} rows of logits for {len(server)} rankings")
    if not n:
        return {"positions": 0, "top_k": 0}
    logits = logits.float()
    k = min(vocab, max(len(ids) for ids, _ in server))
    top = logits.topk(k, dim=-1)
    agree = exact1 = 0
    widest = 0.0
    tolerant, exact = [], []
    for i, (ids, lps) in enumerate(server):
        kk = min(len(ids), k)
        ids, lps = ids[:kk], lps[:kk]
        row = logits[i]
        mine = int(top.indices[i, 0])
        theirs = dict(zip(ids, lps, strict=True))
        tol = float(tie_nats(top.values[i, 0], row[ids[0]]))
        widest = max(widest, tol)
        if mine == ids[0]:
            agree, exact1 = agree + 1, exact1 + 1
        elif float(top.values[i, 0] - row[ids[0]]) <= tol and mine in theirs and lps[0] - theirs[mine] <= tol:
            agree += 1
        my_set = set(top.indices[i, :kk].tolist())
        my_cut, their_cut = top.values[i, kk - 1], lps[-1]
        hits = ties = 0
        for t in ids:
            if t in my_set:
                hits += 1
                continue
            tol = float(tie_nats(my_cut, row[t]))
            widest = max(widest, tol)
            if float(my_cut - row[t]) <= tol and theirs[t] - their_cut <= tol:
                ties += 1
        exact.append(hits / kk)
        tolerant.append((hits + ties) / kk)
    return {
        "positions": n,
        "top_k": k,
        "top1_agreement": round(agree / n, 4),
        "top1_exact": round(exact1 / n, 4),
        "topk_overlap": round(sum(tolerant) / n, 4),
        "topk_overlap_exact": round(sum(exact) / n, 4),
        "tie_nats_max": round(widest, 4),
    }


def rank_problems(
    logits: torch.Tensor, server: list[tuple[list[int], list[float]]], layer: int
) -> tuple[list[str], dict]:
    """The proof's rule for the last layer: the target's head on the captured layer `layer` (its logits) must rank
    the tokens as the server did in the same forward pass (`rank_agreement`, near-ties on both sides counted as
    agreeing): the server's top token at GREEDY_MIN_AGREEMENT of the positions, and on average RANK_MIN_OVERLAP of
    the server's top K. A correct capture differs from the server's own logits by rounding alone, so both hold even
    on near-flat logits, where ties flip; another layer, the stream plus a layer's input, zeros or another target's
    states rank the vocabulary otherwise. The problems, and the figures (with the thresholds). Pure: no I/O."""
    vocab = logits.shape[-1]
    past = sorted({t for ids, _ in server for t in ids if not 0 <= t < vocab})
    if past:
        return [f"the server ranks token ids {past[:5]} that the target's head (vocabulary {vocab}) does not have"], {
            "positions": len(server)
        }
    if any(not ids or len(ids) != len(lps) for ids, lps in server):
        return ["the server's ranking is empty or malformed at some positions"], {"positions": len(server)}
    figures = rank_agreement(logits, server)
    figures.update(
        min_top1_agreement=GREEDY_MIN_AGREEMENT,
        min_topk_overlap=RANK_MIN_OVERLAP,
        tie_nats=RANK_TIE_NATS,
        tie_bf16_steps=RANK_TIE_ULPS,
    )
    n = figures["positions"]
    if n < MIN_POSITIONS:
        return [f"only {n} positions ranked by the server to check the last layer on"], figures
    problems = []
    top1, overlap, k = figures["top1_agreement"], figures["topk_overlap"], figures["top_k"]
    if top1 < GREEDY_MIN_AGREEMENT:
        problems.append(
            f"layer {layer} (the last layer's output) through the target's own final norm and head gives the "
            f"server's top token (from the same forward pass), or a near-tie of it on both sides, at only {top1:.0%} "
            f"of {n} positions (at least {GREEDY_MIN_AGREEMENT:.0%} expected; exact {figures['top1_exact']:.0%}): it "
            "is not the stream the target's head reads"
        )
    if overlap < RANK_MIN_OVERLAP:
        problems.append(
            f"layer {layer} (the last layer's output) through the target's own final norm and head shares on average "
            f"only {overlap:.0%} of the server's top {k} tokens at {n} positions (at least {RANK_MIN_OVERLAP:.0%} "
            "expected, near-ties at the cut counted in): it is not the stream the target's head reads"
        )
    return problems, figures


def judge(ctx: dict, samples: list[tuple[torch.Tensor, list[int], int, Ranking]], log=print) -> dict:
    """The proof's verdict on captured samples [(hs [T, n_layers, H], token ids, prompt length, the server's ranking
    at each of the T positions from the forward pass that captured hs)] whose tokens after the prompt are the
    target's greedy choices; raises CaptureError with every problem, else returns the figures."""
    import torch

    layer_ids = list(ctx["layer_ids"])
    L = ctx["num_layers"]
    problems: list[str] = []
    figures: dict[str, Any] = {"prompts": len(samples), "answer_tokens": ANSWER_TOKENS, "layer_ids": layer_ids}
    for n, (hs, ids, _, ranking) in enumerate(samples):
        if hs.shape[1] != len(layer_ids):
            raise CaptureError(f"the capture holds {hs.shape[1]} layers; {len(layer_ids)} ({layer_ids}) were asked for")
        if len(ranking) != len(ids) or hs.shape[0] != len(ids):
            raise CaptureError(
                f"proof prompt {n}: {len(ids)} tokens, {hs.shape[0]} captured rows and the server's ranking at "
                f"{len(ranking)} positions"
            )
        problems += row_problems(hs, layer_ids, f"proof prompt {n}")
    # 1. the last layer through the target's own norm and head, against the server's own ranking from the same
    # forward pass (the state at p-1 predicts the token at p: the server's ranking at position p)
    if L not in layer_ids:
        problems.append(f"layer {L} (the last layer's output) is not captured: the head check needs it")
    else:
        last = layer_ids.index(L)
        rows: list[torch.Tensor] = []
        server: list[tuple[list[int], list[float]]] = []
        greedy_at: list[int] = []
        tokens: list[int] = []
        for hs, ids, p, ranking in samples:
            start = sum(r.shape[0] for r in rows)
            rows.append(hs[: len(ids) - 1, last, :])
            server += [(list(r[0]), list(r[1])) if r is not None else ([], []) for r in ranking[1:]]
            greedy_at += range(start + p - 1, start + len(ids) - 1)
            tokens += ids[p:]
        if len(tokens) < MIN_POSITIONS:
            problems.append(f"only {len(tokens)} greedy positions to check the last layer on")
        else:
            logits = head_logits(ctx, torch.cat(rows))
            found, check = rank_problems(logits, server, L)
            problems += found
            agreement, top1 = tie_agreement(logits[greedy_at].log_softmax(-1), tokens)
            figures["head_check"] = {
                "layer": L,
                "reference": f"the server's own top-{SERVER_TOP_K} ranking at every position of the forward pass "
                "that captured the states (prompt_logprobs)",
                **check,
                # The server's greedy answers come from other forward passes (decode steps, other kernels): a
                # figure, not the verdict (near-ties flip between passes on near-flat logits)
                "greedy_vs_forward": {
                    "positions": len(tokens),
                    "agreement": round(agreement, 4),
                    "top1": round(top1, 4),
                },
            }
    # 2. every aux layer against the target's own first layers, recomputed
    aux = [i for i in layer_ids if i < L]
    if aux:
        plan = plan_for(ctx)
        check_aux: dict[str, Any] = {}
        unproven, reason = list(plan.unproven), plan.reason
        if plan.proven:
            try:
                rec = recomputer(ctx)
            except Unrecomputable as err:  # the config allowed it but the checkpoint does not (names, tensors)
                unproven, reason = sorted(set(unproven) | set(plan.proven)), str(err)
            else:
                found, errs = aux_problems([(hs, ids) for hs, ids, _, _ in samples], layer_ids, L, rec)
                problems += found
                check_aux = {"recomputed_layers": rec.layers, "relative_l2": errs, "max": REL_MAX}
        if unproven:
            check_aux.update(unproven=unproven, reason=reason)
            if ctx.get(AUX_POLICY) == "warn":
                warning = (
                    f"the capture proof could not recompute aux layer ids {unproven} ({reason}): they are unproven; "
                    "the last layer is proven through the target's head"
                    + (f" and ids {sorted(done)} recomputed" if (done := check_aux.get("relative_l2")) else "")
                )
                check_aux["allowed_by"] = "extraction.unproven_aux_layers: warn"
                figures["warnings"] = [warning]
                log(f"warning: {warning}")
            else:
                problems.append(
                    f"aux layers {unproven} cannot be proven: {reason}. A capture not proven is not trained on: set "
                    "extraction.unproven_aux_layers: warn to accept them unproven, or choose shallower "
                    "extraction.layer_ids"
                )
        figures["aux_check"] = check_aux
    figures["problems"] = problems
    if problems:
        raise CaptureError(
            "the capture proof refuses this server's hidden states: they are not the target's residual stream:\n  - "
            + "\n  - ".join(problems[:12])
            + "\nNothing was extracted. Zeros or a wrong layer come from the server's capture (a vLLM version whose "
            "extraction is wrong for this architecture, or Eyrie's compatibility layer): check `eyrie preflight`'s "
            "EAGLE-3 path and the server log."
        )
    return figures


# ---------------------------------------------------------------------------------------------------------------
# Targets whose layers carry recurrent state, decided before the load


def recurrent_state(cls, text_cfg: dict) -> str | None:
    """What makes the target's layers carry recurrent state, or None: vLLM's own interfaces on its model class
    (`IsHybrid`, `HasInnerState`, `IsAttentionFree`: flags vLLM sets for state-space, short-convolution and
    linear-attention layers) or the config's `layer_types` whose cache transformers keeps as a recurrent state (a
    `LinearAttentionCacheLayerMixin` layer, legacy names remapped as transformers does)."""
    flags = [f for f in ("is_hybrid", "has_inner_state", "is_attention_free") if getattr(cls, f, False) is True]
    if flags:
        name = getattr(cls, "__name__", str(cls))
        return f"vLLM's {name} declares {', '.join(flags)} (layers that carry a recurrent state)"
    types = text_cfg.get("layer_types")
    if isinstance(types, list) and types:
        try:
            from transformers import cache_utils, configuration_utils
        except ImportError:  # pragma: no cover - transformers is a dependency
            return None
        remap = getattr(configuration_utils, "_LEGACY_LAYER_TYPE_REMAP", {})
        mapping = getattr(cache_utils, "DYNAMIC_LAYER_TYPE_MAPPING", {})
        mixin = getattr(cache_utils, "LinearAttentionCacheLayerMixin", None)
        if mixin is None:
            return None
        stateful = sorted(
            {t for t in types if isinstance(t, str) and issubclass(mapping.get(remap.get(t, t), object), mixin)}
        )
        if stateful:
            n = sum(1 for t in types if t in stateful)
            return f"{n} of its {len(types)} layers are of types {stateful} (transformers keeps a recurrent state)"
    return None


def recurrent_state_refusal(cls, text_cfg: dict, policy: str = "refuse") -> list[str]:
    """Preflight's refusal, before any load, of a target whose layers carry recurrent state: vLLM's capture of
    such layers is not proven (on one hybrid it came out 0.23-0.32 from the target's states). `policy` is
    target.recurrent_layers: "prove" loads it anyway and the capture proof decides minutes after the load, before
    any shard."""
    why = recurrent_state(cls, text_cfg)
    if why is None or policy == "prove":
        return []
    return [
        f"the target's layers carry recurrent state ({why}): vLLM's hidden-state capture of such a target is not "
        "proven right (on one hybrid it was 0.23-0.32 relative L2 from the target's own states), and a drafter "
        "trained on a wrong capture is useless. Set target.recurrent_layers: prove to load it and let the capture "
        "proof (every layer it can recompute from the target's weights) decide before any shard, or use an "
        "attention-only target"
    ]
