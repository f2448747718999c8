"""Packed hidden-state storage (`extraction.storage: packed`, eyrie/hidden_states/packs.py and
eyrie/hidden_states/pack_reader.py): a pack holds
its samples' bytes unchanged, speculators' own dataset and collate read it exactly as they read the files (bf16, fp8,
and the GPU path's carried fp8), and extraction's bookkeeping leaves nothing a kill can make a re-run mistake for
done. Fake extraction (tests/unit/test_extract_unit.py's client); no vLLM, no Prefect."""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from test_extract_unit import HIDDEN, LAYERS, FakeClient, prepared  # noqa: F401 (prepared: a fixture)
from test_gpu_decode import batches, write_run

from eyrie.hidden_states import gpu_decode
from eyrie.hidden_states.encoding import BFLOAT16, FP8
from eyrie.hidden_states.pack_reader import PackedFileTransfer, PackedFP8Transfer
from eyrie.hidden_states.packs import KEY_METADATA, PACKED, PackReader, pack_name, pack_ranges, write_pack
from eyrie.ops.status import run_status
from eyrie.ops.verify import verify_run
from eyrie.run.faults import InjectedFault
from eyrie.run.folder import RunFolder, sample_path
from eyrie.stages.extract.manifest import drop_unpacked, shard_complete
from eyrie.stages.extract.plan import shard_key
from eyrie.stages.extract.shard import extract_shard
from eyrie.stages.prepare import load_dataset_rows, load_shards


def _pack_folder(hidden: Path, start: int, stop: int, key: str = "k") -> dict:
    """Pack rows [start, stop) of a folder of per-sample files and remove those files, as extraction does."""
    rec = write_pack([(i, sample_path(hidden, i)) for i in range(start, stop)], hidden / pack_name(start, stop), key)
    for i in range(start, stop):
        sample_path(hidden, i).unlink()
    return rec


@pytest.mark.parametrize("dtypes", [[BFLOAT16] * 4, [FP8] * 4])
def test_a_pack_holds_each_sample_bit_for_bit(tmp_path, dtypes):
    hidden = write_run(tmp_path, dtypes) / "hidden_states"
    files = {i: load_file(str(sample_path(hidden, i))) for i in range(4)}
    rec = _pack_folder(hidden, 0, 4, key="the-key")
    pack = hidden / pack_name(0, 4)
    assert rec["bytes"] == pack.stat().st_size and rec["stat"].st_ino == pack.stat().st_ino
    whole = load_file(str(pack))  # safetensors' own reader accepts the layout (contiguous, aligned offsets)
    with safe_open(str(pack), "pt") as f:
        assert f.metadata() == {KEY_METADATA: "the-key"}
    reader = PackReader(hidden)
    for i, want in files.items():
        got = reader.read(i)
        assert got is not None and got.keys() == want.keys()
        for name, t in want.items():
            for copy in (got[name], whole[f"{i}/{name}"]):
                assert copy.dtype == t.dtype and copy.shape == t.shape
                assert torch.equal(copy.view(torch.uint8), t.view(torch.uint8)), (i, name)
    assert reader.read(4) is None  # no pack holds it: the transfer opens its file
    # A loader worker gets the reader pickled: its folder only, each worker opens its own.
    assert pickle.loads(pickle.dumps(reader)).read(2)["token_ids"].tolist() == files[2]["token_ids"].tolist()


@pytest.mark.parametrize("dtype", [BFLOAT16, FP8])
def test_speculators_reads_packs_as_it_reads_files(tmp_path, monkeypatch, dtype):
    """speculators' ArrowDataset, shift and collate: the same batches from packs (two shards' packs and files
    beside them) as from the per-sample files, through FP8Transfer's CPU decode and the GPU path's carried bytes."""
    from hs_connectors import FP8Transfer
    from speculators.train.data import CollateFn

    files = write_run(tmp_path / "files", [dtype] * 7)
    packed = tmp_path / "packed"
    shutil.copytree(files, packed)
    _pack_folder(packed / "hidden_states", 0, 3)
    _pack_folder(packed / "hidden_states", 3, 5)  # samples 5 and 6 stay files: a shard in flight
    assert len(list((packed / "hidden_states").glob("hs_*"))) == 2
    for stock, ours, collate in [
        (FP8Transfer, PackedFP8Transfer, CollateFn),
        (gpu_decode.CarriedFP8Transfer, gpu_decode.CarriedFP8Transfer, gpu_decode.CarryingCollate),
    ]:
        want = batches(files, stock, collate, monkeypatch)
        got = batches(packed, ours, collate, monkeypatch)
        assert len(want) == len(got) > 1
        for a, b in zip(want, got, strict=True):
            assert a.keys() == b.keys()
            for key, value in a.items():
                if isinstance(value, torch.Tensor):
                    assert b[key].dtype == value.dtype and torch.equal(b[key], value), key
                else:
                    assert b[key] == value, key
    # The plain `file` backend too (bf16 files: fp8 ones need FP8Transfer's decode).
    if dtype == BFLOAT16:
        from hs_connectors import FileTransfer

        want = batches(files, FileTransfer, CollateFn, monkeypatch)
        got = batches(packed, PackedFileTransfer, CollateFn, monkeypatch)
        assert all(torch.equal(a["hidden_states"], b["hidden_states"]) for a, b in zip(want, got, strict=True))


