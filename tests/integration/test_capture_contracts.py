"""The output contract no other tiny target has, through the engine a vLLM server runs: a decoder layer that takes
a `residual` argument yet returns the full residual stream first and its own input second (vLLM's
CohereForCausalLM: a parallel attention+MLP block; its final norm passes the residual through unused).

vLLM's CohereForCausalLM lacks the EAGLE-3 interface, so Eyrie's compatibility layer serves it. Trusting the
signature (a `residual` argument: sum the outputs) captured the stream plus the layer's input at every id; the
probe at the final norm measures the contract on the server's first forward pass, and every captured id matches
transformers (as test_extraction_correctness.py checks for the twelve matrix targets). The other contracts vLLM's
model code has are already in that matrix: (delta, residual) to sum (Llama, Qwen, Mistral, Phi-3, DeepseekV3,
Gemma-2 through the compatibility layer), one tensor (GPT-2, OPT, Falcon), and (stream, partial residual) without a
`residual` argument (StableLM).

The capture proof on a real server (issue 39): a tiny random GPT-2 target, whose near-flat logits made the greedy
tokens of the decode passes disagree with a correct capture on a GPU build, is proven against the server's own
ranking from the extraction's forward pass (`ServerClient.extract_ranked`, `prompt_logprobs`), and the same
ranking refuses the other captured layers put in the last one's place.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from conftest import VLLM_SERVER_ARGS
from safetensors.torch import load_file

from eyrie.stages.extract import load_checked
from eyrie.stages.preflight import captured_layer_ids, default_aux_layer_ids
from eyrie.vllm.spec import ServerSpec

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

LAYERS, HIDDEN = 8, 64
REL_TOL = 0.03


def _tiny_cohere(path: Path) -> Path:
    from transformers import CohereConfig, CohereForCausalLM

    from eyrie.target.tiny.common import padded_vocab, save_model
    from eyrie.target.tiny.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(path)
    torch.manual_seed(0)
    cfg = CohereConfig(
        vocab_size=padded_vocab(len(tokenizer)),
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids(tokenizer.eos_token),
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="bfloat16",
    )
    save_model(CohereForCausalLM(cfg), tokenizer, path)
    return path


def _reference(folder: Path, ids: list[int]) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    caught = {}
    handle = model.model.layers[-1].register_forward_hook(
        lambda m, a, o: caught.__setitem__("last", o[0] if isinstance(o, tuple) else o)
    )
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    handle.remove()
    return [h[0] for h in out.hidden_states[:LAYERS]] + [caught["last"][0]]


def test_a_full_stream_layer_with_a_residual_argument_is_captured_right(tmp_path):
    from engine_capture import capture

    from eyrie.run.environment import child_environment

    target = _tiny_cohere(tmp_path / "tiny-cohere")
    layer_ids = captured_layer_ids(default_aux_layer_ids(LAYERS), LAYERS)
    spec = ServerSpec(
        model=str(target),
        layer_ids=layer_ids,
        storage_path=str(tmp_path / "staging"),
        max_model_len=256,
        server_args=list(VLLM_SERVER_ARGS),
    )
    Path(spec.storage_path).mkdir()
    ids = list(range(5, 5 + 60))
    # The server's engine, built from the server's own arguments in one process (tests/engine_capture.py).
    job = {"name": "cohere", "arguments": spec.arguments(0), "token_ids": ids}
    found = capture([job], tmp_path / "engine", child_environment(spec.server_env))
    log = (tmp_path / "engine" / "engine.log").read_text(errors="replace")
    assert "path" in found.get("cohere", {}), found.get("cohere", {}).get("error") or log[-3000:]
    path = found["cohere"]["path"]
    load_checked(Path(path), ids, len(layer_ids), HIDDEN)
    hs = load_file(path)["hidden_states"]
    os.unlink(path)
    assert "compatibility layer serves CohereForCausalLM" in log
    assert "return the full residual stream first" in log, [line for line in log.splitlines() if "Eyrie" in line]
    ref = _reference(target, ids)
    errors = {k: float((hs[:, j].float() - ref[k]).norm() / ref[k].norm()) for j, k in enumerate(layer_ids)}
    print(f"tiny Cohere through the compatibility layer: relative L2 per captured id {errors}")
    assert all(e < REL_TOL for e in errors.values()), errors


def test_the_capture_proof_judges_the_last_layer_against_the_servers_ranking_from_the_same_pass(tmp_path):
    from conftest import build_tiny_target, config_dict, register_server_folder, stop_server
    from datasets import Dataset

    from eyrie.config import parse_config
    from eyrie.hidden_states import proof
    from eyrie.hidden_states.check import GREEDY_MIN_AGREEMENT, context_for, head_logits
    from eyrie.stages.extract.proof import _captured, prove_server
    from eyrie.stages.preflight import run_preflight
    from eyrie.vllm.client import ServerClient
    from eyrie.vllm.process import VllmServer

    target = build_tiny_target("tiny-gpt2")
    config = parse_config(config_dict(target, max_samples=8, shard_size=8, max_length=64))
    report = run_preflight(config, tmp_path / "run", serve=False)
    ctx = context_for(config, report)
    torch.manual_seed(4)
    rows = [torch.randint(3, 500, (40,)).tolist() for _ in range(4)]
    data = tmp_path / "data"
    Dataset.from_dict({"input_ids": rows, "loss_mask": [[0] * 24 + [1] * 16] * 4}).save_to_disk(str(data / "dataset"))
    staging = tmp_path / "staging"
    staging.mkdir()
    spec = ServerSpec.from_config(config, layer_ids=report.captured_layer_ids, storage_path=str(staging))
    folder = register_server_folder(tmp_path / "server")
    said: list[str] = []
    try:
        url = VllmServer(folder).ensure(spec, config.extraction.startup_timeout_s).base_url
        client = ServerClient(url)
        figures = prove_server(
            ctx, data, tmp_path / "capture", VllmServer(folder).state, client, spec.max_model_len, log=said.append
        )
        # Another captured layer in the last one's place, judged by the same rule against the same real ranking
        ids = rows[0]
        hs, ranking = _captured(client, ids, 300)
        server = [(list(r[0]), list(r[1])) for r in ranking[1:]]
        wrong = {
            lid: proof.rank_problems(head_logits(ctx, hs[:-1, j]), server, report.num_layers)
            for j, lid in enumerate(report.captured_layer_ids)
            if lid < report.num_layers
        }
        right = proof.rank_problems(head_logits(ctx, hs[:-1, -1]), server, report.num_layers)
    finally:
        stop_server(folder)
    head = figures["head_check"]
    print(f"tiny GPT-2's capture proof against the server's ranking: {head}; other layers in its place:")
    for lid, (_, fig) in wrong.items():
        print(f"  layer {lid}: {fig}")
    recorded = json.loads((tmp_path / "capture" / proof.PROOF).read_text())
    assert recorded["passed"] and recorded["head_check"] == head, recorded
    prompts = proof.proof_prompts(data, spec.max_model_len)
    assert head["positions"] == sum(len(p) + proof.ANSWER_TOKENS - 1 for p in prompts), head
    assert head["top_k"] == proof.SERVER_TOP_K and "prompt_logprobs" in head["reference"], head
    assert head["top1_agreement"] >= GREEDY_MIN_AGREEMENT and head["topk_overlap"] >= proof.RANK_MIN_OVERLAP, head
    assert head["greedy_vs_forward"]["positions"] == len(prompts) * proof.ANSWER_TOKENS, head
    assert f"top-{proof.SERVER_TOP_K} overlap {head['topk_overlap']}" in said[-1], said
    assert right[0] == [] and right[1]["top1_agreement"] >= GREEDY_MIN_AGREEMENT, right
    assert all(problems and fig["top1_agreement"] < GREEDY_MIN_AGREEMENT for problems, fig in wrong.values()), wrong
    assert not list(staging.iterdir())  # every capture read back and removed
