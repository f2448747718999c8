"""The capture proof (eyrie/hidden_states/check.py) on files: a tiny Llama, in process, greedy answers it generated
itself (as regeneration at temperature 0 leaves them), its residual stream written as extraction writes it. The
true capture passes; each corruption class (zeros, a constant row, a wrong layer, a double-counted residual) is
refused before any manifest, naming the layer, and the shard's files are gone."""

from __future__ import annotations

import pytest
import torch
from capture_target import CAPTURED, LAYERS, capture_context, residual_stream, tiny_llama
from safetensors.torch import save_file

from eyrie.hidden_states.check import CONTEXT, FOLDER, CaptureError, check_shard
from eyrie.run.files import atomic_write_json, read_json
from eyrie.run.folder import RunFolder, sample_path
from eyrie.stages.prepare import Shard

ROWS, SHARD = 12, 6


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A seeded tiny Llama, its greedy answers, and the true stream at every layer (entering each, and leaving the
    last before the final norm)."""
    folder = tmp_path_factory.mktemp("target")
    model = tiny_llama(folder, 0)
    rows, masks, streams = [], [], []
    with torch.no_grad():
        for i in range(ROWS):
            prompt = torch.randint(3, 256, (1, 6 + i % 4))
            out = model.generate(prompt, max_new_tokens=20, do_sample=False, min_new_tokens=20)
            ids = out[0].tolist()
            stream = residual_stream(model, ids)  # [T, L+1, H]
            rows.append(ids)
            masks.append([0] * prompt.shape[1] + [1] * (len(ids) - prompt.shape[1]))
            streams.append(stream)
    return folder, rows, masks, streams


def _run(tmp_path, target, corrupt=None):
    """A run folder with a regenerated dataset (greedy), the capture context, and both shards' files; `corrupt`
    rewrites the [T, L+1, H] stream of the second shard's rows before they are captured."""
    from datasets import Dataset

    folder, rows, masks, streams = target
    run = RunFolder(tmp_path / "run")
    source = run.stage("regenerate")
    Dataset.from_dict({"input_ids": rows, "loss_mask": masks}).save_to_disk(str(source / "dataset"))
    atomic_write_json(source / "stats.json", {"temperatures": {"0.0": ROWS}})
    ctx = capture_context(folder)
    atomic_write_json(run.extract / FOLDER / CONTEXT, ctx)
    shards = [Shard(0, 0, SHARD, "a", 0), Shard(1, SHARD, ROWS, "b", 0)]
    for i, (ids, stream) in enumerate(zip(rows, streams, strict=True)):
        s = stream.clone()
        if corrupt and i >= SHARD:
            s = corrupt(s)
        hs = s[:, CAPTURED, :].to(torch.bfloat16).contiguous()
        sample_path(run.hidden_states, i).parent.mkdir(parents=True, exist_ok=True)
        save_file({"hidden_states": hs, "token_ids": torch.tensor(ids)}, str(sample_path(run.hidden_states, i)))
    return run, source, shards


def _check(run, source, shard):
    return check_shard(run.hidden_states, run.shard_manifests / f"{shard.name}.json", source, shard, log=lambda m: None)


def test_the_true_capture_passes_and_sets_the_baseline(tmp_path, target):
    run, source, shards = _run(tmp_path, target)
    first = _check(run, source, shards[0])
    second = _check(run, source, shards[1])
    assert first["head_check"]["agreement"] >= 0.95, first
    assert second["head_check"]["agreement"] >= 0.95, second
    assert read_json(run.extract / FOLDER / "baseline.json")["shard"] == shards[0].name
    assert all(0.8 < r < 1.25 for r in second["norm_ratio"].values()), second


def _zeros(s):
    s[:, 2, :] = 0  # the aux layer 2 (its column 1)
    return s


def _constant_row(s):
    s[3, 1, :] = 0.5  # one row of layer 1
    return s


def _wrong_layer(s):
    s[:, LAYERS, :] = s[:, LAYERS - 1, :]  # the last layer's input for its output: an off-by-one capture
    return s


