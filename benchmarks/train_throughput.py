"""Train-stage throughput on one GPU: Eyrie's exact train command against the bare EAGLE-3 model step.

At Kimi-K2.5 dimensions (hidden 7168, target vocabulary 163840, draft vocabulary 32000, packed 4096 tokens, TTT 3)
this builds a synthetic run folder in the layout Eyrie's stages write, then measures, in one run:

  step    the bare model step: speculators' Eagle3DraftModel at the draft geometry Eyrie builds
          (`eyrie.target.drafter.draft_layer_config`), bf16 weights, fused AdamW, flex attention, eager loss,
          synthetic
          GPU-resident inputs (as ../shared/bench/eagle3_train_step.py). `--master fp32 --clip --opt X` gives the
          trainer's own math (fp32 weights under bf16 autocast, gradient clipping, optimizer X) on the same inputs;
          `--trainer-norms` adds the two norms speculators' CLI turns on for eagle3, `--shifted-docs` packs the
          documents as the trainer's batches hold them (2047 tokens each after the shift, then padding, so their
          boundaries miss flex attention's 128-token blocks), `--eyrie-patches` applies eyrie.stages.train.entry's
          sync-free accuracy and loss scalars, `--bf16-weights` (with `--master fp32`) its bfloat16 working copies
          of the float32 weights (BF16_WEIGHTS). `--iters` steps are timed (20: a 2 s burst; the trainer's window
          is 20-25 s at the GPU's sustained clock); GPU clocks and power (nvidia-smi, and NVML's energy
          counter: `energy_W`, `joules_per_step`) are sampled over them. The tensors the drafter borrows from the
          target (embedding, both heads) are finite, as the trainer's (`--verifier-weights finite`); built bare,
          speculators leaves them NaN, and a step on NaN draws ~470 W against ~680 W, so the GPU keeps ~1930 MHz
          under its 700 W cap instead of ~1650: `--verifier-weights finite,nan` (all's default) times both in one
          process, `bare-nan` being the bare step as measured up to 2026-12-01.
  eyrie   the command `eyrie.stages.train.trainer.training_command()` builds from the Kimi preset pointed at the
  synthetic target,
          run as Eyrie runs it (a subprocess with EYRIE_TRAIN_DEVICE), reading the hidden-state files; tokens/s
          between logged steps after warm-up (real tokens, as speculators counts them), the time from launch to
          the first step and where it went, GPU utilisation, clocks and CPU load sampled alongside. The same argv
          goes through `_bench_entry` (`--exact`: the command itself), whose hooks change nothing the trainer
          does: start-up marks (imports, build, loaders, first batch, first step), the loop's wait for each batch,
          host time per step and collector pauses every 25 steps, and with `--profile START,STEPS` a
          torch.profiler window analysed by `analyse_trace` (GPU busy and idle, kernel time by kind, host syncs,
          the largest idle gaps and what the training thread did meanwhile; the trace comes back gzipped).
          `--off NAME` turns off one of eyrie.stages.train.entry's GPU switches (GPU_FEED, SYNC_FREE_METRICS, ...).
          `--optimizer` sets `train.optimizer`; everything else is the preset's. `--inmem` swaps speculators' data
          loaders for one pinned batch served from memory (same trainer, model and optimizer): the trainer without
          its loader. A second launch on the same run folder is a retry: torch.compile's cache
          (`<run>/train/compile-cache`, where eyrie.stages.train.entry puts it) is then warm.
  loader  speculators' train loader as Eyrie's command configures it, drained with no model: batches/s it can
          deliver (with eyrie.stages.train.entry's GPU patches, `--off` as above).
  ab      optimizer A/B on a carried Eyrie run folder (the demo's extracted hidden states): `run_training` with
          each optimizer, validation accuracy per position per epoch against wall-clock seconds.

`all` runs gen, step and eyrie (each optimizer in --optimizers) and prints the rates and their ratio (to the bare
step on finite tensors, and to it on NaN). With `--profile START,STEPS` both the bare step and the trainer write
`kernels_<name>.json` (every GPU kernel by full name: launches and ms per step, with the window's SM clock and
power) and `keyavg_<name>.txt` (torch.profiler's key_averages table) beside the logs, and `all` ends with
`compare`: the trainer's window against the bare step's, kernel by kind, by family and by name, also at the bare
step's clock (`compare --compare A.json B.json` does it for any two tables). The trainer's first step also logs
where torch.compile's time went (`compile`: dynamo's phase totals, each compiled frame and its slowest kernels).
Every measurement is one JSON line on stdout and in --results.

Runs on a GPU machine with torch, transformers, safetensors, numpy, pyarrow and PyYAML but neither speculators nor
vLLM and no network: speculators and its needs travel as wheels in the ignored folder `.whl/`, which
`benchmarks/train_throughput.sh` installs into a private folder first. `--tiny` shrinks every dimension so the
plumbing can be checked on a CPU (no pip, no GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

KIMI = dict(
    hidden=7168,
    vocab=163840,
    draft_vocab=32000,
    layers=61,
    heads=64,
    kv_heads=64,
    qk_rope=64,
    intermediate=18432,
    aux=[2, 30, 58],
    seq=4096,
    row_tokens=2048,
    mask=163839,
)
TINY = dict(
    hidden=64,
    vocab=4096,
    draft_vocab=512,
    layers=8,
    heads=4,
    kv_heads=4,
    qk_rope=16,
    intermediate=128,
    aux=[2, 4, 5],
    seq=256,
    row_tokens=128,
    mask=4095,
)
PIDS = Path("/tmp/eyrie-train-throughput-pids")


def dims(args) -> dict:
    return TINY if args.tiny else KIMI


def emit(args, record: dict) -> dict:
    record = {"ts": round(time.time(), 3), **record}
    print(json.dumps(record), flush=True)
    if args.results:
        with open(args.results, "a") as f:
            f.write(json.dumps(record) + "\n")
    return record


# ---------------------------------------------------------------------------------------------------------------
# gen: target (config + the three tensors the drafter borrows), prepare/dataset, vocab, extract/hidden_states


def target_config(d: dict, shell: bool) -> dict:
    """Kimi-K2.5's text backbone (DeepseekV3 / kimi_k2 shape); with `shell`, inside the kimi_k25 multimodal
    wrapper the real checkpoint has (the drafter's shape is the same either way)."""
    text = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": d["hidden"],
        "intermediate_size": d["intermediate"],
        "moe_intermediate_size": 2048,
        "num_hidden_layers": d["layers"],
        "num_attention_heads": d["heads"],
        "num_key_value_heads": d["kv_heads"],
        "n_routed_experts": 384,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "first_k_dense_replace": 1,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": d["qk_rope"],
        "v_head_dim": 128,
        "vocab_size": d["vocab"],
        "max_position_embeddings": 262144,
        "rope_theta": 50000.0,
        "rope_scaling": {
            "type": "yarn",
            "factor": 64.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "routed_scaling_factor": 2.827,
        "norm_topk_prob": True,
        "n_group": 1,
        "topk_group": 1,
        "bos_token_id": 163584 % d["vocab"],
        "eos_token_id": 163585 % d["vocab"],
        "torch_dtype": "bfloat16",
    }
    if not shell:
        return text
    return {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "text_config": {**text, "model_type": "kimi_k2"},
        "tie_word_embeddings": False,
        "pad_token_id": d["mask"],
        "torch_dtype": "bfloat16",
    }


def write_target(root: Path, d: dict, dev: str) -> tuple[Path, dict, str]:
    """The synthetic target and the facts preflight would hand the train stage, resolved by Eyrie's own
    `resolve_borrowed_weights` (no weights read). Kimi's multimodal shell when the installed transformers knows
    it (as for the real checkpoint), else its DeepseekV3 text backbone."""
    import torch
    from safetensors.torch import save_file

    from eyrie.config import TargetConfig
    from eyrie.target.metadata import read_target_config, resolve_borrowed_weights

    tgt = root / "target"
    g = torch.Generator(device=dev).manual_seed(1)
    H, V = d["hidden"], d["vocab"]
    weights = {
        "model.embed_tokens.weight": (torch.randn(V, H, device=dev, generator=g, dtype=torch.bfloat16) * 0.02).cpu(),
        "lm_head.weight": (torch.randn(V, H, device=dev, generator=g, dtype=torch.bfloat16) * 0.02).cpu(),
        "model.norm.weight": torch.ones(H, dtype=torch.bfloat16),
    }
    last_err = None
    for shell in (True, False):
        shutil.rmtree(tgt, ignore_errors=True)
        tgt.mkdir(parents=True)
        prefix = "language_model." if shell else ""
        (tgt / "config.json").write_text(json.dumps(target_config(d, shell), indent=2) + "\n")
        save_file(
            {prefix + k: v for k, v in weights.items()}, str(tgt / "model.safetensors"), metadata={"format": "pt"}
        )
        target = TargetConfig(model=str(tgt), trust_remote_code=shell)
        try:
            borrowed = resolve_borrowed_weights(target, read_target_config(target))
        except Exception as err:  # noqa: BLE001  (a transformers without kimi_k25: use the text backbone)
            last_err = err
            continue
        facts = {"verifier_weights": borrowed.speculators_names(), "mask_token_id": d["mask"]}
        return tgt, facts, "kimi_k25" if shell else "deepseek_v3"
    raise SystemExit(f"cannot resolve the synthetic target's borrowed tensors: {last_err}")


def cmd_gen(args) -> None:
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np
    import torch
    import yaml
    from safetensors.torch import save_file

    from eyrie.hidden_states.encoding import encode
    from eyrie.stages.prepare import _save_dataset
    from eyrie.stages.vocab import build_vocab

    d = dims(args)
    root = Path(args.root)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.perf_counter()
    root.mkdir(parents=True, exist_ok=True)
    tgt, facts, shape = write_target(root, d, dev)
    t_target = time.perf_counter() - t0

    T, H, L = d["row_tokens"], d["hidden"], len(d["aux"]) + 1
    ids = [
        np.random.default_rng(i % args.distinct).integers(0, d["vocab"], T, dtype=np.int64) for i in range(args.rows)
    ]
    ds_dir = root / "prepare" / "dataset"
    shutil.rmtree(ds_dir, ignore_errors=True)
    _save_dataset(ds_dir, [x.tolist() for x in ids], [[1] * T for _ in ids])
    freq: dict[int, int] = {}
    for x in ids[: args.distinct]:
        for a, b in zip(*(v.tolist() for v in np.unique(x, return_counts=True))):
            freq[a] = freq.get(a, 0) + b
    torch.save(freq, ds_dir / "token_freq.pt")
    build_vocab(ds_dir / "token_freq.pt", d["draft_vocab"], d["vocab"], root / "vocab", key="synthetic")

    # hs_<i>.safetensors as Eyrie's vLLM connector writes them: hidden_states [T, aux + 1, H] bf16, token_ids [T];
    # rows past --distinct link to a distinct file (same bytes on disk, fewer to write)
    hs_dir = root / "extract" / "hidden_states"
    shutil.rmtree(hs_dir, ignore_errors=True)
    hs_dir.mkdir(parents=True)
    g = torch.Generator(device=dev).manual_seed(2)
    pool = [torch.randn(T, L, H, device=dev, generator=g, dtype=torch.bfloat16).cpu() for _ in range(4)]

    def write(i: int) -> None:
        sample = {"hidden_states": pool[i % 4], "token_ids": torch.from_numpy(ids[i])}
        save_file(encode(sample, args.hs_dtype), str(hs_dir / f"hs_{i}.safetensors"))

    with ThreadPoolExecutor(8) as ex:
        list(ex.map(write, range(min(args.distinct, args.rows))))
    for i in range(args.distinct, args.rows):
        (hs_dir / f"hs_{i}.safetensors").symlink_to(f"hs_{i % args.distinct}.safetensors")

    # the Kimi preset on one GPU, pointed at the synthetic target
    preset = yaml.safe_load((REPO / "configs" / "kimi-k2.5-tp8.yaml").read_text())
    preset["target"].update(
        model=str(tgt), revision=None, tensor_parallel_size=1, trust_remote_code=shape != "deepseek_v3"
    )
    preset["data"]["source"] = str(root / "unused.jsonl")
    preset["extraction"]["layer_ids"] = d["aux"]
    preset["extraction"]["hidden_states_dtype"] = args.hs_dtype
    preset["vocab"]["draft_vocab_size"] = d["draft_vocab"]
    preset["train"].update(devices=1, device="cpu" if args.tiny else "cuda", mask_token_id=d["mask"])
    if args.tiny:
        preset["train"]["max_seq_len"] = d["seq"]
    preset.pop("promotion", None)
    (root / "eyrie.yaml").write_text(yaml.safe_dump(preset, sort_keys=False))
    (root / "target_facts.json").write_text(json.dumps(facts, indent=1))
    os.sync()
    geo = draft_geometry(root)
    emit(
        args,
        {
            "what": "gen",
            "target_shape": shape,
            "rows": args.rows,
            "distinct_files": args.distinct,
            "tokens_per_row": T,
            "hidden_states_dtype": args.hs_dtype,
            "bytes_per_token": round((hs_dir / "hs_0.safetensors").stat().st_size / T, 1),
            "target_facts": facts,
            "draft": geo,
            "s_target": round(t_target, 1),
            "s_total": round(time.perf_counter() - t0, 1),
        },
    )


def load(root: Path):
    from eyrie.config import load_config

    return load_config(root / "eyrie.yaml"), json.loads((root / "target_facts.json").read_text())


def draft_geometry(root: Path) -> dict:
    from eyrie.target.drafter import draft_layer_config

    config, _ = load(root)
    c = draft_layer_config(config.target, config.train.num_layers)
    return {
        "hidden": c.hidden_size,
        "heads": c.num_attention_heads,
        "kv_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "intermediate": c.intermediate_size,
        "layers": c.num_hidden_layers,
    }


# ---------------------------------------------------------------------------------------------------------------
# step: the bare model step at the draft geometry Eyrie builds


def sync_probe() -> dict:
    """Does a scalar made on the GPU wait for it? torch.tensor(number, device=cuda) (what speculators' trainer does
    twice a step) against the torch.full that eyrie.stages.train.entry substitutes."""
    import torch

    out = {}
    for name, make in (
        ("torch.tensor", lambda: torch.tensor(1.0, dtype=torch.float32, device="cuda")),
        ("torch.full", lambda: torch.full((), 1.0, dtype=torch.float32, device="cuda")),
    ):
        torch.cuda.set_sync_debug_mode("error")
        try:
            make()
            out[name] = "no sync"
        except RuntimeError:
            out[name] = "synchronises"
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return out


def cmd_step(args) -> dict:
    import torch
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.losses import resolve_loss_config
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.models.eagle3.core import Eagle3DraftModel
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    from eyrie.target.drafter import draft_layer_config

    if args.eyrie_patches:  # eyrie.stages.train.entry's changes to the model's step: no data-dependent syncs
        from eyrie.stages.train.patches import metrics

        metrics._accuracy_without_sync()
        metrics._loss_scalars_without_sync()
    d = dims(args)
    config, _ = load(Path(args.root))
    V, VD, T, TTT = d["vocab"], d["draft_vocab"], config.train.max_seq_len, config.train.ttt_steps
    DOC = d["row_tokens"]
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    tl = draft_layer_config(config.target, config.train.num_layers)
    tl._attn_implementation = args.attn if dev == "cuda" else "sdpa"
    H = tl.hidden_size
    cfg = Eagle3SpeculatorConfig(
        transformer_layer_config=tl,
        draft_vocab_size=VD,
        norm_before_residual=True,
        # what speculators' CLI turns on for eagle3 (the trainer's model); the bare step leaves them off
        norm_before_fc=args.trainer_norms,
        norm_output=args.trainer_norms,
        eagle_aux_hidden_state_layer_ids=d["aux"],
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=TTT)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path="synthetic", architectures=["DeepseekV3ForCausalLM"]),
        ),
    )
    with torch.device(dev):
        model = Eagle3DraftModel(cfg)
    model = model.to(torch.float32 if args.master == "fp32" else torch.bfloat16)
    t2d = torch.zeros(V, dtype=torch.bool)
    ids = torch.randperm(V)[:VD].sort().values
    t2d[ids] = True
    model.load_vocab_mappings(t2d.to(dev), (ids - torch.arange(VD)).to(dev))
    trainable = [p for p in model.parameters() if p.requires_grad]
    fused = dev == "cuda"
    if args.opt == "muon":
        from speculators.train.optimizers import split_named_params_for_muon

        mu, aw = split_named_params_for_muon(model)
        opts = [
            torch.optim.Muon(
                [p for _, p in mu], lr=1e-4, momentum=0.95, weight_decay=0.1, ns_steps=5, adjust_lr_fn="match_rms_adamw"
            ),
            torch.optim.AdamW([p for _, p in aw], lr=1e-4, weight_decay=0.01, fused=fused),
        ]
    else:
        opts = [torch.optim.AdamW(trainable, lr=1e-4, weight_decay=0.01, fused=fused)]
    loss_cfg = resolve_loss_config("kl_div", "eager")
    g = torch.Generator(device=dev).manual_seed(0)
    hs = torch.randn(1, T, 3 * H, device=dev, dtype=torch.bfloat16, generator=g)
    last = torch.randn(1, T, H, device=dev, dtype=torch.bfloat16, generator=g)
    inp = torch.randint(0, V, (1, T), device=dev, generator=g)
    doc = (torch.arange(T, device=dev) // DOC).unsqueeze(0)
    pos = (torch.arange(T, device=dev) % DOC).unsqueeze(0)
    mask = torch.ones(1, T, device=dev, dtype=torch.bool)
    if args.shifted_docs:  # the trainer's packed batch: each row loses a token to the shift, the rest is padding
        n = T // DOC
        doc = torch.cat([torch.full((DOC - 1,), i) for i in range(n)] + [torch.full((T - n * (DOC - 1),), -1)])
        pos = torch.cat([torch.arange(1, DOC) for _ in range(n)] + [torch.zeros(T - n * (DOC - 1), dtype=torch.long)])
        doc, pos = doc.unsqueeze(0).to(dev), pos.unsqueeze(0).to(dev)
        mask = doc != -1
    amp = args.master == "fp32" and dev == "cuda"
    working = None
    if args.bf16_weights and amp:  # eyrie.stages.train.entry's bfloat16 working copies of the float32 weights
        from eyrie.stages.train.patches import working_weights

        working = working_weights._WorkingWeights(model, torch.bfloat16)
    timing = {"fwd": 0.0, "bwd": 0.0, "opt": 0.0}

    def borrow(variant: str) -> None:
        fill_borrowed(model, variant)
        if working is not None:
            working.copied = [False] * len(working.params)  # frozen working copies are made once: again

    def step(profile: bool = False):
        t = time.perf_counter()
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=amp):
            _, loss, _ = model(
                hs,
                inp,
                doc,
                loss_mask=mask,
                position_ids=pos,
                verifier_last_hidden_states=last,
                ttt_steps=TTT,
                loss_config=loss_cfg,
            )
        if profile:
            sync()
            timing["fwd"] += time.perf_counter() - t
            t = time.perf_counter()
        loss.backward()
        if working is not None:
            working.to_master()
        if args.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if profile:
            sync()
            timing["bwd"] += time.perf_counter() - t
            t = time.perf_counter()
        for o in opts:
            o.step()
        for o in opts:
            o.zero_grad(set_to_none=True)
        if profile:
            sync()
            timing["opt"] += time.perf_counter() - t
        return loss.detach()

    variants = (args.verifier_weights or "finite").split(",")
    out = {}
    for variant in variants:
        borrow(variant)
        for k in timing:
            timing[k] = 0.0
        out[variant] = step_variant(args, variant, step, sync, timing, dev)
    rec = None
    for variant in variants:
        shape = dict(tl=tl, T=T, DOC=DOC, TTT=TTT, fused=fused, trainable=trainable, dev=dev, working=working, H=H)
        rec = finish_step_record(args, out[variant], variant, shape)
    return rec


