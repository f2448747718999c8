"""step: the bare model step at the draft geometry Eyrie builds (and the trainer's own math on it)."""

from __future__ import annotations

import time
from pathlib import Path

from train_bench.common import GpuSampler, dims, emit, gzip_trace, load
from train_bench.profiling import ClockProbe, analyse_trace, write_profile_tables


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
    if args.eyrie_patches:  # eyrie.stages.train.entry's changes to the model's step: no data-dependent syncs
        from eyrie.stages.train.drafter import apply_speed_choices
        from eyrie.stages.train.patches.switches import Switches

        only = Switches(deferred_mask_compile=False, one_kv_length=False, eager_rotary=False)
        apply_speed_choices(model, only)  # sync_free_metrics alone, bound on this drafter
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
