"""Where the train/serve gap comes from, token by token, for a finished run.

    python benchmarks/train_serve_gap.py --config configs/demo.yaml --run-dir runs/demo [--out DIR] [--stage all]

Stages (each writes into --out, default RUN_DIR/gap-probe; `--stage analyse` reuses what the others wrote):

serve    the run's exported drafter served by vLLM as evaluation serves it (the same spec, per-request metrics on, the
         held-out prompts `concurrency` at a time, greedy): each request's prompt and answer token ids and vLLM's
         own acceptance histogram for it (`served.jsonl`).
extract  the target's hidden states of every served sequence (prompt + answer), captured by the run's extraction
         server as extraction captures the training rows (`served_hs/`).
analyse  the trained drafter in torch (the checkpoint training shipped, float32) on the captured states, with
         speculators' training-time-test forward; every figure per draft position (`report.json`):

  A  speculators' validation metric (draft == the label: the argmax over the draft vocabulary of the target's
     head on the captured last hidden state; every start in the loss mask), and Eyrie's like-for-like recount;
  B  the same starts, a draft counted right when it is the token that followed in the sequence (what vLLM checks);
  C  B over the starts vLLM drafts from (the first answer token, then after each draft its accepted tokens + 1,
     none from an answer's last token): a simulation of serving on these sequences;

  each on the validation rows (the training data's last `train.val_fraction`, the trainer's split) and on the served
  sequences, beside D, vLLM's own per-position acceptance over the same requests (from its histograms), and per
  request whether C's histogram is vLLM's.

What separates the figures: A vs B on the same rows, the labels against the tokens; B vs C, which starts count;
C on validation rows vs C on served sequences, the population (`by_kind`: vLLM's and the simulation's acceptance per
kind of prompt, with the training conversations of that kind); C vs D on the served sequences, vLLM's numerics (its
live hidden states and its drafter kernels) against the captured states and torch's drafter, except at answer ends:
vLLM counts drafts accepted past the stop token (`accepted_past_the_end`), which C, knowing no token past the
answer, counts wrong.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from itertools import islice
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _served_requests(config, run_dir: Path, out: Path, concurrency: int) -> None:
    from eyrie.run.files import read_json
    from eyrie.stages.evaluate.counters import request_counts, settled_counters, spec_counters, with_per_request_metrics
    from eyrie.stages.prepare import iter_eval_prompts
    from eyrie.vllm.process import VllmServer
    from eyrie.vllm.spec import ServerSpec

    export = read_json(run_dir / "export" / "manifest.json") or {}
    drafter = export.get("drafter") or str(run_dir / "export" / "drafter")
    spec = ServerSpec.for_serving(config, drafter=str((run_dir / "export" / "drafter").resolve()))
    spec = replace(spec, server_args=with_per_request_metrics(spec.server_args))
    prompts = list(islice(iter_eval_prompts(run_dir / "prepare"), config.evaluate.num_prompts))
    server = VllmServer(out / "serve")
    client = server.ensure(spec)
    try:

        def chat(messages):
            body = {
                "model": "target",
                "messages": messages,
                "max_tokens": config.evaluate.max_tokens,
                "temperature": 0.0,
                "return_token_ids": True,
            }
            r = client.session.post(client.base_url + "/v1/chat/completions", json=body, timeout=600)
            r.raise_for_status()
            return r.json()

        before = spec_counters(client.metrics())
        first = chat(prompts[0])  # alone first, as evaluation sends it
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            outs = [first, *pool.map(chat, prompts[1:])]
        after = settled_counters(client, before, len(prompts))
    finally:
        server.stop()
    with open(out / "served.jsonl", "w") as f:
        for messages, o in zip(prompts, outs, strict=True):
            row = {
                "messages": messages,
                "prompt_token_ids": o["prompt_token_ids"],
                "token_ids": o["choices"][0]["token_ids"],
                "finish_reason": o["choices"][0]["finish_reason"],
                "counts": request_counts(o),
            }
            f.write(json.dumps(row) + "\n")
    (out / "served_counters.json").write_text(json.dumps({"before": before, "after": after, "drafter": drafter}))


def _extract_served(config, run_dir: Path, out: Path) -> None:
    import torch

    from eyrie.stages.extract.proof import _captured
    from eyrie.vllm.process import VllmServer
    from eyrie.vllm.spec import ServerSpec

    captured = _captured_ids(run_dir)
    staging = out / "staging"
    staging.mkdir(parents=True, exist_ok=True)
    spec = ServerSpec.for_extraction(config, captured, str(staging.resolve()))
    server = VllmServer(out / "extract")
    client = server.ensure(spec)
    hs_dir = out / "served_hs"
    hs_dir.mkdir(exist_ok=True)
    try:
        for i, line in enumerate((out / "served.jsonl").read_text().splitlines()):
            row = json.loads(line)
            ids = row["prompt_token_ids"] + row["token_ids"]
            hidden = _captured(client, ids, 600)
            torch.save({"token_ids": torch.tensor(ids), "hidden_states": hidden}, hs_dir / f"{i}.pt")
    finally:
        server.stop()


def _captured_ids(run_dir: Path) -> list[int]:
    """The layer ids the run's extraction captured (aux ids and the last layer's), from its server's log line."""
    import re

    text = (run_dir / "extract" / "server.log").read_text(errors="replace")
    found = re.search(r"'eagle_aux_hidden_state_layer_ids': \[([0-9, ]+)\]", text)
    if not found:
        raise SystemExit(f"no captured layer ids in {run_dir / 'extract' / 'server.log'}")
    return [int(x) for x in found.group(1).split(",")]