def fill_borrowed(model, variant: str) -> None:
    """The tensors an EAGLE-3 drafter borrows from its target (embedding, both heads). Built bare, speculators
    fills them with NaN until load_verifier_weights reads the target's: every step then computes on NaN (the
    loss, every gradient and, after one AdamW step, every weight), constant bit patterns that draw far less power
    than real numbers, so the GPU holds a higher clock. `finite` puts in what the synthetic target's files hold
    (normal, std 0.02), as the trainer's model has; `nan` keeps speculators' placeholder: the bare step as it was
    measured up to 2026-12-01."""
    import torch

    if variant not in ("finite", "nan"):
        raise SystemExit(f"--verifier-weights: finite or nan, not {variant!r}")
    w0 = model.embed_tokens.weight
    g = torch.Generator(device=w0.device).manual_seed(3)
    with torch.no_grad():
        for w in (model.embed_tokens.weight, model.verifier_lm_head.weight, model.lm_head.weight):
            if variant == "nan":
                w.fill_(float("nan"))
            else:
                w.copy_(torch.randn(w.shape, device=w.device, generator=g) * 0.02)


def step_variant(args, variant: str, step, sync, timing: dict, dev: str) -> dict:
    """Warm-up, the timed steps with the GPU sampled, the synchronised phase pass and (--profile) a
    torch.profiler window with its kernel tables, for one setting of the borrowed tensors."""
    import torch

    tag = args.tag + ("" if variant == "finite" else f"-{variant}")
    t_build = time.perf_counter()
    for _ in range(3):  # the first variant's includes torch.compile
        step()
    sync()
    t_warm = time.perf_counter() - t_build
    if dev == "cuda":
        torch.cuda.reset_peak_memory_stats()
    sampler = GpuSampler()  # clocks and power over the timed steps, as for the trainer's window
    sampler.start()
    t0, w0 = time.perf_counter(), time.time()
    loss = None
    for _ in range(args.iters):
        loss = step()
    sync()
    dt = (time.perf_counter() - t0) / args.iters
    sampler.stop.set()
    gpu = sampler.summary(w0, time.time())
    n_prof = max(1, args.iters // 4)
    for _ in range(n_prof):  # phases, each synchronised (a separate pass so the rate above is unperturbed)
        step(profile=True)
    res = {
        "tag": tag,
        "t_warm": t_warm,
        "dt": dt,
        "gpu": gpu,
        "n_prof": n_prof,
        "phase_ms": {k: round(v / n_prof * 1000, 1) for k, v in timing.items()},
        "loss_finite": bool(torch.isfinite(loss).item()) if loss is not None else None,
        "peak_mem_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 1) if dev == "cuda" else None,
    }
    if args.profile:  # the same analysis as the trainer's profiled window (on a CPU: the plumbing's check)
        n = int(args.profile.split(",")[-1])
        probe = ClockProbe()
        activities = [torch.profiler.ProfilerActivity.CPU]
        with torch.profiler.profile(
            activities=activities + ([torch.profiler.ProfilerActivity.CUDA] if dev == "cuda" else [])
        ) as prof:
            probe.start()
            for _ in range(n):
                step()
            sync()
        clocks = probe.summary()
        trace = Path(args.log_dir) / f"trace_step_{tag or 'step'}.json"
        trace.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace))
        res["profile"] = {"steps": n, **analyse_trace(trace)}
        res["profile"].update(write_profile_tables(prof, trace, n, trace.parent, f"step_{tag or 'step'}", clocks))
        gzip_trace(trace)
    return res


