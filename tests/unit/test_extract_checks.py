"""A file's finiteness check (`all_finite`: the smallest and largest values, not a float32 sum) and the capture proof
beside the shard's fsyncs: its verdict first, both before the manifest."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from test_extract_unit import HIDDEN, LAYERS, FakeClient, prepared  # noqa: F401 - the fixture

from eyrie.hidden_states.check import CaptureError
from eyrie.stages.extract.checks import all_finite, check_sample
from eyrie.stages.prepare import load_shards


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n", [1, 7, 33, 1000, 65537])
def test_all_finite_finds_every_nan_and_infinity(dtype, n):
    for bad in (float("nan"), float("inf"), float("-inf"), -float("nan")):
        for at in {0, n // 2, n - 1}:
            t = torch.randn(n).to(dtype)
            t[at] = bad
            assert not all_finite(t), (bad, at)
    assert all_finite(torch.randn(n).to(dtype))
    big = torch.finfo(dtype).max
    assert all_finite(torch.full((n,), big, dtype=dtype))  # a float32 sum of these would overflow: still finite
    assert all_finite(torch.full((n,), -big, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_all_finite_on_float8(dtype):
    """float8 has no aminmax kernel: its values are checked through bf16, which holds each exactly."""
    t = torch.randn(1000).to(dtype)
    assert all_finite(t)
    big = torch.finfo(dtype).max
    assert all_finite(torch.full((9,), big, dtype=dtype)) and all_finite(torch.full((9,), -big, dtype=dtype))
    bads = [float("nan")] + ([float("inf"), float("-inf")] if dtype == torch.float8_e5m2 else [])  # e4m3fn: no inf
    for bad in bads:
        u = t.clone()
        u[500] = bad
        assert not all_finite(u), bad


def test_all_finite_of_nothing_and_check_sample_on_it():
    assert all_finite(torch.empty(0, LAYERS, HIDDEN, dtype=torch.bfloat16))
    hs = torch.zeros(3, LAYERS, HIDDEN, dtype=torch.bfloat16)
    hs[2, 1, 5] = float("inf")
    with pytest.raises(ValueError, match="NaN or infinite"):
        check_sample({"hidden_states": hs, "token_ids": torch.tensor([1, 2, 3])}, [1, 2, 3], LAYERS, HIDDEN)


def _extract(prepared, tmp_path):  # noqa: F811 - the fixture
    from eyrie.stages.extract.shard import extract_shard

    shard = load_shards(prepared)[0]
    hidden, manifest = tmp_path / "hidden_states", tmp_path / "shards" / f"{shard.name}.json"
    extract_shard(
        FakeClient(tmp_path / "staging"), prepared, shard, "k1", hidden, manifest, LAYERS, HIDDEN, log=lambda *_: None
    )
    return shard, hidden, manifest


def test_the_proof_runs_beside_the_fsyncs_and_before_the_manifest(prepared, tmp_path, monkeypatch):  # noqa: F811
    import eyrie.stages.extract.shard as shard_module

    events: list[str] = []
    lock = threading.Lock()
    real_check, real_fsync, real_manifest = (
        shard_module.check_shard,
        shard_module.fsync_path,
        shard_module.write_manifest,
    )

    def check(*a, **k):
        with lock:
            events.append(f"proof on {threading.current_thread().name}")
        return real_check(*a, **k)

    def fsync(p):
        with lock:
            events.append("fsync")
        real_fsync(p)

    def manifest(*a, **k):
        events.append("manifest")
        real_manifest(*a, **k)

    monkeypatch.setattr(shard_module, "check_shard", check)
    monkeypatch.setattr(shard_module, "fsync_path", fsync)
    monkeypatch.setattr(shard_module, "write_manifest", manifest)
    _, _, manifest_path = _extract(prepared, tmp_path)
    assert manifest_path.exists() and events[-1] == "manifest"
    assert [e for e in events if e.startswith("proof")] == ["proof on eyrie-proof_0"]
    assert events.count("fsync") > 1


def test_the_proofs_verdict_comes_before_an_fsync_that_missed_its_removed_files(prepared, tmp_path, monkeypatch):  # noqa: F811
    """A shard the proof fails has its files removed: the fsyncs running beside it may then find one gone, and the
    error raised is the proof's, with no manifest."""
    import eyrie.stages.extract.shard as shard_module

    proved = threading.Event()

    def check(hidden_dir, *a, **k):
        for p in Path(hidden_dir).glob("hs_*.safetensors"):
            p.unlink()
        proved.set()
        raise CaptureError("layer 3: rows are all zero")

    def fsync(p):
        proved.wait(10)
        if Path(p).name.startswith("hs_"):
            raise FileNotFoundError(p)

    monkeypatch.setattr(shard_module, "check_shard", check)
    monkeypatch.setattr(shard_module, "fsync_path", fsync)
    with pytest.raises(CaptureError, match="all zero"):
        _extract(prepared, tmp_path)
    assert not (tmp_path / "shards").exists() or not any((tmp_path / "shards").iterdir())


def test_an_fsync_error_is_raised_once_the_proof_passed(prepared, tmp_path, monkeypatch):  # noqa: F811
    import eyrie.stages.extract.shard as shard_module

    def fsync(p):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(shard_module, "fsync_path", fsync)
    with pytest.raises(OSError, match="Input/output"):
        _extract(prepared, tmp_path)
    assert not any((tmp_path / "shards").glob("*.json"))