# ------------------------------------------------------------------------------------------------------------------
# Analysis: the drafter's training-time-test forward in torch


def load_drafter(checkpoint: Path):
    import torch
    from speculators.models.eagle3.config import Eagle3SpeculatorConfig
    from speculators.models.eagle3.core import Eagle3DraftModel

    cfg = Eagle3SpeculatorConfig.from_pretrained(str(checkpoint))
    cfg.transformer_layer_config._attn_implementation = "sdpa"
    model = Eagle3DraftModel.from_pretrained(str(checkpoint), config=cfg).float().eval()
    torch.set_grad_enabled(False)
    return model


def ttt(model, hidden: object, ids: object, steps: int) -> dict:
    """One sequence's drafts from every start, as speculators' validation forward makes them: `hidden` [T, L+1, H]
    (aux layers, then the last layer), `ids` [T]. Shifted as speculators' shift_batch: index j's inputs are token
    ids[j+1] and the aux states at j. Returns per step k, for each start j, the draft (a target-vocabulary id) for
    token ids[j+2+k] and the label (argmax over the draft vocabulary of the target's head at j+1+k)."""
    import torch

    aux = hidden[:-1, :-1].flatten(1).float().unsqueeze(0)
    last = hidden[1:, -1].float().unsqueeze(0)
    x = ids[1:].unsqueeze(0)
    n = x.shape[1]
    drafts = model(
        hidden_states=aux,
        input_ids=x,
        document_ids=torch.zeros(1, n, dtype=torch.long),
        position_ids=torch.arange(1, n + 1).unsqueeze(0),
        ttt_steps=steps,
    )
    labels = torch.argmax(model.verifier_lm_head(model.verifier_norm(last)), dim=-1)[0]
    d2t = model.d2t.cpu()
    to_target = lambda d: d + d2t[d]  # noqa: E731
    return {"drafts": [to_target(d[0]) for d in drafts], "labels": to_target(labels), "x": x[0]}


def rights(out: dict, mask: list[bool], steps: int, vs: str) -> list[list[bool]]:
    """Per step k and start j (shifted indices, see `ttt`), whether the step-k draft is right. vs "labels": it is
    the label and its target is in the loss mask (speculators' validation); "tokens": it is the token that followed
    in the sequence (what vLLM checks)."""
    x, n = out["x"], len(mask)
    ok = []
    for k in range(steps):
        d = out["drafts"][k]
        if vs == "labels":
            ok.append([j + k < n and bool(d[j] == out["labels"][j + k]) and mask[j + k] for j in range(n)])
        else:
            ok.append([j + k + 1 < n and bool(d[j] == x[j + k + 1]) for j in range(n)])
    return ok


def accepted(ok: list[list[bool]], j: int) -> int:
    a = 0
    while a < len(ok) and ok[a][j]:
        a += 1
    return a


def served_starts(ok: list[list[bool]], mask: list[bool]) -> list[int]:
    """The starts vLLM drafts from, walked through each answer span: the first answer token, then after a draft
    its accepted tokens + 1 later; none from an answer's last token (the request ends there)."""
    n, starts, j = len(mask), [], 0
    while j < n:
        if mask[j] and j + 1 < n and mask[j + 1]:
            starts.append(j)
            j += accepted(ok, j) + 1
        else:
            j += 1
    return starts


def counts_over(ok: list[list[bool]], starts_per_step: list[list[int]]) -> list[list[int]]:
    """[accepted through step k, starts] per step k, over each step's starts."""
    return [[sum(accepted(ok, j) > k for j in s), len(s)] for k, s in enumerate(starts_per_step)]


def ratio(pairs: list[list[int]]) -> float:
    right, total = sum(p[0] for p in pairs), sum(p[1] for p in pairs)
    return round(right / total, 4) if total else 0.0


