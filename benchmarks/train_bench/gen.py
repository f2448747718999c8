"""gen: a synthetic Kimi-shaped target (config + the three tensors the drafter borrows) and a run folder in Eyrie's
layout (prepare/dataset, vocab, extract/hidden_states)."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from train_bench.common import REPO, dims, draft_geometry, emit


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