def _double_counted(s):
    # The compatibility layer's bug on a layer whose outputs are (stream, its input): stream + input at each id.
    out = s.clone()
    for k in range(1, LAYERS + 1):
        out[:, k, :] = s[:, k, :] + s[:, k - 1, :]
    return out


@pytest.mark.parametrize(
    "corrupt, names",
    [
        (_zeros, "layer 2: "),
        (_constant_row, "layer 1: "),
        (_wrong_layer, f"layer {LAYERS} "),
        (_double_counted, f"layer {LAYERS} "),
    ],
    ids=["zeros", "constant-row", "wrong-layer", "double-counted-residual"],
)
def test_each_corruption_refuses_the_shard_before_its_manifest(tmp_path, target, corrupt, names):
    run, source, shards = _run(tmp_path, target, corrupt)
    _check(run, source, shards[0])  # the run's first shard, true
    with pytest.raises(CaptureError, match=names) as err:
        _check(run, source, shards[1])
    print(err.value)
    assert not any(sample_path(run.hidden_states, i).exists() for i in range(SHARD, ROWS))  # redone next time
    assert not (run.shard_manifests / f"{shards[1].name}.json").exists()
    assert read_json(run.extract / FOLDER / f"{shards[1].name}.json")["problems"]


def test_a_wrong_aux_layer_is_caught_by_the_first_shards_statistics(tmp_path, target):
    """An aux layer's norms off the run's first shard's (a shard captured by another server or contract)."""

    def scaled(s):
        s[:, 1, :] = s[:, 1, :] * 3
        return s

    run, source, shards = _run(tmp_path, target, scaled)
    _check(run, source, shards[0])
    with pytest.raises(CaptureError, match="layer 1: median row norm"):
        _check(run, source, shards[1])


def test_a_first_shard_that_fails_sets_no_baseline(tmp_path, target):
    run, source, shards = _run(tmp_path, target, _zeros)
    shards = [shards[1], shards[0]]  # the corrupt one checked first
    with pytest.raises(CaptureError):
        _check(run, source, shards[0])
    assert not (run.extract / FOLDER / "baseline.json").exists()
    _check(run, source, shards[1])
    assert read_json(run.extract / FOLDER / "baseline.json")["shard"] == shards[1].name


def test_a_large_head_is_used_in_its_checkpoint_dtype(tmp_path, target, monkeypatch):
    """Kimi's head (163,840 x 7,168) is not copied to float32 for the check: the bf16 path proves the same."""
    from eyrie.hidden_states import check

    monkeypatch.setattr(check, "SMALL_HEAD", 0)
    monkeypatch.setattr(check, "_HEADS", {})
    run, source, shards = _run(tmp_path, target)
    figures = _check(run, source, shards[0])
    assert figures["head_check"]["agreement"] >= 0.9, figures
    with pytest.raises(CaptureError, match=f"layer {LAYERS} "):
        run, source, shards = _run(tmp_path / "wrong", target, _wrong_layer)
        _check(run, source, shards[1])  # the corrupted shard, checked first


def test_answers_the_target_did_not_generate_are_recorded_not_judged(tmp_path, target):
    """Data that is not the target's own greedy output (regeneration off, or sampled): a low agreement cannot prove
    the capture wrong, so it is a warning in the log and the figures, and the shard passes."""
    run, source, shards = _run(tmp_path, target, _wrong_layer)
    atomic_write_json(source / "stats.json", {"temperatures": {"0.7": ROWS}})  # sampled answers
    _check(run, source, shards[0])
    said = []
    figures = check_shard(
        run.hidden_states, run.shard_manifests / "shard-00001.json", source, shards[1], log=said.append
    )
    assert figures["head_check"]["reference"] == "the data's next tokens"
    assert figures["head_check"]["agreement"] < 0.5
    assert said and "not a verdict on the capture" in said[0] and "capture/proof.json" in said[0]