def clustered_se(pairs: list[list[int]]) -> float:
    """The standard error of a pooled rate over sequences, [right, total] each (a ratio estimator clustered by
    sequence: the drafts of one answer are not independent)."""
    total = sum(p[1] for p in pairs)
    m = len(pairs)
    if total == 0 or m < 2:
        return 0.0
    r = sum(p[0] for p in pairs) / total
    var = m / (m - 1) * sum((a - r * b) ** 2 for a, b in pairs) / total**2
    return round(math.sqrt(var), 4)


def hist_pairs(hist: list[int]) -> list[list[int]]:
    """A request's acceptance histogram (drafts by tokens accepted) as [accepted through position k, drafts]."""
    return [[sum(hist[k + 1 :]), sum(hist)] for k in range(len(hist) - 1)]


def analyse(config, run_dir: Path, out: Path, checkpoint: Path | None = None) -> dict:
    import torch
    from datasets import load_from_disk
    from safetensors.torch import load_file

    from eyrie.hidden_states.encoding import decode
    from eyrie.run.files import read_json

    steps = config.evaluate.num_speculative_tokens
    train = read_json(run_dir / "train" / "manifest.json") or {}
    if checkpoint is None:  # the checkpoint training shipped (its path is relative to the stage folder)
        checkpoint = run_dir / "train" / train["checkpoint"]
    model = load_drafter(checkpoint)

    def figures(seqs):
        """seqs: (hidden [T, L+1, H], ids [T], loss mask [T]) each; the A/B/C figures over them, per position
        [right, starts] per sequence, pooled, with a standard error clustered by sequence."""
        per_seq: dict[str, list] = {k: [] for k in ("A_speculators", "A_like_for_like", "B_tokens", "C_served_starts")}
        hists = []
        for hidden, ids, lm in seqs:
            mask = [bool(v) for v in lm[1:]]  # shifted as the trainer shifts
            n = len(mask)
            out = ttt(model, hidden, ids, steps)
            lab, tokn = rights(out, mask, steps, "labels"), rights(out, mask, steps, "tokens")
            in_mask = [[j for j in range(n) if mask[j]] for _ in range(steps)]
            can = [[j for j in range(n) if mask[j] and j + k < n and mask[j + k]] for k in range(steps)]
            spec = counts_over(lab, in_mask)  # speculators divides by the k-th targets in the mask
            spec = [[c[0], sum(mask[k:])] for k, c in enumerate(spec)]
            per_seq["A_speculators"].append(spec)
            per_seq["A_like_for_like"].append(counts_over(lab, can))
            per_seq["B_tokens"].append(counts_over(tokn, can))
            starts = served_starts(tokn, mask)
            per_seq["C_served_starts"].append(counts_over(tokn, [starts] * steps))
            hist = [0] * (steps + 1)
            for j in starts:
                hist[accepted(tokn, j)] += 1
            hists.append(hist)
        summary: dict = {"sequences": len(seqs)}
        for name, rows in per_seq.items():
            summary[name] = {
                "per_position": [ratio([r[k] for r in rows]) for k in range(steps)],
                "se": [clustered_se([r[k] for r in rows]) for k in range(steps)],
                "starts": [sum(r[k][1] for r in rows) for k in range(steps)],
            }
        summary["_hists"] = hists
        return summary

    # Validation rows: the trainer's split of the training data, with the files the trainer read.
    data_dir = run_dir / ("regenerate" if (run_dir / "regenerate" / "dataset").exists() else "prepare") / "dataset"
    ds = load_from_disk(str(data_dir)).with_format(None)
    split = int(len(ds) * (1 - config.train.val_fraction))
    hs_dir = run_dir / "extract" / "hidden_states"
    val = []
    for i in range(split, len(ds)):
        data = decode(load_file(str(hs_dir / f"hs_{i}.safetensors")), torch.float32)
        assert data["token_ids"].tolist() == ds[i]["input_ids"], f"hs_{i} is not row {i}"
        val.append((data["hidden_states"], data["token_ids"], ds[i]["loss_mask"]))
    report = {"checkpoint": str(checkpoint), "val_metrics": train.get("val_metrics"), "validation_rows": figures(val)}
    report["train_serve_gap"] = (read_json(run_dir / "evaluate" / "manifest.json") or {}).get("train_serve_gap")

    served_path = out / "served.jsonl"
    if served_path.exists() and (out / "served_hs").exists():
        served, vllm_hists = [], []
        lines = served_path.read_text().splitlines()
        for i, line in enumerate(lines):
            row = json.loads(line)
            data = torch.load(out / "served_hs" / f"{i}.pt")
            n_prompt = len(row["prompt_token_ids"])
            lm = [0] * n_prompt + [1] * len(row["token_ids"])
            served.append((data["hidden_states"], data["token_ids"], lm))
            c = row["counts"]
            hist = [c["drafts"] - c["per_pos"][0]] + [
                c["per_pos"][i] - (c["per_pos"][i + 1] if i + 1 < len(c["per_pos"]) else 0)
                for i in range(len(c["per_pos"]))
            ]
            vllm_hists.append(hist)
        fig = figures(served)
        d_pairs = [hist_pairs(h) for h in vllm_hists]
        fig["D_vllm"] = {
            "per_position": [ratio([r[k] for r in d_pairs]) for k in range(steps)],
            "se": [clustered_se([r[k] for r in d_pairs]) for k in range(steps)],
            "starts": [sum(r[k][1] for r in d_pairs) for k in range(steps)],
        }
        sim = fig["_hists"]
        fig["C_equals_D_requests"] = sum(a == b for a, b in zip(sim, vllm_hists, strict=True))
        fig["requests"] = len(vllm_hists)
        # vLLM's counters count drafts accepted past the answer's stop token (verified whole, cut afterwards): a
        # request whose counts produce more tokens (1 + drafts + accepted) than it answered.
        past = [json.loads(line) for line in lines]
        over = [1 + r["counts"]["drafts"] + r["counts"]["accepted"] - len(r["token_ids"]) for r in past]
        fig["accepted_past_the_end"] = {
            "requests": sum(o > 0 for o in over),
            "tokens": sum(max(o, 0) for o in over),
            "accepted": sum(r["counts"]["accepted"] for r in past),
        }
        # Per kind of prompt (its first user turn's first two words, numbers dropped): vLLM's acceptance and the
        # simulation's, and whether the training data has that kind at all.
        trained_kinds = Counter(kind(r["messages"]) for r in _conversations(run_dir))
        groups: dict[str, list[int]] = {}
        for i, line in enumerate(served_path.read_text().splitlines()):
            groups.setdefault(kind(json.loads(line)["messages"]), []).append(i)
        fig["by_kind"] = {
            name: {
                "requests": len(idx),
                "distinct_prompts": len({json.dumps(json.loads(lines[i])["messages"]) for i in idx}),
                "training_conversations": trained_kinds.get(name, 0),
                "vllm": [ratio([d_pairs[i][k] for i in idx]) for k in range(steps)],
                "simulated": [ratio([hist_pairs(sim[i])[k] for i in idx]) for k in range(steps)],
                "drafts": sum(d_pairs[i][0][1] for i in idx),
            }
            for name, idx in sorted(groups.items())
        }
        distinct = {}
        for i, line in enumerate(lines):
            distinct.setdefault(json.dumps(json.loads(line)["messages"]), []).append(i)
        fig["D_vllm"]["se_by_distinct_prompt"] = [
            clustered_se(
                [[sum(d_pairs[i][k][0] for i in idx), sum(d_pairs[i][k][1] for i in idx)] for idx in distinct.values()]
            )
            for k in range(steps)
        ]
        fig["differing_requests"] = [
            {"request": i, "simulated": a, "vllm": b}
            for i, (a, b) in enumerate(zip(sim, vllm_hists, strict=True))
            if a != b
        ][:20]
        report["served_sequences"] = fig
    for part in ("validation_rows", "served_sequences"):
        if part in report:
            report[part].pop("_hists", None)
    return report


