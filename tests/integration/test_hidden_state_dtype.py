"""`extraction.hidden_states_dtype: float8_e4m3fn`: speculators' own fp8 format (eyrie/hidden_states/encoding.py),
written by
Eyrie's connector, validated by extract, read by speculators' `fp8` backend.

In-process: the encoding is speculators' byte for byte, its decoding stays within fp8's error bound (massive
activations included), extract's checks tell the encodings apart, and the dtype is part of the extraction key and of
the server's identity. Slow (`-m slow`): one bf16 and one fp8 extraction server of the tiny Llama, the same samples
through both; the fp8 files decode to within fp8 tolerance of the bf16 ones, and speculators' dataset reads them.
"""

from __future__ import annotations

import os

import pytest
import torch
from conftest import DEMO_DATA, VLLM_SERVER_ARGS, config_dict, register_server_folder, stop_server
from safetensors.torch import load_file, save_file

from eyrie.config import PipelineConfig
from eyrie.hidden_states.encoding import (
    BFLOAT16,
    ENV,
    FP8,
    SCALES_KEY,
    bytes_per_token,
    check_config,
    check_encoding,
    decode,
    encode,
    quantize,
    reader_arguments,
)
from eyrie.run.folder import sample_path
from eyrie.stages.extract.checks import check_sample, load_checked
from eyrie.stages.extract.plan import ExtractionPlan
from eyrie.stages.extract.shard import extract_shard
from eyrie.stages.prepare import Shard

LAYERS, HIDDEN = 4, 64


