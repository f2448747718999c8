"""Eyrie's GPU paths on a GPU build of vLLM, one GPU-sized tiny target per contract, driving the core library's stages
directly (no Prefect: the core library never imports it). Run on the GPU node through benchmarks/gpu_pipeline.sh,
which says the device call sequence; on a CPU build of vLLM it runs the same code as far as that build allows
(`--cpu`: smaller widths, CPU attention's limits).

Contracts (`--targets`, default all three):
  llama  a Llama-family target vLLM serves natively (SupportsEagle3): 8 layers, hidden 256, 4 heads of 64, GQA 2;
  gpt2   a target whose vLLM class lacks the interface, served through Eyrie's compatibility layer: 8 layers,
         hidden 256, 4 heads of 64;
  kimi   a Kimi-K2.5 wrapper around a DeepseekV3 text model with MLA at the (qk_nope, qk_rope, v) head dims
         GPU vLLM's MLA prefill accepts, (128, 64, 128), kv_lora_rank 512, and a small MoE.

Stages (`--stages`, default preflight,extract,serve), each target through each:
  preflight  `eyrie.stages.preflight.check.check_target` (the installed vLLM's class, interface, flags, and the model
             runner each server will use);
  extract    Eyrie's extraction server (`ServerSpec.for_extraction`, `VllmServer.ensure`: Eyrie's command, its
             connector and plugin), one request per chat sample through Eyrie's client, each file checked with the
             extract stage's own `load_checked`, and every captured layer compared with transformers on the same
             device (id k < L: `hidden_states[k]`; id L: the last decoder layer's output, through a hook);
  proof      the capture proof on Eyrie's extraction server, as the extraction flow runs it before its first shard
             (`prove_server`), then the same captures judged again: against transformers' states on the same device,
             and planted wrong (the last slot one layer short, an aux id off by one, an aux id summed with an earlier
             stream, zeros, rows one token late, another target's states): each must be refused;
  serve      Eyrie's serving server (`ServerSpec.for_serving`) with an EAGLE-3 drafter of the target's shape, CUDA
             graphs on wherever the EAGLE-3 path allows (native targets), greedy chat completions, and the
             acceptance length from the server's own spec-decode counters. The drafter is random (speculators, the
             trainer, is not in the GPU kit): the figure shows speculation ran and how it is counted, not a drafter's
             quality.
  chain      the whole chain on one target (`stage_chain`): preflight, prepare, extraction into shards
             (`extract_shard`), vocab, Eyrie's trainer command (train.device cuda), export with its serving proof,
             and evaluation's `measure` on the proof's server (CUDA graphs for a native target). The Llama is the
             demo's taught target, built here into .gpu/work/targets/llama-chat and carried; the Kimi wrapper keeps
             random weights (no teaching recipe). Needs speculators (wheels: benchmarks/gpu_pipeline.sh).
  regen-throughput  regeneration throughput (`benchmarks/regenerate_throughput.py`) on the throughput stage's wide
             Llama (hidden 2048): Eyrie's `regenerate_shard` against a bare client replaying the bodies Eyrie sent,
             prefix caching off (`stage_regen_throughput`).
Every server's model runner (V1/V2), attention backend, CUDA-graph mode and start-up time are read from its log.
Results: one JSON (`--out`), appended per target and stage, so a later device call adds to an earlier one's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LAYERS = 8
AUX = [2, 4, 5]
GPU_DIMS = {
    "llama": dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64),
    "gpt2": dict(n_embd=256, n_head=4, n_inner=512),
    # MLA at DeepSeek's and Kimi's own head dims: FlashAttention's MLA prefill takes (128, 64, 128)
    "kimi": dict(
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_attention_heads=8,
        num_key_value_heads=8,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        kv_lora_rank=512,
        q_lora_rank=128,
        n_routed_experts=8,
        num_experts_per_tok=2,
    ),
}
# vLLM's CPU build: head_dim 32 works; MLA keeps the CPU tiny's dims (the CPU build has no MLA prefill limits).
CPU_DIMS = {
    "llama": dict(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=2, head_dim=32),
    "gpt2": {},
    "kimi": {},
}
KINDS = {"llama": "tiny-llama", "gpt2": "tiny-gpt2", "kimi": "tiny-kimi-k25"}
EXPECTED_PATH = {"llama": "native", "gpt2": "compat", "kimi": "native"}
T0 = time.time()


def note(msg: str) -> None:
    print(f"[gpu-pipeline {time.time() - T0:6.1f}s] {msg}", flush=True)


def since(t: float) -> float:
    return round(time.time() - t, 2)


# ---------------------------------------------------------------------------------------------------------------
# targets and configs


def build(name: str, work: Path, cpu: bool, seed: int = 0) -> Path:
    """The target of contract `name` (another seed: the same shape and tokenizer, other weights)."""
    from eyrie.target.tiny import build_target

    dims = (CPU_DIMS if cpu else GPU_DIMS)[name]
    folder = f"{name}-{'cpu' if cpu else 'gpu'}" + (f"-seed{seed}" if seed else "")
    return build_target(KINDS[name], work / "targets" / folder, seed, **dims)


def reference_folder(name: str, model: Path) -> Path:
    """The transformers model whose hidden states the capture is compared with (the Kimi wrapper's text model)."""
    return model / "text_model" if name == "kimi" else model


def pipeline_config(name: str, model: Path, work: Path, cpu: bool):
    from eyrie.config import parse_config

    server_args = ["--language-model-only"] if name == "kimi" else []  # the wrapper's vision tower never built
    return parse_config(
        {
            "name": f"gpu-{name}",
            "target": {"model": str(model), "max_model_len": 512},
            "data": {"source": str(ROOT / "eyrie/data/demo_chat.jsonl"), "max_length": 256},
            "extraction": {
                "layer_ids": AUX,
                # eager: the compatibility layer's hooks need it (preflight checks); every server of this run extracts
                # eager, as Eyrie does by default
                "enforce_eager": True,
                "gpu_memory_utilization": None if cpu else 0.25,
                "server_args": server_args,
            },
            "vocab": {"draft_vocab_size": 256},
            "evaluate": {"num_speculative_tokens": 3},
        },
        source=f"gpu_pipeline:{name}",
    )


def chat_samples(model: Path, n: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    rows = [json.loads(line) for line in (ROOT / "eyrie/data/demo_chat.jsonl").read_text().splitlines() if line]
    out = []
    for row in rows[:n]:
        msgs = row.get("messages") or row.get("conversations") or row
        text = tok.apply_chat_template(msgs, tokenize=False)
        out.append(tok(text, add_special_tokens=False)["input_ids"][:255])
    return out


# ---------------------------------------------------------------------------------------------------------------
# server logs: what each server ran on

LOG_KEYS = {
    "vllm_version": re.compile(r"vLLM API server version ([\w.+-]+)|vLLM v?(\d+\.\d+\.\d+\S*)"),
    "model_runner": re.compile(
        r"(Using V2 Model Runner|Model Runner V2 does not yet support [^;]*; using the V1 model "
        r"runner|using the V1 model runner|Model Runner V2 requires Triton)"
    ),
    "attention_backend": re.compile(r"Using (\S+) (?:attention )?backend"),
    "fa_version": re.compile(r"Using FlashAttention version (\d)"),
    "mla_prefill": re.compile(r"Using (\S+) (?:backend )?for MLA prefill|MLA prefill backend[: ]+(\S+)"),
    "cudagraph": re.compile(r"(Graph capturing finished in [\d.]+ ?secs?.*|cudagraph_mode=\S+)"),
    "compat": re.compile(r"Eyrie's EAGLE-3 compatibility layer (serves .*|: .*)"),
    "aux_layers": re.compile(r"Using Eagle3 auxiliary layers from (?:config|model): (.*)"),
    "ready": re.compile(r"init engine .* took ([\d.]+) s|Application startup complete"),
    # where a start's time goes: compiling (or loading the compiled graphs), memory profiling, graph capture
    "startup": re.compile(
        r"(torch\.compile takes [\d.]+ s in total|Directly load the compiled graph.*"
        r"|Compiling a graph for .* takes [\d.]+ s|Dynamo bytecode transform time: [\d.]+ s"
        r"|Graph capturing finished in [\d.]+ ?secs?.*"
        r"|[Ss]tartup plan.*|Memory profiling takes [\d.]+ seconds.*|init engine .* took [\d.]+ s.*)"
    ),
}


def read_server_log(path: Path) -> dict:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return {"log": None}
    seen: dict = {}
    for line in text.splitlines():
        for key, rx in LOG_KEYS.items():
            m = rx.search(line)
            if m:
                val = next((g for g in m.groups() if g), m.group(0)) if m.groups() else m.group(0)
                seen.setdefault(key, [])
                if val not in seen[key]:
                    seen[key].append(val.strip()[:200])
    runner = " ".join(seen.get("model_runner", []))
    seen["runner"] = "V2" if "Using V2 Model Runner" in runner else ("V1" if runner else "V1 (no V2 line)")
    errors = [line.strip()[:300] for line in text.splitlines() if re.search(r"Error|Traceback", line)]
    seen["errors"] = errors[-6:]
    seen["log"] = str(path)
    return seen


# ---------------------------------------------------------------------------------------------------------------
# stages


@contextlib.contextmanager
def running(spec, folder: Path, out: dict, timeout_s: float = 420):
    """Eyrie's server for `spec` in `folder` for the block, yielding (client, server): its ready time in
    out["ready_s"]; whatever happens, what its log says (runner, backends, graphs) in out["server"], and it stopped."""
    from eyrie.vllm.process import VllmServer

    server = VllmServer(folder)
    t = time.time()
    try:
        client = server.ensure(spec, startup_timeout_s=timeout_s, log=note)
        out["ready_s"] = since(t)
        yield client, server
    finally:
        out["server"] = read_server_log(server.log_path)
        server.stop(log=note)


def stage_preflight(name: str, config) -> dict:
    from eyrie.stages.preflight.check import check_target

    t = time.time()
    report = check_target(config, serve=True)
    out = {
        "s": since(t),
        "eagle3_path": report.eagle3_path,
        "expected_path": EXPECTED_PATH[name],
        "vllm_class": report.vllm_class,
        "reason": report.eagle3_reason,
        "model_runners": report.target_facts.get("model_runners"),
        "failures": report.failures,
        "notes": report.notes,
    }
    out["ok"] = report.eagle3_path == EXPECTED_PATH[name]
    return out


def rel(a, b) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def reference_states(ref: Path, samples: list[list[int]], ids: list[int]):
    """transformers' stream for each captured id, on the GPU when there is one (id L through a hook: before the
    final norm)."""
    import torch
    from transformers import AutoModelForCausalLM

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    hf = AutoModelForCausalLM.from_pretrained(str(ref), dtype=torch.bfloat16).to(dev).eval()
    layers = hf.model.layers if hasattr(hf, "model") and hasattr(hf.model, "layers") else hf.transformer.h
    last: list = []
    hook = layers[-1].register_forward_hook(lambda m, i, o: last.append(o[0] if isinstance(o, tuple) else o))
    out = []
    with torch.no_grad():
        for ids_ in samples:
            last.clear()
            o = hf(torch.tensor([ids_], device=dev), output_hidden_states=True)
            out.append([(last[-1][0] if k == len(layers) else o.hidden_states[k][0]).float().cpu() for k in ids])
    hook.remove()
    name = torch.cuda.get_device_name(0) if dev == "cuda" else "cpu"
    del hf
    if dev == "cuda":
        torch.cuda.empty_cache()
    return out, name


def stage_extract(name: str, config, model: Path, work: Path, n: int) -> dict:
    from safetensors.torch import load_file

    from eyrie.stages.extract.answered import _wait_and_release
    from eyrie.stages.extract.checks import load_checked
    from eyrie.stages.preflight.target import captured_layer_ids
    from eyrie.vllm.spec import ServerSpec

    ids = captured_layer_ids(AUX, LAYERS)
    staging = work / "hidden" / name
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    spec = ServerSpec.for_extraction(config, ids, str(staging))
    out: dict = {"layer_ids": ids, "command": " ".join(spec.command(0)[1:])}
    with running(spec, work / "servers" / f"{name}-extract", out) as (client, _):
        note(f"{name}: extraction server ready in {out['ready_s']} s")
        samples = chat_samples(model, n)
        t = time.time()
        paths = [client.extract(s, timeout_s=120) for s in samples]
        for p in paths:  # the connector writes behind the answer: wait for its writer, as the extract stage does
            _wait_and_release(p)
        out["extract_s"] = since(t)
        out["requests"] = len(samples)
        out["tokens"] = sum(map(len, samples))
    hidden = None
    for p, s in zip(paths, samples):
        load_checked(Path(p), s, len(ids), _width(config), config.extraction.hidden_states_dtype)
    refs, device = reference_states(reference_folder(name, model), samples, ids)
    errs: dict[int, list[float]] = {k: [] for k in ids}
    for p, s, ref in zip(paths, samples, refs):
        data = load_file(p)
        hidden = data["hidden_states"]
        assert data["token_ids"].tolist() == s
        for j, k in enumerate(ids):
            errs[k].append(rel(hidden[:, j], ref[j]))
    out["device"] = device
    out["shape"] = list(hidden.shape) if hidden is not None else None
    out["max_rel_err"] = {str(k): round(max(v), 5) for k, v in errs.items()}
    out["ok"] = all(max(v) < 0.03 for v in errs.values())
    return out


def planted(hs, other):
    """Wrong captures made from a true one ([T, 4, H]: ids 2, 4, 5 and the last layer's output), each as a connector
    or a stale run folder would write it; `other` is another target's states for the same tokens."""
    import torch

    def with_(f):
        s = hs.clone()
        f(s)
        return s

    return {
        "last-holds-layer-5": with_(lambda s: s[:, 3].copy_(s[:, 2])),  # the last slot one layer short
        "aux-off-by-one": with_(lambda s: s[:, 1].copy_(s[:, 2])),  # id 4 holds its layer's output (id 5's input)
        "aux-plus-earlier-stream": with_(lambda s: s[:, 1].add_(s[:, 0])),  # a contract summed twice
        "aux-zeros": with_(lambda s: s[:, 0].zero_()),
        "rows-one-token-late": torch.roll(hs, 1, dims=0),  # each row another position's state (a stale shard)
        "another-target": other.clone(),
    }


def stage_proof(name: str, config, model: Path, work: Path, cpu: bool) -> dict:
    """The capture proof on the GPU server, as the extraction flow runs it before its first shard
    (`eyrie.stages.extract.proof.prove_server`: greedy answers for the data's proof prompts, their capture and the
    server's own top-20 ranking from the same forward pass, the last layer through the target's head and every aux
    layer recomputed). Then the same captures judged again (`eyrie.hidden_states.proof.judge`): as captured (must
    pass), against transformers' states on the same GPU (the relative L2 per id), and planted wrong (`planted`:
    each must be refused)."""
    import torch

    from eyrie.hidden_states.check import CaptureError, context_for
    from eyrie.hidden_states.proof import judge
    from eyrie.stages.extract.proof import proof_samples, prove_server
    from eyrie.stages.preflight import run_preflight
    from eyrie.stages.prepare import prepare
    from eyrie.vllm.spec import ServerSpec

    root = work / "proof" / name
    shutil.rmtree(root, ignore_errors=True)
    config = config.model_copy(deep=True)
    config.data.max_samples = 64
    prepare(config.target, config.data, root / "prepare")
    report = run_preflight(config, root / "run", serve=False)
    ctx = context_for(config, report)
    ids = report.captured_layer_ids
    staging = root / "staging"
    staging.mkdir(parents=True)
    spec = ServerSpec.for_extraction(config, ids, str(staging))
    out: dict = {"layer_ids": ids}
    with running(spec, root / "server", out) as (client, server):
        t = time.time()
        figures = prove_server(
            ctx, root / "prepare", root / "capture", server.state, client, spec.max_model_len, log=note
        )
        out["prove_server"] = {"s": since(t), **{k: figures.get(k) for k in ("prompts", "head_check", "aux_check")}}
        samples = proof_samples(client, root / "prepare", spec.max_model_len, 120)  # again, for the planted cases
    refs, device = reference_states(reference_folder(name, model), [s[1] for s in samples], ids)
    out["device"] = device
    out["vs_transformers"] = {
        str(k): round(max(rel(hs[:, j], ref[j]) for (hs, *_), ref in zip(samples, refs)), 5) for j, k in enumerate(ids)
    }
    quiet = lambda m: None  # noqa: E731
    again = judge(ctx, samples, log=quiet)
    out["true_capture"] = {k: again[k] for k in ("head_check", "aux_check")}
    other_model = build(name, work, cpu, seed=1)
    others, _ = reference_states(reference_folder(name, other_model), [s[1] for s in samples], ids)
    verdicts: dict = {}
    for i, (hs, tokens, p, ranking) in enumerate(samples):
        for case, wrong in planted(hs, torch.stack(others[i], dim=1).to(hs.dtype)).items():
            verdicts.setdefault(case, []).append((wrong, tokens, p, ranking))
    out["planted"] = {}
    for case, wrong_samples in verdicts.items():
        try:
            judge(ctx, wrong_samples, log=quiet)
            out["planted"][case] = {"refused": False}
        except CaptureError as err:
            out["planted"][case] = {"refused": True, "reason": str(err)[:600]}
    out["ok"] = bool(figures.get("passed")) and all(p["refused"] for p in out["planted"].values())
    return out


def _width(config) -> int:
    from eyrie.target.metadata import read_target_config, text_config

    text = text_config(read_target_config(config.target))
    return int(text.get("hidden_size") or text.get("n_embd"))


def make_drafter(model: Path, name: str, work: Path) -> Path:
    """A random one-layer EAGLE-3 drafter of the target's width, in vLLM's own EAGLE-3 format
    (LlamaForCausalLMEagle3: `midlayer.*`, `fc` over the three aux streams, its own norm and head, the target's
    embeddings shared), aux ids as extraction captured them."""
    import torch
    from safetensors.torch import save_file

    from eyrie.config import TargetConfig
    from eyrie.target.metadata import read_target_config, text_config

    text = text_config(read_target_config(TargetConfig(model=str(model))))
    h = int(text.get("hidden_size") or text["n_embd"])
    vocab = int(text.get("vocab_size"))
    heads, head_dim = 4, 64
    if h < heads * head_dim:  # the CPU widths
        heads, head_dim = 2, h // 2
    inter = 2 * h
    g = torch.Generator().manual_seed(0)

    def w(*shape, std=0.02):
        return (torch.randn(*shape, generator=g) * std).to(torch.bfloat16)

    ones = lambda n: torch.ones(n, dtype=torch.bfloat16)  # noqa: E731
    weights = {
        "midlayer.input_layernorm.weight": ones(h),
        "midlayer.hidden_norm.weight": ones(h),
        "midlayer.post_attention_layernorm.weight": ones(h),
        "midlayer.self_attn.q_proj.weight": w(heads * head_dim, 2 * h),
        "midlayer.self_attn.k_proj.weight": w(heads * head_dim, 2 * h),
        "midlayer.self_attn.v_proj.weight": w(heads * head_dim, 2 * h),
        "midlayer.self_attn.o_proj.weight": w(h, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": w(inter, h),
        "midlayer.mlp.up_proj.weight": w(inter, h),
        "midlayer.mlp.down_proj.weight": w(h, inter),
        "fc.weight": w(h, 3 * h),
        "norm.weight": ones(h),
        "lm_head.weight": w(vocab, h),
    }
    out = work / "drafters" / name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": h,
        "intermediate_size": inter,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "head_dim": head_dim,
        "num_hidden_layers": 1,
        "vocab_size": vocab,
        "draft_vocab_size": vocab,
        "target_hidden_size": h,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 1024,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "eagle_aux_hidden_state_layer_ids": AUX,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": AUX, "use_aux_hidden_state": True},
    }
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


def spec_counters(metrics: str) -> dict:
    got = {}
    for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        m = re.findall(rf"^vllm:spec_decode_{key}(?:_total)?(?:{{[^}}]*}})? ([\d.e+]+)$", metrics, re.M)
        got[key] = sum(float(x) for x in m) if m else None
    return got


def stage_serve(name: str, config, model: Path, work: Path, n: int, path: str, cpu: bool) -> dict:
    from eyrie.vllm.spec import ServerSpec

    drafter = make_drafter(model, name, work)
    spec = ServerSpec.for_serving(config, str(drafter))
    # CUDA graphs and torch.compile where the EAGLE-3 path allows them: a native class; the compatibility layer's
    # hooks need eager execution (preflight refuses it otherwise).
    spec.enforce_eager = cpu or path == "compat"
    out: dict = {"enforce_eager": spec.enforce_eager, "drafter": "random (vLLM's EAGLE-3 format)"}
    with running(spec, work / "servers" / f"{name}-serve", out, timeout_s=480) as (client, _):
        note(f"{name}: serving server ready in {out['ready_s']} s")
        before = spec_counters(client.metrics())
        t = time.time()
        rows = [json.loads(line) for line in (ROOT / "eyrie/data/demo_chat.jsonl").read_text().splitlines() if line]
        tokens = 0
        for row in rows[:n]:
            msgs = [m for m in (row.get("messages") or []) if m.get("role") == "user"][:1]
            res = client.chat(msgs, 48)
            tokens += res["usage"]["completion_tokens"]
        out["chat_s"] = since(t)
        out["completion_tokens"] = tokens
        after = spec_counters(client.metrics())
        d = {k: (after[k] or 0) - (before[k] or 0) for k in after}
        out["spec_decode"] = d
        out["acceptance_length"] = round(1 + d["num_accepted_tokens"] / d["num_drafts"], 3) if d["num_drafts"] else None
        out["ok"] = bool(tokens and d["num_drafts"])
    return out


# ---------------------------------------------------------------------------------------------------------------
# the whole chain: prepare, extract (shards), vocab, train, export, evaluate


def taught_target(name: str, cpu: bool) -> Path:
    """The target the chain trains a drafter for. llama: the demo's own target, `tiny-llama-chat` (the tiny Llama
    taught the bundled conversations in a child process with fixed CPU numerics, so every x86 machine builds the same
    bytes; head_dim 32, which FlashAttention 3 takes), kept under .gpu/work/targets so that it is built once here and
    carried to the GPU node (it is idempotent: a complete folder of the same recipe is kept). A random target's next
    token is noise, and a drafter's acceptance on it would mean nothing. kimi: the GPU-sized wrapper with random
    weights (no teaching recipe exists for it): its figure shows the chain runs on MLA, not a drafter's quality."""
    from eyrie.target.tiny import build_target

    if name == "llama":
        return build_target("tiny-llama-chat", ROOT / ".gpu" / "work" / "targets" / "llama-chat")
    return build(name, ROOT / ".gpu" / "work", cpu)


def chain_config(name: str, model: Path, cpu: bool, epochs: int, samples: int):
    """The demo's settings (configs/demo.yaml) without regeneration; on the GPU, CUDA graphs for the serving server
    and the trainer on cuda."""
    from eyrie.config import parse_config

    server_args = ["--language-model-only"] if name == "kimi" else []
    # the demo's CPU server settings (fork, one unbound OpenMP thread): a tiny target's server ready in seconds
    cpu_env = {"EYRIE_CPU_ENGINE_FORK": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
    return parse_config(
        {
            "name": f"gpu-chain-{name}",
            "target": {"model": str(model), "max_model_len": 512},
            "data": {
                "source": str(ROOT / "eyrie/data/demo_chat.jsonl"),
                "max_length": 256,
                "shard_size": 64,
                "max_samples": samples,
                "eval_fraction": 0.5,
            },
            "extraction": {
                "layer_ids": AUX,
                "enforce_eager": True,  # the extraction server; the serving server's graphs are set per spec
                "gpu_memory_utilization": None if cpu else 0.25,
                "server_args": server_args,
                "server_env": cpu_env if cpu else {},
                "concurrency": 8,
            },
            "vocab": {"draft_vocab_size": 256},
            "train": {
                "epochs": epochs,
                "lr": 1.0e-2,
                "ttt_steps": 3,
                "max_seq_len": 512,
                "device": "cpu" if cpu else "cuda",
                "log_every_steps": 10,
            },
            "evaluate": {"num_speculative_tokens": 3, "max_tokens": 48},
        },
        source=f"gpu_pipeline:chain:{name}",
    )


def train_figures(work: Path) -> dict:
    """The trainer's own step timings (its metrics.jsonl, one row per logged step; eyrie/stages/train/progress.py
    reads the same file): steps/s between the first and the last logged step (the first step's compile and warm-up
    left out), and the median logged step time."""
    rows = []
    path = work / "metrics.jsonl"
    for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
        with contextlib.suppress(ValueError):
            row = json.loads(line)
            if isinstance(row, dict) and "step" in row and "time" in row and "train/loss" in row:
                rows.append(row)
    if not rows:
        return {"logged_steps": 0}
    ms = sorted(r["profile/step_ms"] for r in rows[1:] if "profile/step_ms" in r)
    first, last = rows[0], rows[-1]
    span = last["time"] - first["time"]
    return {
        "logged_steps": len(rows),
        "first_step": first["step"],
        "last_step": last["step"],
        "steps_per_s": round((last["step"] - first["step"]) / span, 2) if span > 0 else None,
        "median_step_ms": round(ms[len(ms) // 2], 2) if ms else None,
        "tokens_per_s_last": last.get("profile/tokens_per_s"),
        "train_loss_first": first["train/loss"],
        "train_loss_last": last["train/loss"],
    }


def stage_chain(
    name: str, work: Path, cpu: bool, epochs: int, samples: int, eval_prompts: int, out: dict | None = None
) -> dict:
    """prepare, extraction into shards through Eyrie's extraction server (`extract_shard`), vocab, training with
    Eyrie's trainer command, export with its serving proof, and evaluation (`measure`) on the proof's server, which
    serves target + trained drafter with CUDA graphs on the GPU. The core library's stage functions, called as the
    pipeline flow calls them (flows/pipeline.py), without Prefect."""
    from dataclasses import replace

    from eyrie.stages.evaluate import measure, with_per_request_metrics
    from eyrie.stages.export import export_and_prove
    from eyrie.stages.extract.shard import extract_shard
    from eyrie.stages.preflight import run_preflight
    from eyrie.stages.prepare import iter_eval_prompts, load_seq_lens, load_shards, prepare
    from eyrie.stages.train.data import TrainingData
    from eyrie.stages.train.trainer import run_training
    from eyrie.stages.vocab import build_vocab, mapping_paths
    from eyrie.vllm.process import VllmServer
    from eyrie.vllm.spec import ServerSpec

    t = time.time()
    model = taught_target(name, cpu)
    root = work / "chain" / name
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    config = chain_config(name, model, cpu, epochs, samples)
    out = {} if out is None else out  # filled as the stages finish: a stopped run still records what ran
    out.update(target=str(model), target_s=since(t), taught=name == "llama", epochs=epochs)
    pretrain = model / "pretrain_loss.json"
    if pretrain.exists():
        out["target_pretrain_loss"] = json.loads(pretrain.read_text())

    t = time.time()
    # its refusals recorded, not raised: the stages after it say for themselves whether they run
    report = run_preflight(config, root / "run", serve=True, raise_on_failure=False)
    out["preflight"] = {
        "s": since(t),
        "failures": report.failures,
        "eagle3_path": report.eagle3_path,
        "model_runners": report.target_facts.get("model_runners"),
        "aux_layer_ids": report.aux_layer_ids,
        "captured_layer_ids": report.captured_layer_ids,
    }
    note(f"{name}: chain preflight {json.dumps(out['preflight'])}")

    t = time.time()
    prepared = root / "prepare"
    manifest = prepare(config.target, config.data, prepared)
    stats = manifest["stats"]
    out["prepare"] = {"s": since(t), **{k: v for k, v in stats.items() if not isinstance(v, dict)}}
    note(f"{name}: prepare {json.dumps(out['prepare'])}")

    # extraction: Eyrie's server, each shard through extract_shard (files checked and renamed into the run folder,
    # which shares the server's staging folder's filesystem)
    ids = report.captured_layer_ids
    staging = root / "staging"
    staging.mkdir()
    hidden = root / "hidden_states"
    spec = ServerSpec.for_extraction(config, ids, str(staging))
    ext: dict = {"layer_ids": ids}
    with running(spec, root / "server-extract", ext) as (client, _):
        t = time.time()
        counts = []
        for shard in load_shards(prepared):
            m = extract_shard(
                client,
                prepared,
                shard,
                f"gpu-chain-{shard.name}",
                hidden,
                root / "extract" / f"{shard.name}.json",
                len(ids),
                report.hidden_size,
                config.extraction.concurrency,
                config.extraction.request_timeout_s,
                log=note,
            )
            counts.append(m["extracted_samples"])
        ext["extract_s"] = since(t)
        ext["samples"] = sum(counts)
    out["extract"] = ext
    note(f"{name}: extract {json.dumps({k: v for k, v in ext.items() if k != 'server'})}")

    t = time.time()
    dvs = config.vocab.draft_vocab_size
    build_vocab(prepared / "dataset" / "token_freq.pt", dvs, report.vocab_size, root / "vocab", "v")
    d2t, t2d = mapping_paths(root / "vocab", dvs)
    out["vocab"] = {"s": since(t), "draft_vocab_size": dvs, "target_vocab_size": report.vocab_size}

    data = TrainingData(prepared / "dataset", hidden, d2t, t2d, report.aux_layer_ids, report.target_facts)
    seq_lens = load_seq_lens(prepared)
    t = time.time()
    trained = run_training(config, root / "train", "k", data, seq_lens, log=note)
    train_s = since(t)
    steps = trained.get("global_step") or 0
    out["train"] = {
        "s": train_s,
        "device": config.train.device,
        "global_step": steps,
        "steps_per_s_wall": round(steps / train_s, 2) if train_s else None,
        "checkpoint": trained.get("checkpoint"),
        "history": trained.get("history"),
        "val_metrics": trained.get("val_metrics"),
        "warnings": trained.get("warnings"),
        "trainer_metrics": train_figures(root / "train" / "k"),
    }
    note(f"{name}: train {json.dumps({k: v for k, v in out['train'].items() if k != 'trainer_metrics'})[:1500]}")

    # export, proved on the server evaluation then reuses (as the pipeline does): target + trained drafter, CUDA
    # graphs and torch.compile on the GPU (a native target), eager on the CPU build
    serving = ServerSpec.for_serving(config)
    serving = replace(
        serving,
        enforce_eager=cpu or report.eagle3_path == "compat",
        server_args=with_per_request_metrics(serving.server_args),
    )
    prompts = list(iter_eval_prompts(prepared))[:eval_prompts]
    srv = VllmServer(root / "server-trained")
    t = time.time()
    try:

        def serve_drafter(drafter: str):
            return srv.ensure(replace(serving, drafter=drafter), startup_timeout_s=480, log=note)

        exported = export_and_prove(
            Path(trained["checkpoint"]),
            root / "export",
            str(model),
            report.aux_layer_ids,
            report.hidden_size,
            "e",
            serve_drafter,
            prompts[0],
        )
        out["export"] = {"s": since(t), "drafter": exported["drafter"], "vllm_proof": exported.get("vllm_proof")}
        note(f"{name}: export {json.dumps(out['export'])[:800]}")
        client = srv.ensure(replace(serving, drafter=exported["drafter"]), startup_timeout_s=480, log=note)
        t = time.time()
        result = measure(client, prompts, config.evaluate.max_tokens)
        out["evaluate"] = {
            "s": since(t),
            "prompts": len(prompts),
            "max_tokens": config.evaluate.max_tokens,
            "num_speculative_tokens": config.evaluate.num_speculative_tokens,
            "enforce_eager": serving.enforce_eager,
            **{k: v for k, v in result.items() if k != "requests"},
        }
    finally:
        out["serve_server"] = read_server_log(srv.log_path)
        srv.stop(log=note)
    ev = out["evaluate"]
    note(f"{name}: evaluate {json.dumps(ev)[:1500]}")
    out["acceptance_length"] = ev.get("acceptance_length")
    out["ok"] = bool(steps) and bool(out["acceptance_length"]) and out["acceptance_length"] > 1.05
    return out


def stage_restart(name: str, config, model: Path, work: Path, path: str, cpu: bool) -> dict:
    """The second start of the same serving server against the first (the 27-minute load), with the start-up
    levers Eyrie applies (`eyrie.vllm.levers`) on a persistent vLLM cache: a fresh `VLLM_CACHE_ROOT` on a disk (not a
    temporary folder, where the compile-cache lever does not apply), the server started, stopped and started again.
    Each start's ready time and its log's compile, profiling and graph-capture lines (`read_server_log`) recorded."""
    from eyrie.run.environment import child_environment
    from eyrie.vllm.levers import plan_for
    from eyrie.vllm.spec import ServerSpec

    cache = Path.home() / ".cache" / "eyrie-gpu-restart" / name
    shutil.rmtree(cache, ignore_errors=True)
    cache.mkdir(parents=True)
    before = os.environ.get("VLLM_CACHE_ROOT")
    os.environ["VLLM_CACHE_ROOT"] = str(cache)
    out: dict = {"cache_root": str(cache), "starts": []}
    try:
        drafter = make_drafter(model, name, work)
        spec = ServerSpec.for_serving(config, str(drafter))
        spec.enforce_eager = cpu or path == "compat"
        out["enforce_eager"] = spec.enforce_eager
        out["levers"] = plan_for(config, "serving", child_environment()).as_dict()
        out["startup_args"], out["startup_env"] = spec.startup_args, spec.startup_env
        for i in range(2):
            start: dict = {}
            out["starts"].append(start)
            with running(spec, work / "servers" / f"{name}-restart-{i}", start, timeout_s=480) as (client, _):
                start["answer"] = bool(client.chat([{"role": "user", "content": "Hello"}], 8)["usage"])
            note(f"{name}: start {i + 1} ready in {start.get('ready_s')} s: {start['server'].get('startup')}")
    finally:
        if before is None:
            os.environ.pop("VLLM_CACHE_ROOT", None)
        else:
            os.environ["VLLM_CACHE_ROOT"] = before
    first, second = (s.get("ready_s") for s in out["starts"])
    out["second_over_first"] = round(second / first, 3) if first and second else None
    out["cache_bytes"] = sum(f.stat().st_size for f in cache.rglob("*") if f.is_file())
    out["ok"] = bool(first and second)
    return out


def stage_throughput(work: Path, tokens: int, samples: int, repeats: int, cpu: bool) -> dict:
    """Extraction throughput on the GPU: `benchmarks/extract_throughput.py` (Eyrie's shards through `extract_shard`,
    a bare asynchronous client and speculators' `generate-offline-data`, the same samples against one server) with
    prefix caching off, as the Kimi preset serves, on samples of about `tokens` tokens, against a Llama wide enough
    that its files are realistic (hidden 2048: 16 KiB of hidden states per token at 4 captured layers)."""
    import yaml

    from eyrie.target.tiny import build_target

    wide = dict(
        hidden_size=2048,
        intermediate_size=4096,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=8192,
    )
    model = build_target(
        "tiny-llama", work / "targets" / ("llama-cpu" if cpu else "llama-wide"), **CPU_DIMS["llama"] if cpu else wide
    )
    config = pipeline_config("llama", model, work, cpu)
    config.extraction.concurrency = 32
    folder = work / "throughput"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    cfg_path = folder / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(config.model_dump(mode="json", exclude_none=True), sort_keys=False))
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "extract_throughput.py"),
        "--config",
        str(cfg_path),
        "--work-dir",
        str(folder / "run"),
        "--synthetic-tokens",
        str(tokens),
        "--no-prefix-caching",
        "--max-samples",
        str(samples),
        # Several shards, two at a time as the flow runs them: a shard's fsyncs and capture check then overlap the
        # next one's requests, as in a run of many shards (one shard of all the samples would pay them after the
        # last answer, with the server idle).
        "--shard-size",
        str(max(1, samples // 4)),
        "--shard-tasks",
        "4",  # also Eyrie with four shard tasks at once, against the flow's two
        "--repeats",
        str(repeats),
    ]
    t = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    (folder / "extract_throughput.log").write_text(proc.stdout + proc.stderr)
    print(proc.stdout[-3000:], flush=True)
    out: dict = {"s": since(t), "command": " ".join(cmd[1:]), "rc": proc.returncode}
    bench = folder / "run" / "bench.json"
    if proc.returncode or not bench.exists():
        out["error"] = (proc.stdout + proc.stderr)[-1500:]
        out["ok"] = False
        return out
    result = json.loads(bench.read_text())
    out.update({k: result[k] for k in ("samples", "tokens", "concurrency", "repeats", "prefix_caching", "results")})
    out["ratio_eyrie_bare"] = round(result["ratio_eyrie_bare"], 3)
    out["ratio_eyrie_bare_written"] = round(result["ratio_eyrie_bare_written"], 3)
    out["ratio_eyrie_speculators"] = round(result["ratio_tokens_per_s"], 3)
    out["agreement"] = result["agreement"]
    out["eyrie_phases_s"] = result["eyrie_phases_s"]
    out["ratio_variants_bare_written"] = {k: round(v, 3) for k, v in result["ratio_variants_bare_written"].items()}
    out["ok"] = True
    return out


def stage_regen_throughput(work: Path, samples: int, max_tokens: int, repeats: int, cpu: bool) -> dict:
    """Regeneration throughput on the GPU: `benchmarks/regenerate_throughput.py` (Eyrie's shards through
    `regenerate_shard`, two at a time as the flow runs them, against a bare asynchronous client replaying the very
    bodies Eyrie sent, on one extraction server) with prefix caching off, on the same wide Llama as the throughput
    stage (hidden 2048; tiny CPU widths with --cpu).

    Sizes: `samples` conversations of the demo's chat data in 4 shards, regenerate.concurrency 16 (32 in flight
    while two shards run), up to `max_tokens` new tokens per turn. The target's weights are random, so nearly every
    answer runs to `max_tokens` and ends its conversation there (one turn each): 256 x 128 is 32k generated tokens
    per pass, a few seconds on the H200; the untimed recording pass and 3 repeats of both clients fit beside the
    server's start (~100 s) within ~200 s."""
    import yaml

    from eyrie.target.tiny import build_target

    wide = dict(
        hidden_size=2048,
        intermediate_size=4096,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=8192,
    )
    model = build_target(
        "tiny-llama", work / "targets" / ("llama-cpu" if cpu else "llama-wide"), **CPU_DIMS["llama"] if cpu else wide
    )
    config = pipeline_config("llama", model, work, cpu)
    config.regenerate.enabled = True
    config.regenerate.concurrency = 16
    # A prompt of the demo's data (about 40 tokens) and its answer fit; later turns have room too.
    config.data.max_length = 512
    config.target.max_model_len = 1024
    folder = work / "regen-throughput"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    cfg_path = folder / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(config.model_dump(mode="json", exclude_none=True), sort_keys=False))
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "regenerate_throughput.py"),
        "--config",
        str(cfg_path),
        "--work-dir",
        str(folder / "run"),
        "--no-prefix-caching",
        "--max-samples",
        str(samples),
        "--shard-size",
        str(max(1, samples // 4)),
        "--max-tokens",
        str(max_tokens),
        "--repeats",
        str(repeats),
    ]
    t = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    (folder / "regenerate_throughput.log").write_text(proc.stdout + proc.stderr)
    print(proc.stdout[-3000:], flush=True)
    out: dict = {"s": since(t), "command": " ".join(cmd[1:]), "rc": proc.returncode}
    bench = folder / "run" / "bench.json"
    if proc.returncode or not bench.exists():
        out["error"] = (proc.stdout + proc.stderr)[-1500:]
        out["ok"] = False
        return out
    result = json.loads(bench.read_text())
    keys = ("conversations", "shards", "turns_per_conversation", "max_tokens", "concurrency", "bare_window")
    out.update({k: result[k] for k in (*keys, "repeats", "prefix_caching", "results", "agreement_min")})
    out["ratio_eyrie_bare"] = round(result["ratio_eyrie_bare"], 3)
    out["ok"] = True
    return out


# ---------------------------------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--targets", default="llama,gpt2,kimi")
    ap.add_argument("--stages", default="preflight,extract,serve")
    ap.add_argument("--work", default=os.environ.get("GPU_PIPELINE_WORK", "/tmp/gpu-pipeline"))
    ap.add_argument("--out", default=None, help="results JSON (appended); default $OUT/gpu-pipeline.json")
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--cpu", action="store_true", help="CPU widths (vLLM's CPU build)")
    ap.add_argument("--epochs", type=int, default=8, help="chain: training epochs")
    ap.add_argument("--chain-samples", type=int, default=256, help="chain: conversations read (half held out)")
    ap.add_argument("--eval-prompts", type=int, default=128, help="chain: held-out prompts evaluated")
    ap.add_argument("--tokens", type=int, default=1536, help="throughput: tokens per sample")
    ap.add_argument("--throughput-samples", type=int, default=256, help="throughput: samples per pass")
    ap.add_argument("--repeats", type=int, default=3, help="throughput, regen-throughput: passes per client")
    ap.add_argument("--regen-samples", type=int, default=256, help="regen-throughput: conversations per pass")
    ap.add_argument("--regen-max-tokens", type=int, default=128, help="regen-throughput: most tokens per answer")
    ap.add_argument("--budget-s", type=float, default=1e9, help="chain: start no target's chain after this many s")
    a = ap.parse_args()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    out_path = Path(a.out or Path(os.environ.get("OUT", work)) / "gpu-pipeline.json")
    results = json.loads(out_path.read_text()) if out_path.exists() else {"runs": []}
    import torch
    import vllm

    env = {
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "python": sys.version.split()[0],
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(T0)),
    }
    ok = True
    for name in a.targets.split(","):
        rec: dict = {"target": name, "contract": EXPECTED_PATH[name], **env}
        try:
            stages = set(a.stages.split(","))
            if "chain" in stages:  # the whole chain on its own target (taught where a recipe exists)
                if time.time() - T0 > a.budget_s:
                    raise TimeoutError(f"not started: {a.budget_s} s of this call's budget already spent")
                rec["chain"] = {}
                stage_chain(name, work, a.cpu, a.epochs, a.chain_samples, a.eval_prompts, rec["chain"])
            if "throughput" in stages:  # its own wide target, once per call
                if "throughput" not in results.get("done", []):
                    rec["throughput"] = stage_throughput(work, a.tokens, a.throughput_samples, a.repeats, a.cpu)
                    note(f"throughput {json.dumps(rec['throughput'])[:2500]}")
                    results.setdefault("done", []).append("throughput")
            if "regen-throughput" in stages:  # the same wide target, once per call
                if "regen-throughput" not in results.get("done", []):
                    rec["regen-throughput"] = stage_regen_throughput(
                        work, a.regen_samples, a.regen_max_tokens, a.repeats, a.cpu
                    )
                    note(f"regen-throughput {json.dumps(rec['regen-throughput'])[:2500]}")
                    results.setdefault("done", []).append("regen-throughput")
            if not stages & {"preflight", "extract", "proof", "serve", "restart"}:
                raise StopIteration
            t = time.time()
            model = build(name, work, a.cpu)
            rec["build_s"] = since(t)
            note(f"{name}: target at {model} ({rec['build_s']} s)")
            config = pipeline_config(name, model, work, a.cpu)
            path = EXPECTED_PATH[name]
            if "preflight" in a.stages:
                rec["preflight"] = stage_preflight(name, config)
                path = rec["preflight"]["eagle3_path"]
                note(f"{name}: preflight {json.dumps(rec['preflight'])[:600]}")
            if "extract" in a.stages:
                rec["extract"] = stage_extract(name, config, model, work, a.samples)
                note(f"{name}: extract {json.dumps({k: v for k, v in rec['extract'].items() if k != 'server'})}")
                note(f"{name}: extraction server {json.dumps(rec['extract']['server'])[:900]}")
            if "proof" in a.stages:
                rec["proof"] = stage_proof(name, config, model, work, a.cpu)
                note(f"{name}: proof {json.dumps({k: v for k, v in rec['proof'].items() if k != 'server'})[:3000]}")
            if "restart" in a.stages:
                rec["restart"] = stage_restart(name, config, model, work, path, a.cpu)
                note(f"{name}: restart {json.dumps(rec['restart'])[:3000]}")
            if "serve" in a.stages:
                rec["serve"] = stage_serve(name, config, model, work, a.samples, path, a.cpu)
                note(f"{name}: serve {json.dumps({k: v for k, v in rec['serve'].items() if k != 'server'})}")
                note(f"{name}: serving server {json.dumps(rec['serve']['server'])[:900]}")
        except StopIteration:
            pass
        except KeyboardInterrupt:  # the call's time limit (gpu_pipeline.sh's timeout sends SIGINT): keep what ran
            rec["error"] = "stopped (SIGINT: the time limit)"
            rec["ok"] = False
            results["runs"].append(rec)
            out_path.parent.mkdir(parents=True, exist_ok=True)
            out_path.write_text(json.dumps(results, indent=1, default=str) + "\n")
            raise
        except Exception as e:  # noqa: BLE001 - record what broke and go on with the next target
            rec["error"] = f"{type(e).__name__}: {e}"[:1500]
            rec["traceback"] = traceback.format_exc().splitlines()[-8:]
            note(f"{name}: FAILED {rec['error'][:800]}")
        rec["wall_s"] = since(T0)
        rec["ok"] = "error" not in rec and all(
            rec[s].get("ok", True)
            for s in ("preflight", "extract", "proof", "serve", "restart", "throughput", "regen-throughput", "chain")
            if s in rec
        )
        ok = ok and rec["ok"]
        results["runs"].append(rec)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(results, indent=1, default=str) + "\n")
        with contextlib.suppress(Exception):
            torch.cuda.empty_cache()
    note(f"done: {'ok' if ok else 'FAILED'}; results in {out_path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