def kind(messages: list[dict]) -> str:
    """A prompt's kind for the breakdown: its first user turn's first two words, numbers dropped."""
    import re

    text = next((m["content"] for m in messages if m["role"] == "user"), "")
    return " ".join(re.sub(r"[0-9]+", "N", text).split()[:2])


def _conversations(run_dir: Path) -> list[dict]:
    path = run_dir / "prepare" / "conversations.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main(argv: list[str] | None = None) -> None:
    from eyrie.config import load_config

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--out", default=None)
    ap.add_argument("--stage", choices=["all", "serve", "extract", "analyse"], default="all")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--checkpoint", default=None, help="a drafter checkpoint other than the one training shipped")
    args = ap.parse_args(argv)
    config = load_config(args.config)
    run_dir = Path(args.run_dir)
    out = Path(args.out) if args.out else run_dir / "gap-probe"
    out.mkdir(parents=True, exist_ok=True)
    if args.stage in ("all", "serve"):
        _served_requests(config, run_dir, out, args.concurrency)
    if args.stage in ("all", "extract"):
        _extract_served(config, run_dir, out)
    if args.stage in ("all", "analyse"):
        report = analyse(config, run_dir, out, Path(args.checkpoint) if args.checkpoint else None)
        (out / "report.json").write_text(json.dumps(report, indent=1))
        print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