def test_overlapping_packs_are_refused(tmp_path):
    hidden = write_run(tmp_path, [BFLOAT16] * 4) / "hidden_states"
    write_pack([(i, sample_path(hidden, i)) for i in range(0, 3)], hidden / pack_name(0, 3), "k")
    write_pack([(i, sample_path(hidden, i)) for i in range(2, 4)], hidden / pack_name(2, 4), "k")
    with pytest.raises(ValueError, match="overlap"):
        PackReader(hidden).read(0)


def test_install_puts_packed_readers_behind_speculators_backends(monkeypatch):
    from hs_connectors import HiddenStatesBackend

    from eyrie.hidden_states import pack_reader

    for name in ("file", "fp8"):
        monkeypatch.setitem(HiddenStatesBackend.registry, name, HiddenStatesBackend.registry[name])
    pack_reader.install()
    assert HiddenStatesBackend.registry["fp8"] is pack_reader.PackedFP8Backend
    assert HiddenStatesBackend.registry["file"] is pack_reader.PackedFileBackend
    gpu_decode.install()  # the GPU trainer's reader reads packs as well: CarriedFP8Transfer is a PackedFP8Transfer
    assert issubclass(gpu_decode.CarriedFP8Transfer, PackedFP8Transfer)


# ---------------------------------------------------------------------------------------------------------------
# Extraction with `storage: packed`


def _extract(prepared_dir, tmp_path, client, shard_no=1, key="k1", storage=PACKED, hidden=None, sample_key="values"):
    """`key`: the manifest's (content and layout); `sample_key`: what the files are made under (content only)."""
    shard = load_shards(prepared_dir)[shard_no]
    hidden = hidden or tmp_path / "hidden_states"
    manifest = tmp_path / "shards" / f"{shard.name}.json"
    m = extract_shard(
        client,
        prepared_dir,
        shard,
        key,
        hidden,
        manifest,
        LAYERS,
        HIDDEN,
        concurrency=3,
        log=lambda *_: None,
        storage=storage,
        sample_key=sample_key,
    )
    return shard, hidden, manifest, m


def _samples(hidden: Path, shard) -> dict[int, dict]:
    reader = PackReader(hidden)
    return {i: reader.read(i) or load_file(str(sample_path(hidden, i))) for i in range(shard.start, shard.stop)}


def test_storage_enters_the_manifest_key_not_the_content_key(prepared, tiny_llama):  # noqa: F811
    from eyrie.config import parse_config

    files = parse_config({"target": {"model": str(tiny_llama)}, "data": {"source": str(prepared)}})
    packed = files.model_copy(update={"extraction": files.extraction.model_copy(update={"storage": PACKED})})
    assert shard_key("content", packed) != shard_key("content", files)


def test_packed_shard_is_one_file_its_manifest_vouches_for(prepared, tmp_path):  # noqa: F811
    client = FakeClient(tmp_path / "staging")
    shard, hidden, manifest, m = _extract(prepared, tmp_path, client)
    name = pack_name(shard.start, shard.stop)
    assert m["storage"] == PACKED and list(m["files"]) == [name] and m["extracted_samples"] == 6
    assert sorted(p.relative_to(hidden).as_posix() for p in hidden.rglob("*")) == ["packs", name]
    rows = load_dataset_rows(prepared, shard.start, shard.stop)
    assert m["files"][name]["tokens"] == sum(map(len, rows))
    for offset, ids in enumerate(rows):
        assert PackReader(hidden).read(shard.start + offset)["token_ids"].tolist() == ids
    assert shard_complete(manifest, "k1", hidden, rehash_changed=True)
    again = FakeClient(tmp_path / "staging")
    _extract(prepared, tmp_path, again)
    assert again.sent == []
    # Same size, other bytes: re-hashed because its stat changed, and refused.
    pack = hidden / name
    data = bytearray(pack.read_bytes())
    data[-1] ^= 0xFF
    pack.write_bytes(bytes(data))
    assert not shard_complete(manifest, "k1", hidden, rehash_changed=True)