def finish_step_record(args, res: dict, variant: str, scope: dict) -> dict:
    tl, T, DOC, TTT, fused, trainable = (scope[k] for k in ("tl", "T", "DOC", "TTT", "fused", "trainable"))
    dev, working, H = scope["dev"], scope["working"], scope["H"]
    dt, gpu = res["dt"], res["gpu"]
    rec = {
        "what": "step",
        "tag": res["tag"],
        "verifier_weights": variant,
        "loss_finite": res["loss_finite"],
        "draft": {
            "hidden": H,
            "heads": tl.num_attention_heads,
            "kv_heads": tl.num_key_value_heads,
            "head_dim": tl.head_dim,
            "intermediate": tl.intermediate_size,
        },
        "seq": T,
        "doc": DOC,
        "ttt": TTT,
        "attn": tl._attn_implementation,
        "loss_impl": "eager",
        "opt": args.opt + (" (fused AdamW)" if fused else ""),
        "master": args.master,
        "clip": args.clip,
        "trainable_params_M": round(sum(p.numel() for p in trainable) / 1e6, 1),
        "warmup_3_steps_s": round(res["t_warm"], 1),
        "step_ms": round(dt * 1000, 1),
        "tokens_per_s": round(T / dt),
        "phase_ms": res["phase_ms"],
        "peak_mem_GiB": res["peak_mem_GiB"],
    }
    rec["trainer_norms"] = args.trainer_norms
    rec["shifted_docs"] = args.shifted_docs
    rec["eyrie_patches"] = args.eyrie_patches
    rec["bf16_weights"] = working is not None
    rec["gpu"] = gpu
    if gpu and gpu.get("energy_W"):
        rec["joules_per_step"] = round(gpu["energy_W"] * dt, 2)
    if dev == "cuda":
        rec["sync_probe"] = sync_probe()
    if "profile" in res:
        rec["profile"] = res["profile"]
    return emit(args, rec)


def gzip_trace(trace: Path, name: str | None = None) -> None:
    import gzip

    with open(trace, "rb") as f, gzip.open(trace.with_name((name or trace.stem) + ".json.gz"), "wb", 6) as g:
        shutil.copyfileobj(f, g)
    trace.unlink()


# ---------------------------------------------------------------------------------------------------------------
# eyrie: the exact command training_command() builds, as run_training runs it


STEP_RE = re.compile(r"global_step[\"']?\s*[:=]\s*(\d+)")
NUM = r"([-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?)"
MILESTONES = {
    "config resolved": "speculator_type=",
    "model build started": "Loading vocab mappings",
    "trainer built": "Starting fresh training run",
    "epoch started": "Training epoch 1/",
}