def _hidden(tokens: int = 50, seed: int = 0) -> torch.Tensor:
    """bf16 states like a big model's: layers of different scale, and a few massive activations."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, LAYERS, HIDDEN, generator=g) * torch.tensor([0.5, 2.0, 8.0, 30.0]).reshape(1, LAYERS, 1)
    x[::7, 3, 5] = 3000.0  # massive activations in one channel of the last layer
    x[3] = 0.0  # a row of zeros (scale clamped, not a division by zero)
    return x.to(torch.bfloat16)


def _sample(tokens: int = 50, seed: int = 0) -> dict[str, torch.Tensor]:
    return {"hidden_states": _hidden(tokens, seed), "token_ids": torch.arange(tokens, dtype=torch.long)}


def _assert_within_fp8(decoded: torch.Tensor, reference: torch.Tensor, scales: torch.Tensor) -> None:
    """|decoded - x| <= |x| (2^-4 + 2^-7) + scale 2^-10 (1.01): e4m3's half step (3 mantissa bits), its subnormal
    half step in scaled units, and the two bf16 roundings of the decoding (scale and product)."""
    x, d = reference.float(), decoded.float()
    bound = x.abs() * (2**-4 + 2**-7) + scales.float() * 2**-10 * 1.01 + 1e-30
    assert bool(((d - x).abs() <= bound).all()), float(((d - x).abs() / bound).max())


def test_encoding_is_speculators_own_byte_for_byte(tmp_path):
    from hs_connectors import FP8Transfer
    from hs_connectors.fp8_utils import SCALES_KEY as THEIRS
    from hs_connectors.fp8_utils import quantize_tensor_to_fp8

    assert SCALES_KEY == THEIRS
    sample = _sample()
    ours = encode(sample, FP8)
    values, scales = quantize_tensor_to_fp8(sample["hidden_states"])
    assert ours["hidden_states"].dtype == torch.float8_e4m3fn
    assert torch.equal(ours["hidden_states"].view(torch.uint8), values.view(torch.uint8))
    assert torch.equal(ours[SCALES_KEY], scales) and ours[SCALES_KEY].shape == (50, 1, 1)
    assert ours[SCALES_KEY].dtype == torch.float32
    # speculators' fp8 reader (what the trainer uses) sees what eyrie.hidden_states.encoding.decode gives.
    save_file(ours, str(tmp_path / "hs_0.safetensors"))
    save_file(sample, str(tmp_path / "hs_1.safetensors"))
    read = FP8Transfer(tmp_path).get_cached(0)
    assert read is not None and set(read) == {"hidden_states", "token_ids"}
    assert read["hidden_states"].dtype == torch.bfloat16
    assert torch.equal(read["hidden_states"], decode(ours)["hidden_states"])
    # ... and a bf16 file unchanged, so one reader serves both encodings.
    plain = FP8Transfer(tmp_path).get_cached(1)
    assert plain is not None and torch.equal(plain["hidden_states"], sample["hidden_states"])
    assert encode(sample, BFLOAT16) is sample
    with pytest.raises(ValueError, match="expected one of"):
        encode(sample, "float16")


def test_round_trip_error_bounds():
    x = _hidden(200, seed=1)
    values, scales = quantize(x)
    decoded = decode({"hidden_states": values, SCALES_KEY: scales, "token_ids": torch.arange(200)})["hidden_states"]
    assert decoded.dtype == torch.bfloat16 and decoded.shape == x.shape
    _assert_within_fp8(decoded, x, scales)
    # The massive activations survive, and the zero row stays zero.
    assert torch.allclose(decoded[::7, 3, 5].float(), x[::7, 3, 5].float(), rtol=0.07)
    assert not decoded[3].any()
    # Relative L2 per layer, each well under fp8's half step: no layer is drowned by another's scale.
    for layer in range(LAYERS):
        a, b = decoded[:, layer].float(), x[:, layer].float()
        assert float((a - b).norm() / b.norm()) < 0.04, layer


def test_extract_checks_tell_the_encodings_apart(tmp_path):
    sample = _sample(20)
    ids = sample["token_ids"].tolist()
    fp8 = encode(sample, FP8)
    check_sample(fp8, ids, LAYERS, HIDDEN, FP8)
    check_sample(sample, ids, LAYERS, HIDDEN, BFLOAT16)
    check_sample(sample, ids, LAYERS, HIDDEN)  # bfloat16 is the default
    with pytest.raises(ValueError, match="fp8 file"):
        check_sample(fp8, ids, LAYERS, HIDDEN, BFLOAT16)
    with pytest.raises(ValueError, match="expected torch.float8_e4m3fn"):
        check_sample(sample, ids, LAYERS, HIDDEN, FP8)
    with pytest.raises(ValueError, match="without hidden_states_scales"):
        check_encoding({k: v for k, v in fp8.items() if k != SCALES_KEY}, FP8)
    with pytest.raises(ValueError, match="expected torch.float32"):
        check_encoding({**fp8, SCALES_KEY: fp8[SCALES_KEY].reshape(20)}, FP8)
    with pytest.raises(ValueError, match="finite and positive"):
        check_encoding({**fp8, SCALES_KEY: torch.where(torch.arange(20) == 4, -1.0, 1.0).reshape(20, 1, 1)}, FP8)
    nan = fp8["hidden_states"].clone()
    nan.view(torch.uint8)[2, 1, 3] = 0xFF  # e4m3fn's NaN
    with pytest.raises(ValueError, match="NaN"):
        check_sample({**fp8, "hidden_states": nan}, ids, LAYERS, HIDDEN, FP8)
    with pytest.raises(ValueError, match="token ids differ"):
        check_sample(fp8, ids[:-1] + [7], LAYERS, HIDDEN, FP8)
    # Through the file, as extract reads it.
    save_file(fp8, str(tmp_path / "f.safetensors"))
    load_checked(tmp_path / "f.safetensors", ids, LAYERS, HIDDEN, FP8)
    with pytest.raises(ValueError, match="fp8 file"):
        load_checked(tmp_path / "f.safetensors", ids, LAYERS, HIDDEN)


def test_fp8_halves_the_bytes_per_token(tmp_path):
    for dtype in (BFLOAT16, FP8):
        save_file(encode(_sample(1000), dtype), str(tmp_path / f"{dtype}.safetensors"))
    bf16, fp8 = ((tmp_path / f"{d}.safetensors").stat().st_size for d in (BFLOAT16, FP8))
    assert abs(bf16 - 1000 * bytes_per_token(LAYERS, HIDDEN, BFLOAT16)) < 512  # the header
    assert abs(fp8 - 1000 * bytes_per_token(LAYERS, HIDDEN, FP8)) < 512
    assert bytes_per_token(4, 7168, FP8) / bytes_per_token(4, 7168, BFLOAT16) < 0.501  # Kimi-K2.5: 28,684 vs 57,352


def test_dtype_is_part_of_the_key_and_the_server(tiny_llama, tmp_path):
    from eyrie.run.folder import RunFolder
    from eyrie.stages.preflight import PreflightReport

    shard = Shard(0, 0, 8, "f" * 16, 400)
    report = PreflightReport(
        "LlamaForCausalLM", None, "native", "", None, 8, 64, 512, [2, 4, 5], [2, 4, 5, 8], "x", 512
    )
    plans = {}
    for dtype in (BFLOAT16, FP8):
        cfg = config_dict(tiny_llama)
        cfg["extraction"]["hidden_states_dtype"] = dtype
        plans[dtype] = ExtractionPlan(PipelineConfig.model_validate(cfg), RunFolder(tmp_path / dtype), report, [shard])
    assert plans[BFLOAT16].keys != plans[FP8].keys
    assert plans[BFLOAT16].data_keys != plans[FP8].data_keys  # another content: training keys on it too
    assert plans[FP8].spec.server_env == {ENV: FP8}  # what the connector reads
    assert plans[BFLOAT16].spec.server_env == {ENV: BFLOAT16}
    assert plans[BFLOAT16].spec.fingerprint() != plans[FP8].spec.fingerprint()


def test_config_field_and_preflight_check(monkeypatch, tiny_llama):
    cfg = config_dict(tiny_llama)
    field = type(PipelineConfig.model_validate(cfg).extraction).model_fields["hidden_states_dtype"]
    assert field.default == BFLOAT16 and field.description
    cfg["extraction"]["hidden_states_dtype"] = "float16"
    with pytest.raises(Exception, match="hidden_states_dtype"):
        PipelineConfig.model_validate(cfg)
    assert check_config(BFLOAT16) == [] and check_config(FP8) == []
    monkeypatch.delattr(torch, "float8_e4m3fn")
    assert check_config(BFLOAT16) == []
    (problem,) = check_config(FP8)
    assert "has no torch.float8_e4m3fn" in problem and "set it to bfloat16" in problem


def test_trainer_reads_with_speculators_fp8_backend():
    argv = ["--data-path", "d", "--hidden-states-path", "h"]
    assert reader_arguments(argv) == [*argv, "--hidden-states-backend", "fp8"]
    chosen = [*argv, "--hidden-states-backend", "file"]
    assert reader_arguments(chosen) == chosen


# ---------------------------------------------------------------------------------------------------------------
# Slow: the real connector in a real vLLM server.


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_fp8_extraction_decodes_to_the_bf16_one_and_speculators_reads_it(tmp_path, tiny_llama):
    from concurrent.futures import ThreadPoolExecutor

    from hs_connectors import FileTransfer, FP8Transfer
    from speculators.train.data import ArrowDataset

    from eyrie.config import DataConfig, TargetConfig
    from eyrie.stages.prepare import load_dataset_rows, load_shards, prepare
    from eyrie.vllm.process import VllmServer
    from eyrie.vllm.spec import ServerSpec

    prepared = tmp_path / "prepare"
    prepare(
        TargetConfig(model=str(tiny_llama)),
        DataConfig(source=str(DEMO_DATA), max_samples=8, shard_size=8, eval_fraction=0.0, max_length=256),
        prepared,
    )
    shard = load_shards(prepared)[0]
    rows = load_dataset_rows(prepared, shard.start, shard.stop)
    layer_ids = [2, 4, 5, 8]  # tiny-llama: 8 layers, hidden 64
    folders, specs = {}, {}
    for dtype in (BFLOAT16, FP8):
        folders[dtype] = register_server_folder(tmp_path / f"server-{dtype}")
        specs[dtype] = ServerSpec(
            model=str(tiny_llama),
            layer_ids=layer_ids,
            storage_path=str(folders[dtype] / "staging"),
            max_model_len=512,
            server_args=list(VLLM_SERVER_ARGS),
            server_env={ENV: FP8} if dtype == FP8 else {},
        )
    try:
        with ThreadPoolExecutor(2) as pool:  # both start side by side: start-up is mostly imports
            starts = {d: pool.submit(VllmServer(folders[d]).ensure, specs[d], 800, lambda *_: None) for d in specs}
            clients = {d: f.result() for d, f in starts.items()}
        hidden = {}
        for dtype, client in clients.items():
            hidden[dtype] = folders[dtype] / "hidden_states"  # beside the staging, as in a run folder
            m = extract_shard(
                client,
                prepared,
                shard,
                f"key-{dtype}",
                hidden[dtype],
                tmp_path / dtype / "shard.json",
                len(layer_ids),
                64,
                concurrency=4,
                timeout_s=120,
                log=lambda *_: None,
                hidden_states_dtype=dtype,
            )
            assert m["extracted_samples"] == 8 and m["hidden_states_dtype"] == dtype
    finally:
        for folder in folders.values():
            stop_server(folder)
    bytes_ = {d: sum(p.stat().st_size for p in hidden[d].iterdir()) for d in hidden}
    tokens = sum(len(r) for r in rows)
    print(f"bytes per token: bf16 {bytes_[BFLOAT16] / tokens:.1f}, fp8 {bytes_[FP8] / tokens:.1f}")
    assert bytes_[FP8] < 0.6 * bytes_[BFLOAT16]
    for i, ids in enumerate(rows):
        ref = load_file(str(sample_path(hidden[BFLOAT16], i)))
        raw = load_file(str(sample_path(hidden[FP8], i)))
        check_encoding(raw, FP8)
        assert ref["hidden_states"].dtype == torch.bfloat16 and raw["token_ids"].tolist() == ids
        # Each server computed the same states (to bf16 noise: batching differs); the fp8 file is their encoding.
        again = decode(encode(ref, FP8))["hidden_states"]
        dec = decode(raw)["hidden_states"]
        err = float((dec.float() - ref["hidden_states"].float()).norm() / ref["hidden_states"].float().norm())
        assert err < 0.04, (i, err)
        assert float((dec.float() - again.float()).norm() / again.float().norm()) < 0.02
    # speculators' dataset, as the trainer builds it, on the same rows: fp8 through its fp8 backend.
    data = {
        d: ArrowDataset(512, prepared / "dataset", transfer=t, on_missing="raise")
        for d, t in ((BFLOAT16, FileTransfer(hidden[BFLOAT16])), (FP8, FP8Transfer(hidden[FP8])))
    }
    assert len(data[FP8]) == len(rows)
    for i in range(len(rows)):
        a, b = data[BFLOAT16][i], data[FP8][i]
        assert b["hidden_states"].dtype == torch.bfloat16
        assert b["hidden_states"].shape == a["hidden_states"].shape == (len(rows[i]), 3 * 64)
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        err = (b["verifier_last_hidden_states"].float() - a["verifier_last_hidden_states"].float()).norm()
        assert float(err / a["verifier_last_hidden_states"].float().norm()) < 0.04
    assert not [p for f in folders.values() for p in (f / "staging").iterdir()]
    assert all(VllmServer(f).state is None for f in folders.values())
    assert os.environ.get(ENV) is None  # only the fp8 server's environment held it