def test_a_kill_between_pack_and_manifest_repacks_without_the_server(prepared, tmp_path, monkeypatch):  # noqa: F811
    shard = load_shards(prepared)[1]
    monkeypatch.setenv("EYRIE_FAULTS", f"extract.{shard.name}.packed=raise")
    with pytest.raises(InjectedFault):
        _extract(prepared, tmp_path, FakeClient(tmp_path / "staging"))
    hidden, manifest = tmp_path / "hidden_states", tmp_path / "shards" / f"{shard.name}.json"
    assert (hidden / pack_name(shard.start, shard.stop)).exists() and not manifest.exists()
    assert all(sample_path(hidden, i).exists() for i in range(shard.start, shard.stop))
    assert not shard_complete(manifest, "k1", hidden)
    monkeypatch.delenv("EYRIE_FAULTS")
    client = FakeClient(tmp_path / "staging")
    _, _, _, m = _extract(prepared, tmp_path, client)
    assert client.sent == [] and m["reused_samples"] == 6  # the files were whole: packed again, nothing sent
    assert shard_complete(manifest, "k1", hidden, rehash_changed=True)
    assert not list(hidden.glob("hs_*"))


def test_a_pack_without_its_manifest_is_redone(prepared, tmp_path):  # noqa: F811
    shard, hidden, manifest, _ = _extract(prepared, tmp_path, FakeClient(tmp_path / "staging"))
    manifest.unlink()
    client = FakeClient(tmp_path / "staging")
    _extract(prepared, tmp_path, client)
    assert len(client.sent) == 6  # no manifest vouches for the pack: its samples are extracted again
    assert shard_complete(manifest, "k1", hidden, rehash_changed=True)
    assert [p.name for p in (hidden / "packs").iterdir()] == [Path(pack_name(shard.start, shard.stop)).name]


def test_files_left_after_the_manifest_are_dropped(prepared, tmp_path):  # noqa: F811
    """A kill while the packed files are removed (last first) leaves leading ones: the next check removes them."""
    shard, hidden, manifest, _ = _extract(prepared, tmp_path, FakeClient(tmp_path / "staging"))
    for i in (shard.start, shard.start + 1):
        sample_path(hidden, i).write_bytes(b"left over")
    assert shard_complete(manifest, "k1", hidden)  # harmless to readers: the pack comes first
    _extract(prepared, tmp_path, FakeClient(tmp_path / "staging"))
    assert not list(hidden.glob("hs_*"))
    assert drop_unpacked(hidden, shard) == 0


def test_switching_storage_repacks_files_and_unpacked_runs_drop_packs(prepared, tmp_path):  # noqa: F811
    shard, hidden, _, _ = _extract(prepared, tmp_path, FakeClient(tmp_path / "staging"), storage="files", key="f")
    want = _samples(hidden, shard)
    client = FakeClient(tmp_path / "staging")
    _, _, _, m = _extract(prepared, tmp_path, client, key="p")  # files -> packed: nothing is extracted again
    assert client.sent == [] and m["reused_samples"] == 6 and not list(hidden.glob("hs_*"))
    got = _samples(hidden, shard)
    assert all(torch.equal(got[i]["hidden_states"], want[i]["hidden_states"]) for i in want)
    client = FakeClient(tmp_path / "staging")
    _, _, manifest, m = _extract(prepared, tmp_path, client, storage="files", key="f")  # packed -> files
    assert len(client.sent) == 6 and "storage" not in m and pack_ranges(hidden) == []
    assert shard_complete(manifest, "f", hidden, rehash_changed=True)


def test_verify_and_status_read_packed_shards(prepared, tmp_path):  # noqa: F811
    from test_verify import _rot

    run = RunFolder(tmp_path / "run")
    run.ensure()
    run.prepare.mkdir()
    shutil.copy(prepared / "shards.json", run.prepare / "shards.json")

    def extract_all(client):
        for shard in load_shards(run.prepare):
            manifest = run.shard_manifests / f"{shard.name}.json"
            extract_shard(
                client, prepared, shard, "k", run.hidden_states, manifest, LAYERS, HIDDEN, log=print, storage=PACKED
            )

    extract_all(FakeClient(run.extract / "staging"))
    status = run_status(run)
    assert status["stages"]["extract"] == "done" and set(status["shards"].values()) == {"done"}
    report = verify_run(run.root, workers=2, progress=False)
    assert report.ok and report.files == 2 and report.shard_manifests == 2
    shard = load_shards(run.prepare)[1]
    pack = run.hidden_states / pack_name(shard.start, shard.stop)
    _rot(pack)
    report = verify_run(run.root, workers=2, progress=False)
    assert [item.path for item, _ in report.bad] == [pack] and not pack.exists()
    assert run_status(run)["shards"][shard.name].startswith("damaged: 1 of 1 listed files")
    client = FakeClient(run.extract / "staging")
    extract_all(client)
    assert len(client.sent) == 6  # the damaged pack's shard, and only it
    assert verify_run(run.root, workers=2, progress=False).ok