class GpuSampler(threading.Thread):
    def __init__(self, period: float = 0.5):
        super().__init__(daemon=True)
        self.period, self.samples, self.stop = period, [], threading.Event()
        self.cpu: list = []
        self.energy: list = []  # (time, mJ since the driver loaded)

    def run(self) -> None:
        q = "utilization.gpu,power.draw,memory.used,clocks.sm"
        while not self.stop.is_set():
            e = gpu_energy_mj()
            if e is not None:
                self.energy.append((time.time(), e))
            try:
                r = subprocess.run(
                    ["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader,nounits"],
                    capture_output=True,
                    text=True,
                    timeout=5,
                )
                self.samples.append((time.time(), [float(x) for x in r.stdout.strip().split("\n")[0].split(",")]))
            except Exception:  # noqa: BLE001  (no nvidia-smi on a CPU check)
                pass
            self.cpu.append((time.time(), cpu_times()))
            self.stop.wait(self.period)

    def summary(self, t0: float, t1: float) -> dict | None:
        s = [v for t, v in self.samples if t0 <= t <= t1]
        if not s:
            return None
        out = {}
        for i, c in enumerate(["util_gpu_pct", "power_W", "mem_used_MiB", "sm_clock_MHz"]):
            xs = sorted(v[i] for v in s)
            out[c] = {"mean": round(sum(xs) / len(xs), 1), "min": xs[0], "max": xs[-1]}
        out["samples"] = len(s)
        c = [v for t, v in self.cpu if t0 <= t <= t1 and v]
        if len(c) >= 2:  # all cores together, from /proc/stat
            out["cpu_busy_frac"] = round((c[-1][0] - c[0][0]) / max(1, c[-1][1] - c[0][1]), 3)
        e = [(t, v) for t, v in self.energy if t0 <= t <= t1]
        if len(e) >= 2 and e[-1][0] > e[0][0]:  # the GPU's own energy counter: mean power, exactly
            out["energy_W"] = round((e[-1][1] - e[0][1]) / 1000 / (e[-1][0] - e[0][0]), 1)
        return out


_NVML: list = []


def gpu_energy_mj() -> float | None:
    """GPU 0's energy counter (millijoules since the driver loaded), through NVML; None where there is none."""
    if not _NVML:
        try:
            import pynvml

            pynvml.nvmlInit()
            _NVML.append((pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)))
        except Exception:  # noqa: BLE001  (no NVML or no GPU: a CPU check)
            _NVML.append(None)
    if _NVML[0] is None:
        return None
    nvml, handle = _NVML[0]
    try:
        return float(nvml.nvmlDeviceGetTotalEnergyConsumption(handle))
    except Exception:  # noqa: BLE001  (a GPU without the counter)
        return None


def cpu_times() -> tuple[int, int] | None:
    """(busy, total) jiffies of all cores, from /proc/stat."""
    try:
        v = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = v[3] + (v[4] if len(v) > 4 else 0)
    return sum(v) - idle, sum(v)


def metric(line: str, key: str) -> float | None:
    m = re.search(re.escape(key) + r"[\"']?\s*[:=]\s*" + NUM, line)
    return float(m.group(1)) if m else None


def eyrie_command(args, root: Path, optimizer: str) -> tuple[list[str], Path, dict]:
    from eyrie.stages.prepare import load_seq_lens
    from eyrie.stages.train.trainer import steps_per_epoch, training_command
    from eyrie.stages.vocab import mapping_paths

    config, facts = load(root)
    config = config.model_copy(update={"train": config.train.model_copy(update={"optimizer": optimizer})})
    device = "cpu" if args.tiny else "cuda"
    # the same checkpoint frequency run_training passes (one GPU)
    spe = steps_per_epoch(load_seq_lens(root / "prepare"), config.train.max_seq_len, 1 - config.train.val_fraction)
    every = config.train.save_every_steps
    freq = 1.0 if not every or every >= spe else max(every / spe, 1 / spe)
    d2t, t2d = mapping_paths(root / "vocab", config.vocab.draft_vocab_size)
    save_path = root / "train" / f"bench-{optimizer}" / "checkpoints"
    if not args.keep_checkpoints:  # a fresh start (a kept folder would resume); the compile cache beside it stays
        shutil.rmtree(save_path.parent, ignore_errors=True)
    cmd = training_command(
        config,
        root / "prepare" / "dataset",
        root / "extract" / "hidden_states",
        d2t,
        t2d,
        list(config.extraction.layer_ids),
        facts,
        save_path,
        freq,
        device,
    )
    return (
        cmd,
        save_path,
        {
            "device": device,
            "steps_per_epoch": spe,
            "checkpoint_freq": freq,
            "log_every_steps": config.train.log_every_steps,
            "optimizer": optimizer,
        },
    )


BENCH_MARK = "eyrie-bench"  # "<BENCH_MARK> <name> <unix time>" and "<BENCH_MARK>-json {...}" lines in the trainer log


def _mark(name: str) -> None:
    print(f"{BENCH_MARK} {name} {time.time():.3f}", flush=True)


def _memory_loaders(
    *,
    data_path,
    total_seq_len,
    hidden_states_dtype,
    hidden_size,
    num_target_layers,
    preprocess,
    train_data_ratio=0.9,
    **_,
):
    """speculators' loaders replaced by one collated, pinned batch served from memory (same model, optimizer,
    trainer loop and host-to-device copy): the trainer without its loader."""
    import math

    import torch
    from datasets import load_from_disk
    from speculators.train.data import CollateFn

    from eyrie.stages.train.patches import feed, switches

    class MemoryLoader:
        batch_sampler = None

        def __init__(self, batch: dict, n: int):
            self.batch, self.n = batch, n

        def __len__(self) -> int:
            return self.n

        def __iter__(self):
            batches = (dict(self.batch) for _ in range(self.n))
            if (
                switches.GPU_FEED and torch.cuda.is_available()
            ):  # as eyrie.stages.train.entry feeds speculators' loaders
                return feed._copied_ahead(batches, torch.device("cuda", 0))
            return batches

    ds = load_from_disk(data_path).with_format(None)
    lens = list(ds["seq_len"])
    g = torch.Generator().manual_seed(0)
    samples, used, i = [], 0, 0
    while used < total_seq_len:
        t = lens[i % len(lens)]
        hs = torch.randn(t, num_target_layers + 1, hidden_size, generator=g).to(hidden_states_dtype)
        samples.append(
            {
                "hidden_states": hs[:, :-1].flatten(1),
                "input_ids": torch.tensor(ds[i]["input_ids"]),
                "verifier_last_hidden_states": hs[:, -1],
                "loss_mask": torch.tensor(ds[i]["loss_mask"]),
                "lengths": torch.tensor([t]),
                "position_ids": torch.arange(t),
            }
        )
        used += t
        i += 1
    batch = CollateFn(
        total_seq_len,
        hidden_size,
        num_target_layers=num_target_layers,
        dtype=hidden_states_dtype,
        preprocess=preprocess,
    )(samples)
    if torch.cuda.is_available():
        batch = {k: v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    n_train = int(len(lens) * train_data_ratio)
    steps = max(1, math.ceil(sum(min(x, total_seq_len) for x in lens[:n_train]) / total_seq_len))
    return MemoryLoader(batch, steps), MemoryLoader(batch, 2)


def _bench_entry(argv: list[str]) -> None:
    """Eyrie's train entry (`eyrie.stages.train.entry.main`, the same argv) with measuring hooks that change nothing it
    does: marks of where start-up time goes, the time the training thread waits for each batch, host time per step
    and, with `profile`, a torch.profiler window over a few steps, analysed (`analyse_trace`) and written beside
    the log. Options come as JSON in EYRIE_BENCH: inmem (the loaders replaced by `_memory_loaders`), profile
    ([first step, steps]), off (eyrie.stages.train.entry switches turned off), out (folder for the trace and
    summary)."""
    opts = json.loads(os.environ.pop("EYRIE_BENCH", "{}"))
    _mark("entry")
    import eyrie.stages.train.entry as entry  # light: its imports come inside main()
    from eyrie.stages.train.patches import switches, workers

    for name in opts.get("off", []):
        assert isinstance(getattr(switches, name), bool), name
        setattr(switches, name, False)
    if switches.FORKSERVER_WORKERS and os.environ.get("EYRIE_TRAIN_DEVICE") != "cpu":
        workers._start_worker_server()  # where main() starts it, before the heavy imports (again there: a no-op)
    if os.environ.get("EYRIE_TRAIN_DEVICE") != "cpu":
        # as main() does before its imports: importing speculators sets TORCHINDUCTOR_CACHE_DIR to /tmp's default
        # when it is unset, and main()'s own call after the imports below would then leave it there
        entry._compile_cache_beside(entry._option(argv, "--save-path"))
    import torch

    _mark("torch imported")
    from speculators.models.eagle3.core import Eagle3DraftModel
    from speculators.train import cli, trainer

    _mark("speculators imported")
    if opts.get("inmem"):
        cli.create_train_val_loaders = _memory_loaders

    def timed(owner, attr: str, name: str) -> None:
        fn = getattr(owner, attr)

        def wrapper(*a, **k):
            _mark(name + " start")
            try:
                return fn(*a, **k)
            finally:
                _mark(name + " end")

        setattr(owner, attr, wrapper)

    timed(cli, "parse_vocab_mappings", "vocab")
    timed(cli, "build_draft_model", "build")  # inside eyrie's wrappers (GPU device, float32), which main() adds
    timed(Eagle3DraftModel, "load_verifier_weights", "verifier weights")
    timed(cli, "create_train_val_loaders", "loaders")
    timed(trainer.Trainer, "__init__", "trainer init")
    cuda = torch.cuda.is_available()
    profile = opts.get("profile")
    out = Path(opts.get("out") or ".")
    stats = {"wait_s": 0.0, "batches": 0}

    class TimedLoader:
        """The train loader as the loop sees it, timing each wait for the next batch."""

        def __init__(self, loader):
            self._loader = loader

        def __getattr__(self, name):
            return getattr(self._loader, name)

        def __len__(self) -> int:
            return len(self._loader)

        def __iter__(self):
            it = iter(self._loader)
            while True:
                t = time.perf_counter()
                with torch.profiler.record_function("eyrie-bench.next_batch"):
                    try:
                        batch = next(it)
                    except StopIteration:
                        return
                stats["wait_s"] += time.perf_counter() - t
                stats["batches"] += 1
                if stats["batches"] == 1:
                    _mark("first batch")
                yield batch

    train_epoch = trainer.Trainer.train_epoch
    probe: list = []

    gc_pause = {"n": [0, 0, 0], "s": [0.0, 0.0, 0.0], "t": 0.0}

    def on_gc(phase: str, info: dict) -> None:  # the collector's pauses, by generation
        if phase == "start":
            gc_pause["t"] = time.perf_counter()
        else:
            gc_pause["n"][info["generation"]] += 1
            gc_pause["s"][info["generation"]] += time.perf_counter() - gc_pause["t"]

    import gc

    gc.callbacks.append(on_gc)

    def train_epoch_measured(self, epoch, *args, step_callback=None, **kwargs):
        prof = None
        last = {"t": time.perf_counter(), "step": self.global_step, "wait": 0.0, "gc": [0, 0.0]}

        def after_step() -> None:
            nonlocal prof
            if step_callback is not None:  # eyrie.stages.train.entry's own, outside this one
                step_callback()
            n = self.global_step
            if n == 1:
                if cuda:
                    torch.cuda.synchronize()
                _mark("first step done")
                print(f"{BENCH_MARK}-json " + json.dumps({"compile": compile_summary()}), flush=True)
            if profile and n == profile[0] and cuda:
                prof = torch.profiler.profile(
                    activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
                )
                prof.start()
                probe[:] = [ClockProbe()]
                probe[0].start()
            if prof is not None and n == profile[0] + profile[1]:
                prof.stop()
                clocks = probe[0].summary()
                trace = out / f"trace_{os.getpid()}.json"
                prof.export_chrome_trace(str(trace))
                summary = {"steps": profile[1], "first_step": profile[0], **analyse_trace(trace)}
                name = opts.get("name") or f"trainer_{os.getpid()}"
                summary.update(write_profile_tables(prof, trace, profile[1], out, name, clocks))
                prof = None
                print(f"{BENCH_MARK}-json " + json.dumps({"profile": summary}), flush=True)
                last.update(
                    t=time.perf_counter(), step=n, wait=stats["wait_s"], gc=[gc_pause["n"][2], sum(gc_pause["s"])]
                )
            if n % 25 == 0 and n > last["step"]:
                dt = time.perf_counter() - last["t"]
                feed = {
                    "step": n,
                    "host_ms_per_step": round(dt * 1000 / (n - last["step"]), 1),
                    "loader_wait_ms_per_step": round((stats["wait_s"] - last["wait"]) * 1000 / (n - last["step"]), 1),
                    "gc_gen2_passes": gc_pause["n"][2] - last["gc"][0],
                    "gc_pause_ms": round((sum(gc_pause["s"]) - last["gc"][1]) * 1000, 1),
                }
                print(f"{BENCH_MARK}-json " + json.dumps({"feed": feed}), flush=True)
                last.update(
                    t=time.perf_counter(), step=n, wait=stats["wait_s"], gc=[gc_pause["n"][2], sum(gc_pause["s"])]
                )

        loader = self.train_loader
        self.train_loader = TimedLoader(loader)
        try:
            return train_epoch(self, epoch, *args, step_callback=after_step, **kwargs)
        finally:
            self.train_loader = loader

    trainer.Trainer.train_epoch = train_epoch_measured
    entry.main(argv)


def kernel_kind(name: str, cat: str) -> str:
    n = name.lower()
    if cat != "kernel":
        return cat + (" HtoD" if "htod" in n else " DtoH" if "dtoh" in n else " DtoD" if "dtod" in n else "")
    for k, pats in (
        ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "sm90")),
        ("flex attention", ("flex", "triton_tem")),
        ("fused adam", ("fused_adam", "fusedadam")),
        ("foreach (clip, zero)", ("multi_tensor", "foreach")),
        ("triton fused", ("triton",)),
    ):
        if any(x in n for x in pats):
            return k
    return "other"


GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def family(name: str) -> str:
    """A kernel's name less what differs between two compilations of the same code: Inductor numbers its kernels
    per graph (triton_tem_fused_flex_attention_3 in one, _4 in another)."""
    return re.sub(r"_\d+$", "", name) if name.startswith("triton_") else name


class ClockProbe(threading.Thread):
    """GPU 0's SM clock, sampled every 20 ms through NVML, and its energy counter at the start and the end: what
    the GPU ran at while a profiled window ran (kernel times scale with the clock)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.stop, self.clocks, self.t0, self.e0 = threading.Event(), [], time.time(), gpu_energy_mj()

    def run(self) -> None:
        while not self.stop.is_set() and _NVML and _NVML[0] is not None:
            nvml, handle = _NVML[0]
            try:
                self.clocks.append(nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM))
            except Exception:  # noqa: BLE001
                return
            self.stop.wait(0.02)

    def summary(self) -> dict:
        self.stop.set()
        out: dict = {"sm_clock_MHz": round(sum(self.clocks) / len(self.clocks)) if self.clocks else None}
        e1, dt = gpu_energy_mj(), time.time() - self.t0
        if self.e0 is not None and e1 is not None and dt > 0:
            out["energy_W"] = round((e1 - self.e0) / 1000 / dt, 1)
        return out


def kernel_table(trace: Path, steps: int) -> dict:
    """Every GPU kernel, copy and memset of a profiled window by full name: launches and milliseconds per step."""
    events = json.loads(trace.read_text()).get("traceEvents", [])
    rows: dict[str, list] = {}
    for e in events:
        if e.get("ph") == "X" and "dur" in e and e.get("cat") in GPU_CATS:
            row = rows.setdefault(e.get("name", "?"), [kernel_kind(e.get("name", ""), e["cat"]), 0, 0.0])
            row[1] += 1
            row[2] += float(e["dur"]) / 1000
    table = sorted(([n, k, c / steps, ms / steps] for n, (k, c, ms) in rows.items()), key=lambda r: -r[3])
    return {
        "steps": steps,
        "gpu_ms_per_step": round(sum(r[3] for r in table), 3),
        "rows": [[n, k, round(c, 2), round(ms, 4)] for n, k, c, ms in table],
    }


def key_averages_table(prof) -> str:
    """torch.profiler's own table of the window, by GPU time (the sort key's name differs between versions)."""
    averages = prof.key_averages()
    for key in ("self_device_time_total", "self_cuda_time_total", "device_time_total", "cuda_time_total"):
        try:
            return averages.table(sort_by=key, row_limit=120, max_name_column_width=110)
        except (AttributeError, KeyError, ValueError):
            continue
    return averages.table(row_limit=120)


def write_profile_tables(prof, trace: Path, steps: int, out_dir: Path, name: str, clocks: dict) -> dict:
    """kernels_<name>.json (kernel_table, with the window's clock and power) and keyavg_<name>.txt (key_averages)
    in out_dir: what `compare` reads. Returns the window's totals."""
    table = {"name": name, "clocks": clocks, **kernel_table(trace, steps)}
    (out_dir / f"kernels_{name}.json").write_text(json.dumps(table, indent=0) + "\n")
    try:
        (out_dir / f"keyavg_{name}.txt").write_text(key_averages_table(prof) + "\n")
    except Exception as err:  # noqa: BLE001  (the kernel table above is the comparison's input anyway)
        (out_dir / f"keyavg_{name}.txt").write_text(f"key_averages failed: {err}\n")
    return {"tables": f"kernels_{name}.json", "gpu_ms_per_step": table["gpu_ms_per_step"], "clocks": clocks}


def compare_tables(a: dict, b: dict, top: int = 40) -> tuple[dict, str]:
    """Kernel by kernel, b against a, per step: by kind, by family (Inductor's numbering removed) and by name.
    With both windows' SM clocks known, b's time is also given at a's clock (times scaled by clock_b / clock_a,
    right for kernels bound by the clock, such as matrix products), which separates more work from a slower GPU."""
    ca, cb = (a.get("clocks") or {}).get("sm_clock_MHz"), (b.get("clocks") or {}).get("sm_clock_MHz")
    scale = cb / ca if ca and cb else None

    def group(t: dict, key) -> dict:
        out: dict = {}
        for n, k, c, ms in t["rows"]:
            g = out.setdefault(key(n, k), [0.0, 0.0])
            g[0] += c
            g[1] += ms
        return out

    sections = {}
    lines = [
        f"{b['name']} against {a['name']}, per step: GPU time {b['gpu_ms_per_step']:.2f}"
        f" vs {a['gpu_ms_per_step']:.2f} ms"
        f" (SM clock {cb} vs {ca} MHz; energy {b.get('clocks', {}).get('energy_W')} vs"
        f" {a.get('clocks', {}).get('energy_W')} W)"
    ]
    if scale:
        lines.append(f"{b['name']} at {a['name']}'s clock: {b['gpu_ms_per_step'] * scale:.2f} ms")
    for title, key, limit in (
        ("kind", lambda n, k: k, None),
        ("family", lambda n, k: family(n)[:100], top),
        ("name", lambda n, k: n[:100], top),
    ):
        ga, gb = group(a, key), group(b, key)
        rows = []
        for k in set(ga) | set(gb):
            (na, ma), (nb, mb) = ga.get(k, [0.0, 0.0]), gb.get(k, [0.0, 0.0])
            rows.append([k, round(na, 2), round(nb, 2), round(ma, 3), round(mb, 3), round(mb - ma, 3)])
            if scale:
                rows[-1].append(round(mb * scale - ma, 3))
        rows.sort(key=lambda r: -abs(r[5]))
        sections[title] = rows[:limit] if limit else rows
        head = f"{'by ' + title:<102} {'n/step a':>9} {'b':>7} {'ms a':>8} {'ms b':>8} {'b-a':>8}"
        lines += ["", head + (f" {'b@a-clk-a':>9}" if scale else "")]
        for r in sections[title]:
            lines.append(
                f"{r[0]:<102} {r[1]:>9} {r[2]:>7} {r[3]:>8.3f} {r[4]:>8.3f} {r[5]:>8.3f}"
                + (f" {r[6]:>9.3f}" if scale else "")
            )
    return {"a": a["name"], "b": b["name"], "clock_scale_b_to_a": scale, **sections}, "\n".join(lines)


def cmd_compare(args) -> dict:
    a, b = (json.loads(Path(x).read_text()) for x in args.compare)
    record, text = compare_tables(a, b)
    print(text, flush=True)
    if args.log_dir:
        Path(args.log_dir).mkdir(parents=True, exist_ok=True)
        (Path(args.log_dir) / f"compare_{b['name']}_vs_{a['name']}.txt").write_text(text + "\n")
    return emit(args, {"what": "compare", **record})


def compile_summary() -> dict:
    """Where torch.compile's time went up to now (dynamo's per-phase totals), how many graphs it made and why it
    broke them, and Inductor's cache counters: read after the first step, whose wait is mostly compiling."""
    out: dict = {}
    try:
        from torch._dynamo.utils import compile_times, counters

        out["compile_times"] = compile_times(repr="str", aggregate=True)
        out["stats"] = dict(counters["stats"])
        out["graph_breaks"] = dict(counters["graph_break"].most_common(12))
        out["inductor"] = {k: v for k, v in counters["inductor"].items() if "cache" in k or "compile" in k}
        out["aot_autograd"] = dict(counters["aot_autograd"])
        from torch._dynamo import utils as dynamo_utils

        frames = []  # each compiled frame: its compile time and its slowest Triton kernels to compile
        for m in list(getattr(dynamo_utils, "_compilation_metrics", [])):
            kernels = getattr(m, "triton_kernel_compile_times_us", None)
            frames.append(
                [
                    getattr(m, "co_name", None),
                    getattr(m, "entire_frame_compile_time_s", None),
                    getattr(m, "backend_compile_time_s", None),
                    json.loads(kernels)[:6] if isinstance(kernels, str) else kernels,
                ]
            )
        out["frames"] = frames
    except Exception as err:  # noqa: BLE001  (another torch's internals: the marks still say when)
        out["error"] = repr(err)
    return out


def analyse_trace(path: Path, gap_ms: float = 0.3) -> dict:
    """Where a torch.profiler window's time went on the GPU: the span from the first to the last GPU activity,
    the time some kernel or copy ran (busy), kernel time by kind, the largest kernels, and the GPU's idle gaps with
    what the training thread was doing on the host meanwhile (the ops that overlap each gap most)."""
    events = json.loads(path.read_text()).get("traceEvents", [])
    xs = [e for e in events if e.get("ph") == "X" and "dur" in e]
    gpu = sorted(
        (float(e["ts"]), float(e["ts"]) + float(e["dur"]), e)
        for e in xs
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    )
    if not gpu:
        return {"error": "no GPU activity in the trace"}
    busy, gaps = 0.0, []
    cur_s, cur_e = gpu[0][0], gpu[0][1]
    for s, e, _ in gpu[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            gaps.append((cur_e, s))
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    span = max(e for _, e, _ in gpu) - gpu[0][0]

    by_kind: dict[str, float] = {}
    by_name: dict[str, list] = {}
    streams: dict[str, float] = {}
    for s, e, ev in gpu:
        k = kernel_kind(ev.get("name", ""), ev["cat"])
        by_kind[k] = by_kind.get(k, 0.0) + (e - s)
        row = by_name.setdefault(ev.get("name", "?")[:90], [0, 0.0])
        row[0] += 1
        row[1] += e - s
        sid = str(ev.get("args", {}).get("stream", ev.get("tid")))
        streams[sid] = streams.get(sid, 0.0) + (e - s)
    host = [e for e in xs if e.get("cat") in ("cpu_op", "user_annotation", "cuda_runtime", "cuda_driver")]
    per_tid: dict = {}  # the training thread: the one that launches the most kernels
    for e in host:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "aunch" in e.get("name", ""):
            per_tid[e.get("tid")] = per_tid.get(e.get("tid"), 0) + 1
    main_tid = max(per_tid, key=lambda t: per_tid[t]) if per_tid else None
    main = [e for e in host if e.get("tid") == main_tid]
    sync_names = ("Synchronize", "cudaMemcpy ", "cudaMalloc", "cudaFree", "cudaHostAlloc", "cudaHostRegister")
    syncs: dict[str, list] = {}
    for e in host:
        name = e.get("name", "")
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and (
            any(x in name for x in sync_names) or name == "cudaMemcpy"
        ):
            row = syncs.setdefault(f"{name} (tid {e.get('tid')})", [0, 0.0])
            row[0] += 1
            row[1] += float(e["dur"])
    big = sorted((g for g in gaps if (g[1] - g[0]) / 1000 >= gap_ms), key=lambda g: g[0] - g[1])
    gap_rows = []
    for g0, g1 in big[:15]:
        overlap: dict[str, float] = {}
        for e in main:
            s, t = float(e["ts"]), float(e["ts"]) + float(e["dur"])
            o = min(t, g1) - max(s, g0)
            if o > 0:
                overlap[e.get("name", "?")[:70]] = overlap.get(e.get("name", "?")[:70], 0.0) + o
        gap_rows.append(
            {
                "at_ms": round((g0 - gpu[0][0]) / 1000, 2),
                "ms": round((g1 - g0) / 1000, 2),
                "host_ops": {k: round(v / 1000, 2) for k, v in sorted(overlap.items(), key=lambda kv: -kv[1])[:4]},
            }
        )
    ms = lambda us: round(us / 1000, 2)  # noqa: E731
    return {
        "span_ms": ms(span),
        "busy_ms": ms(busy),
        "busy_frac": round(busy / span, 3) if span else None,
        "idle_gaps": {
            f">={gap_ms}ms": [
                sum(1 for g in gaps if (g[1] - g[0]) / 1000 >= gap_ms),
                ms(sum(g[1] - g[0] for g in gaps if (g[1] - g[0]) / 1000 >= gap_ms)),
            ],
            "all": [len(gaps), ms(sum(g[1] - g[0] for g in gaps))],
        },
        "gpu_ms_by_kind": {k: ms(v) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "gpu_ms_by_stream": {k: ms(v) for k, v in streams.items()},
        "training_thread": main_tid,
        "top_kernels": [[n, c, ms(t)] for n, (c, t) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:25]],
        "host_sync_calls": {k: [c, ms(t)] for k, (c, t) in sorted(syncs.items(), key=lambda kv: -kv[1][1])[:12]},
        "largest_gaps": gap_rows,
    }


def cmd_loader(args) -> dict:
    """speculators' train loader exactly as Eyrie's command configures it (workers, prefetch, pinned memory, with
    eyrie.stages.train.entry's GPU patches unless --off), drained with no model: the batches per second that reading the
    files, collating and (with GPU_FEED) the copy to the GPU can deliver on their own."""
    import argparse

    import torch
    from hs_connectors import HiddenStatesBackend
    from speculators.models.eagle3.data import shift_batch
    from speculators.train import dataloader
    from speculators.train.config import TrainConfig

    from eyrie.stages.train.patches import gpu, switches

    d = dims(args)
    cmd, _, _ = eyrie_command(args, Path(args.root), args.optimizer)
    argv = cmd[cmd.index("eyrie.stages.train.entry") + 1 :]
    i = argv.index("--eyrie-verifier-weights")
    a = argparse.Namespace(**TrainConfig.resolve(argv[:i] + argv[i + 2 :]).flatten())
    for name in args.off:
        setattr(switches, name, False)
    cuda = torch.cuda.is_available()
    if cuda:
        gpu._gpu_speedups()
    transfer = HiddenStatesBackend.registry[a.hidden_states_backend].from_train_args(a, a.data_path)
    t0 = time.perf_counter()
    train, _ = dataloader.create_train_val_loaders(
        data_path=a.data_path,
        total_seq_len=a.total_seq_len,
        hidden_states_dtype=getattr(torch, a.hidden_states_dtype),
        transfer=transfer,
        vllm_endpoint=a.vllm_endpoint,
        on_missing=a.on_missing,
        verifier_name_or_path=a.verifier_name_or_path,
        request_timeout=a.request_timeout,
        max_retries=a.max_retries,
        generation_validation_retries=a.generation_validation_retries,
        max_consecutive_generation_failures=a.max_consecutive_generation_failures,
        hidden_size=d["hidden"],
        num_target_layers=len(d["aux"]),
        num_workers=a.num_workers,
        prefetch_factor=a.prefetch_factor,
        preprocess=shift_batch,
        train_data_ratio=a.train_data_ratio,
        seed=a.seed,
    )
    sampler = GpuSampler()
    sampler.start()
    skip, n, tokens, t_first, t_start = 8, 0, 0, None, 0.0
    for batch in train:
        n += 1
        if n == 1:
            t_first = time.perf_counter() - t0
        if n == skip:
            if cuda:
                torch.cuda.synchronize()
            t_start, w0 = time.perf_counter(), time.time()
        elif n > skip:
            tokens += int((batch["document_ids"] != -1).sum())
        if n >= skip + args.loader_batches:
            break
    if cuda:
        torch.cuda.synchronize()
    dt = time.perf_counter() - t_start
    sampler.stop.set()
    del train
    return emit(
        args,
        {
            "what": "loader",
            "tag": args.tag,
            "workers": a.num_workers,
            "prefetch_factor": a.prefetch_factor,
            "off": args.off,
            "s_to_first_batch": round(t_first or 0.0, 1),
            "batches": n - skip,
            "batches_per_s": round((n - skip) / dt, 2),
            "tokens_per_s": round(tokens / dt),
            "host": sampler.summary(w0, time.time()),
        },
    )


def cmd_eyrie(args, optimizer: str | None = None) -> dict:
    optimizer = optimizer or args.optimizer
    root = Path(args.root)
    cmd, save_path, info = eyrie_command(args, root, optimizer)
    env = dict(os.environ, EYRIE_TRAIN_DEVICE=info["device"], PYTHONUNBUFFERED="1", COLUMNS="2000")
    if not args.exact:  # the same argv through eyrie.stages.train.entry.main, with _bench_entry's measuring hooks
        i = cmd.index("eyrie.stages.train.entry")
        cmd = [cmd[0], str(Path(__file__).resolve()), "_bench_entry", *cmd[i + 1 :]]
        bench = {
            "inmem": args.inmem,
            "off": args.off,
            "out": str(Path(args.log_dir).resolve()),
            "name": f"eyrie_{optimizer}{'_' + args.tag if args.tag else ''}",
        }
        if args.profile:
            bench["profile"] = [int(x) for x in args.profile.split(",")]
        env["EYRIE_BENCH"] = json.dumps(bench)
        info["hooks"] = bench
    if args.inmem:
        info["loader"] = "one pinned batch from memory (speculators' loaders replaced)"
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)  # eyrie.stages.train.entry's default: <run>/train/compile-cache
    compile_cache = root / "train" / "compile-cache"
    cache_files_before = sum(1 for _ in compile_cache.rglob("*")) if compile_cache.exists() else 0
    log_path = Path(args.log_dir) / f"train_{optimizer}{'_' + args.tag if args.tag else ''}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    sampler = GpuSampler()
    sampler.start()
    t_start = time.time()
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
        bufsize=1,
        text=True,
        errors="replace",
    )
    with open(PIDS, "a") as f:  # the shell wrapper kills these process groups if anything is left behind
        f.write(f"{proc.pid}\n")

    def on_term(signum, frame):  # `timeout` stops this driver: take the trainer (its own session) down too
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        finally:
            raise SystemExit(f"stopped by signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    lines: queue.Queue = queue.Queue()

    def reader() -> None:
        for ln in proc.stdout:
            lines.put((time.time(), ln))
        lines.put((time.time(), None))

    threading.Thread(target=reader, daemon=True).start()
    steps: list[tuple[float, int, float | None]] = []  # (arrival, global_step, real tokens in that step)
    marks: dict[str, float] = {}
    bench_marks: dict[str, float] = {}
    bench_json: dict[str, list] = {}
    window_start = None
    deadline = t_start + args.startup_s
    with open(log_path, "w") as log:
        log.write("===== " + " ".join(cmd) + "\n")
        while time.time() < deadline:
            try:
                now, line = lines.get(timeout=1.0)
            except queue.Empty:
                continue
            if line is None:
                break
            log.write(line)
            for name, text in MILESTONES.items():
                if name not in marks and text in line:
                    marks[name] = round(now - t_start, 1)
            if line.startswith(BENCH_MARK + " "):  # _bench_entry's marks carry their own clock
                name, _, at = line[len(BENCH_MARK) + 1 :].strip().rpartition(" ")
                bench_marks.setdefault(name, round(float(at) - t_start, 1))
            elif line.startswith(BENCH_MARK + "-json "):
                for k, v in json.loads(line.split(" ", 1)[1]).items():
                    bench_json.setdefault(k, []).append(v)
            m = STEP_RE.search(line)
            if m and "profile" in line:
                tps, ms = metric(line, "tokens_per_s"), metric(line, "step_ms")
                steps.append((now, int(m.group(1)), tps * ms / 1000 if tps is not None and ms else None))
                if window_start is None and int(m.group(1)) >= args.warmup_steps:
                    window_start = now
                    deadline = now + args.window_s
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        time.sleep(1.0)
        while True:
            try:
                _, line = lines.get_nowait()
            except queue.Empty:
                break
            if line:
                log.write(line)
    proc.wait()
    sampler.stop.set()
    for trace in Path(args.log_dir).glob(f"trace_{proc.pid}.json"):
        gzip_trace(trace, f"trace_{optimizer}{'_' + args.tag if args.tag else ''}")
    out = {
        "what": "eyrie",
        "tag": args.tag,
        **info,
        "cmd": cmd,
        "log": str(log_path),
        "compile_cache_files_before": cache_files_before,
        "startup_milestones_s": marks,
        "startup_marks_s": bench_marks,
        "logged_steps": len(steps),
        **{k: v if k == "feed" else v[-1] for k, v in bench_json.items()},
    }
    try:  # every setting as speculators resolves the argv train_entry hands it
        from speculators.train.config import TrainConfig

        argv = cmd[cmd.index("eyrie.stages.train.entry" if args.exact else "_bench_entry") + 1 :]
        i = argv.index("--eyrie-verifier-weights")
        flat = TrainConfig.resolve(argv[:i] + argv[i + 2 :]).flatten()
        out["resolved"] = {
            k: flat.get(k)
            for k in (
                "optimizer",
                "lr",
                "muon_lr",
                "log_freq",
                "draft_attn_impl",
                "loss_implementation",
                "num_workers",
                "prefetch_factor",
                "hidden_states_dtype",
                "hidden_states_backend",
                "total_seq_len",
                "ttt_steps",
            )
        }
    except Exception as err:  # noqa: BLE001
        out["resolved"] = f"could not resolve: {err}"
    if steps:
        out["first_step_s"] = round(steps[0][0] - t_start, 1)
    win = [s for s in steps if window_start is not None and s[0] >= window_start]
    if len(win) >= 2:
        (t0, s0, _), (t1, s1, _) = win[0], win[-1]
        toks = [x for _, _, x in win if x]
        tok_step = sum(toks) / len(toks) if toks else float("nan")
        out["window"] = {
            "steps": s1 - s0,
            "s": round(t1 - t0, 2),
            "tokens_per_step": round(tok_step, 1),
            "steps_per_s": round((s1 - s0) / (t1 - t0), 3),
            "tokens_per_s": round((s1 - s0) * tok_step / (t1 - t0)),
            "gpu": sampler.summary(t0, t1),
        }
        out["tokens_per_s"] = out["window"]["tokens_per_s"]
    else:
        out["error_tail"] = log_path.read_text(errors="replace").splitlines()[-30:]
    return emit(args, out)


# ---------------------------------------------------------------------------------------------------------------
# ab: optimizer A/B on a carried Eyrie run folder (validation accuracy per position against wall-clock)


def cmd_ab(args) -> None:
    from eyrie.config import load_config
    from eyrie.stages.prepare import load_seq_lens
    from eyrie.stages.train.trainer import run_training
    from eyrie.stages.vocab import mapping_paths

    run = Path(args.ab_run).resolve()
    base = load_config(Path(args.ab_config))
    report = json.loads((run / "preflight.json").read_text())  # what the pipeline hands the train stage
    facts, aux = report["target_facts"], report["aux_layer_ids"]
    d2t, t2d = mapping_paths(run / "vocab", base.vocab.draft_vocab_size)
    warm = Path(args.ab_warm_start).resolve() if args.ab_warm_start else None
    lrs = [float(x) for x in args.ab_lr.split(",")] if args.ab_lr else [None]
    for opt, lr in ((o, r) for o in args.optimizers.split(",") for r in lrs):
        train = base.train.model_copy(
            update={
                "optimizer": opt,
                "epochs": args.ab_epochs,
                "device": args.ab_device,
                **({"lr": lr} if lr else {}),
            }
        )
        config = base.model_copy(
            update={
                "train": train,
                "target": base.target.model_copy(update={"model": str(Path(args.ab_target).resolve())}),
                # a warm start at exactly the rate asked for (the pipeline scales train.lr down for one)
                "promotion": base.promotion.model_copy(update={"warm_start_lr_scale": 1.0}),
            }
        )
        out = Path(args.root) / "ab" / (opt if len(lrs) == 1 else f"{opt}-{lr}")
        shutil.rmtree(out, ignore_errors=True)
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        os.environ["COLUMNS"] = "2000"  # one log line per record
        t0 = time.time()
        manifest = run_training(
            config,
            out,
            "k",
            run / "prepare" / "dataset",
            run / "extract" / "hidden_states",
            d2t,
            t2d,
            aux,
            facts,
            load_seq_lens(run / "prepare"),
            warm_start=warm,
            log=lambda m: None,
        )
        wall = time.time() - t0
        # speculators keeps val_metrics.json only for epochs that improved the validation loss; its log has
        # every epoch's. Seconds: from run_training's call to the epoch's checkpoint.
        log = (out / "k" / "train.log").read_text(errors="replace")
        vals = [
            dict((k, float(v)) for k, v in re.findall(r"val/(\w+?)_epoch=" + NUM, block))
            for block in re.split(r"Validation epoch \d+/\d+ started", log)[1:]
        ]
        start = t0
        rows = []
        for h in manifest["history"]:
            ck = out / "k" / "checkpoints" / str(h["epoch"]) / "model.safetensors"
            v = vals[h["epoch"]] if h["epoch"] < len(vals) else {}
            rows.append(
                {
                    "epoch": h["epoch"],
                    "s": round(ck.stat().st_mtime - start, 1),
                    "loss": v.get("loss"),
                    **{k: round(x, 4) for k, x in v.items() if k.startswith("full_acc")},
                }
            )
        emit(
            args,
            {
                "what": "ab",
                "optimizer": opt,
                "lr": train.lr,
                "warm_start": str(warm) if warm else None,
                "device": manifest["device"],
                "epochs": args.ab_epochs,
                "wall_s": round(wall, 1),
                "global_step": manifest["global_step"],
                "epochs_table": rows,
            },
        )


# ---------------------------------------------------------------------------------------------------------------


def cmd_all(args) -> None:
    root = Path(args.root)
    if not (root / "eyrie.yaml").exists() or args.regen:
        cmd_gen(args)
    # the bare step in its own process, so none of its GPU memory is held while the trainer runs
    argv = [
        sys.executable,
        str(Path(__file__).resolve()),
        "step",
        "--root",
        str(root),
        "--results",
        args.results,
        "--iters",
        str(args.iters),
        "--tag",
        "bare",
        "--verifier-weights",
        args.verifier_weights or "finite,nan",
        "--log-dir",
        args.log_dir,
    ]
    argv += (["--tiny"] if args.tiny else []) + (["--profile", args.profile] if args.profile else [])
    r = subprocess.run(argv, capture_output=True, text=True)
    lines = [json.loads(ln) for ln in r.stdout.splitlines() if ln.startswith("{")]
    steps = {x.get("verifier_weights"): x for x in lines if x.get("what") == "step"}
    if r.returncode or not steps:
        raise SystemExit(f"the bare step failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    for x in steps.values():
        print(json.dumps(x), flush=True)
    bare = steps.get("finite") or next(iter(steps.values()))
    runs = [cmd_eyrie(args, opt) for opt in args.optimizers.split(",")]
    emit_summary(args, bare, runs, steps.get("nan"))
    compare_profiles(args, runs)


def compare_profiles(args, runs: list[dict]) -> None:
    """With --profile: each trainer's window against the bare step's (finite weights), and the bare step on NaN
    against it, kernel by kernel (compare_tables); text beside the logs, a record in the results."""
    logs = Path(args.log_dir)
    base = logs / "kernels_step_bare.json"
    if not base.exists():
        return
    tag = "_" + args.tag if args.tag else ""
    others = [logs / "kernels_step_bare-nan.json"] + [logs / f"kernels_eyrie_{r['optimizer']}{tag}.json" for r in runs]
    for other in others:
        if other.exists():
            args.compare = [str(base), str(other)]
            cmd_compare(args)


def emit_summary(args, bare: dict, runs: list[dict], bare_nan: dict | None = None) -> None:
    summary = {"what": "summary", "bare_step_tokens_per_s": bare["tokens_per_s"]}
    if bare_nan:  # the bare step as first measured: speculators' NaN placeholders for the borrowed tensors
        summary["bare_step_on_nan_tokens_per_s"] = bare_nan["tokens_per_s"]
    for r in runs:
        tag = f"eyrie_{r['optimizer']}"
        summary[tag + "_tokens_per_s"] = r.get("tokens_per_s")
        summary[tag + "_ratio_to_bare"] = (
            round(r["tokens_per_s"] / bare["tokens_per_s"], 3) if r.get("tokens_per_s") else None
        )
        if bare_nan:
            summary[tag + "_ratio_to_bare_on_nan"] = (
                round(r["tokens_per_s"] / bare_nan["tokens_per_s"], 3) if r.get("tokens_per_s") else None
            )
        summary[tag + "_first_step_s"] = r.get("first_step_s")
        summary[tag + "_compile_cache_warm"] = r["compile_cache_files_before"] > 0
    emit(args, summary)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_bench_entry":
        _bench_entry(sys.argv[2:])
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["all", "gen", "step", "eyrie", "loader", "ab", "compare"])
    p.add_argument(
        "--root",
        default=os.path.expanduser("~/eyrie-train-throughput"),
        help="run folder (put it on a disk, not tmpfs)",
    )
    p.add_argument("--results", default="")
    p.add_argument("--log-dir", default="/tmp/eyrie-train-throughput-logs")
    p.add_argument("--tiny", action="store_true", help="tiny dimensions: a CPU check of the plumbing")
    p.add_argument("--tag", default="")
    p.add_argument("--regen", action="store_true")
    # gen
    p.add_argument("--rows", type=int, default=3000)
    p.add_argument(
        "--hs-dtype", default="bfloat16", choices=["bfloat16", "float8_e4m3fn"], help="gen: the hidden-state files'"
    )
    p.add_argument("--distinct", type=int, default=64, help="distinct hidden-state files (others are links)")
    # step
    p.add_argument("--opt", default="adamw", choices=["adamw", "muon"])
    p.add_argument("--master", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--clip", action="store_true")
    p.add_argument("--attn", default="simple_flex_attention")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--trainer-norms", action="store_true", help="norm_before_fc and norm_output, as the trainer")
    p.add_argument("--shifted-docs", action="store_true", help="documents as the trainer packs them (2047 + pad)")
    p.add_argument("--eyrie-patches", action="store_true", help="eyrie.stages.train.entry's sync-free metrics and loss")
    p.add_argument("--bf16-weights", action="store_true", help="with --master fp32: eyrie's bf16 working weights")
    p.add_argument(
        "--verifier-weights",
        default=None,
        help="step: the borrowed embedding and heads, finite (default) or nan (speculators' placeholder), or both in "
        "one process: finite,nan (all's default)",
    )
    p.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare: two kernels_*.json tables, B against A")
    # eyrie
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "muon"])
    p.add_argument("--optimizers", default="adamw,muon")
    p.add_argument("--warmup-steps", type=int, default=50, help="first logged step of the timed window")
    p.add_argument("--window-s", type=float, default=45.0)
    p.add_argument("--startup-s", type=float, default=300.0)
    p.add_argument("--keep-checkpoints", action="store_true")
    p.add_argument("--loader-batches", type=int, default=60, help="loader: batches timed after 8 of warm-up")
    p.add_argument("--inmem", action="store_true", help="the trainer fed one batch from memory (no loader)")
    p.add_argument("--exact", action="store_true", help="Eyrie's command itself, without _bench_entry's hooks")
    p.add_argument("--profile", default="", help="START,STEPS: a torch.profiler window from step START")
    p.add_argument(
        "--off", action="append", default=[], help="an eyrie.stages.train.entry switch to turn off (GPU_FEED, ...)"
    )
    # ab
    p.add_argument("--ab-run", default="runs/gpu-ab/run")
    p.add_argument("--ab-config", default="runs/gpu-ab/demo.yaml")
    p.add_argument("--ab-target", default="runs/gpu-ab/target")
    p.add_argument("--ab-epochs", type=int, default=10)
    p.add_argument("--ab-device", default="cuda")
    p.add_argument("--ab-lr", default="", help="train.lr of the A/B runs, or several: 0.01,0.001")
    p.add_argument("--ab-warm-start", default="", help="a drafter checkpoint every A/B run starts from (a warm start)")
    args = p.parse_args()
    if args.what == "step":
        cmd_step(args)
    elif args.what == "eyrie":
        cmd_eyrie(args)
    elif args.what == "loader":
        cmd_loader(args)
    elif args.what == "compare":
        cmd_compare(args)
    else:
        {"all": cmd_all, "gen": cmd_gen, "ab": cmd_ab}[args.what](args)


if __name__ == "__main__":
    main()
