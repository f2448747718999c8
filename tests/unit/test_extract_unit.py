"""extract's bookkeeping with a fake server client (pure logic; the real server is in test_extraction_correctness):
every file validated before it counts, a manifest that vouches for exactly the files on disk, resume that keeps
valid samples and redoes only missing or damaged ones, and server settings that never leak the API key."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import DEMO_DATA
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from eyrie.config import DataConfig, TargetConfig
from eyrie.errors import ExtractionError
from eyrie.hidden_states.keyed import SAMPLE_KEY, file_key, key_from_name, key_metadata, name_with_key
from eyrie.run.files import atomic_write_json
from eyrie.run.folder import sample_path
from eyrie.stages.extract.answered import clean_staging
from eyrie.stages.extract.checks import check_sample, load_checked
from eyrie.stages.extract.manifest import shard_complete
from eyrie.stages.extract.plan import shard_key
from eyrie.stages.extract.shard import extract_shard
from eyrie.stages.prepare import load_dataset_rows, load_shards, prepare
from eyrie.vllm.client import ServerClient
from eyrie.vllm.plugin import CONNECTOR_NAME
from eyrie.vllm.spec import ServerSpec

LAYERS, HIDDEN = 4, 8


def fake_hidden(ids: list[int]) -> torch.Tensor:
    t = torch.tensor(ids, dtype=torch.float32)
    return (t[:, None, None] + torch.arange(LAYERS * HIDDEN).reshape(1, LAYERS, HIDDEN)).to(torch.bfloat16)


class FakeClient:
    """Writes what the connector would write into `staging`, then returns its path (like ServerClient.extract)."""

    def __init__(self, staging: Path, bad: set[int] = frozenset()):
        self.staging = staging
        self.bad = bad
        self.sent: list[list[int]] = []
        self.lock = threading.Lock()

    def extract(self, token_ids: list[int], timeout_s: float) -> str:
        with self.lock:
            n = len(self.sent)
            self.sent.append(list(token_ids))
        self.staging.mkdir(parents=True, exist_ok=True)
        path = self.staging / f"cmpl-{n}.safetensors"
        hs = fake_hidden(token_ids)
        if len(token_ids) in self.bad:
            hs = hs[:, :-1].contiguous()  # one layer short
        save_file({"hidden_states": hs, "token_ids": torch.tensor(token_ids)}, str(path))
        return str(path)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, tiny_llama) -> Path:
    out = tmp_path_factory.mktemp("extract-unit") / "prepare"
    prepare(
        TargetConfig(model=str(tiny_llama)),
        DataConfig(source=str(DEMO_DATA), max_samples=12, shard_size=6, eval_fraction=0.0),
        out,
    )
    return out


def _run(prepared, tmp_path, client, shard_no=1, key="k1"):
    shard = load_shards(prepared)[shard_no]
    hidden, manifest = tmp_path / "hidden_states", tmp_path / "shards" / f"{shard.name}.json"
    m = extract_shard(
        client, prepared, shard, key, hidden, manifest, LAYERS, HIDDEN, concurrency=3, log=lambda *_: None
    )
    return shard, hidden, manifest, m


def test_shard_written_validated_and_vouched_for(prepared, tmp_path):
    client = FakeClient(tmp_path / "staging")
    shard, hidden, manifest, m = _run(prepared, tmp_path, client)
    rows = load_dataset_rows(prepared, shard.start, shard.stop)
    assert sorted(client.sent) == sorted(rows)
    assert m["extracted_samples"] == 6 and m["reused_samples"] == 0 and m["rows"] == [6, 12]
    assert sorted(m["files"], key=int) == [str(i) for i in range(6, 12)]
    for offset, ids in enumerate(rows):
        load_checked(sample_path(hidden, shard.start + offset), ids, LAYERS, HIDDEN)
    assert not list((tmp_path / "staging").iterdir())  # every staging file was moved into place
    assert shard_complete(manifest, "k1", hidden, rehash_changed=True)
    assert not shard_complete(manifest, "other-key", hidden)
    # A finished shard is not sent again.
    again = FakeClient(tmp_path / "staging")
    _run(prepared, tmp_path, again)
    assert again.sent == []
    # Same size, different bytes: its stat changed, so it is re-hashed, and only the checksum notices.
    p = sample_path(hidden, 7)
    data = bytearray(p.read_bytes())
    data[-1] ^= 0xFF
    p.write_bytes(bytes(data))
    assert shard_complete(manifest, "k1", hidden, rehash_changed=False)  # trusted by its size
    assert not shard_complete(manifest, "k1", hidden, rehash_changed=True)


def test_resume_keeps_valid_samples_and_redoes_bad_ones(prepared, tmp_path):
    shard, hidden, manifest, _ = _run(prepared, tmp_path, FakeClient(tmp_path / "staging"))
    rows = load_dataset_rows(prepared, shard.start, shard.stop)
    manifest.unlink()  # as if the run died before the manifest was written
    sample_path(hidden, 6).unlink()  # missing
    torn = sample_path(hidden, 8)
    torn.write_bytes(torn.read_bytes()[:40])  # truncated
    kept = {i: sample_path(hidden, i).stat().st_mtime_ns for i in (7, 9, 10, 11)}
    client = FakeClient(tmp_path / "staging")
    _, _, _, m = _run(prepared, tmp_path, client)
    assert sorted(client.sent) == sorted([rows[0], rows[2]])
    assert m["reused_samples"] == 4 and m["extracted_samples"] == 2
    assert {i: sample_path(hidden, i).stat().st_mtime_ns for i in kept} == kept
    assert shard_complete(manifest, "k1", hidden, rehash_changed=True)
    # A changed key (other layers, other target) invalidates the manifest, and the files made under the old one are
    # not this key's: whole and for the same tokens, they are extracted again (eyrie.hidden_states.keyed).
    again = FakeClient(tmp_path / "staging")
    _, _, _, m2 = _run(prepared, tmp_path, again, key="k2")
    assert m2["key"] == "k2" and m2["reused_samples"] == 0 and sorted(again.sent) == sorted(rows)
    assert {file_key(sample_path(hidden, i)) for i in range(shard.start, shard.stop)} == {"k2"}


def test_bad_file_from_server_fails_the_shard(prepared, tmp_path):
    shard = load_shards(prepared)[0]
    rows = load_dataset_rows(prepared, shard.start, shard.stop)
    client = FakeClient(tmp_path / "staging", bad={len(rows[3])})
    with pytest.raises(ExtractionError) as info:
        _run(prepared, tmp_path, client, shard_no=0)
    assert "the server wrote a bad file" in str(info.value) and "expected (" in str(info.value)
    assert not (tmp_path / "shards" / f"{shard.name}.json").exists()  # no manifest vouches for it
    assert not list((tmp_path / "staging").glob("*.safetensors"))  # the bad file was removed


def test_check_sample_rejects_wrong_files():
    ids = [1, 2, 3]
    good = {"hidden_states": fake_hidden(ids), "token_ids": torch.tensor(ids)}
    check_sample(good, ids, LAYERS, HIDDEN)
    with pytest.raises(ValueError, match="token ids differ"):
        check_sample(good, [1, 2, 4], LAYERS, HIDDEN)
    with pytest.raises(ValueError, match="shape"):
        check_sample(good, ids, LAYERS + 1, HIDDEN)
    nan = dict(good, hidden_states=good["hidden_states"].clone())
    nan["hidden_states"][1, 2, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        check_sample(nan, ids, LAYERS, HIDDEN)
    with pytest.raises(ValueError, match="expected hidden_states and token_ids"):
        check_sample({"token_ids": good["token_ids"]}, ids, LAYERS, HIDDEN)
    for bad in (float("inf"), float("-inf")):
        inf = dict(good, hidden_states=good["hidden_states"].clone())
        inf["hidden_states"][2, 0, 1] = bad
        with pytest.raises(ValueError, match="infinite"):
            check_sample(inf, ids, LAYERS, HIDDEN)
    # Finite values whose sum overflows float32 are still whole: the one-sum check falls back to element-wise.
    big = dict(good, hidden_states=torch.full_like(good["hidden_states"], 3e38))
    assert not torch.isfinite(big["hidden_states"].sum(dtype=torch.float32))
    check_sample(big, ids, LAYERS, HIDDEN)
    both = dict(big, hidden_states=big["hidden_states"].clone())
    both["hidden_states"][0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        check_sample(both, ids, LAYERS, HIDDEN)


def test_clean_staging_removes_orphans(tmp_path):
    (tmp_path / "a.safetensors").write_bytes(b"x")
    (tmp_path / "a.safetensors.lock").write_bytes(b"")
    (tmp_path / "keep.txt").write_text("x")
    assert clean_staging(tmp_path) == 2
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]
    assert clean_staging(tmp_path / "missing") == 0


def test_shard_key_covers_layers_rows_and_layout(prepared, tiny_llama):
    from eyrie.config import parse_config
    from eyrie.stages.extract.plan import content_key

    config = parse_config({"target": {"model": str(tiny_llama)}, "data": {"source": str(prepared)}})
    shard = load_shards(prepared)[0]
    base = content_key(config, [2, 4, 5, 8], shard)
    assert base == content_key(config, [2, 4, 5, 8], shard)
    assert base != content_key(config, [1, 4, 5, 8], shard)
    assert base != content_key(config, [2, 4, 5, 8], load_shards(prepared)[1])
    packed = config.model_copy(update={"extraction": config.extraction.model_copy(update={"storage": "packed"})})
    assert content_key(packed, [2, 4, 5, 8], shard) == base  # the content: what training keys on
    assert shard_key(base, packed) != shard_key(base, config)  # the manifest's key: content and layout


def test_server_spec_fingerprint_and_command(monkeypatch):
    spec = ServerSpec(model="/m", layer_ids=[2, 4, 5, 8], storage_path="/s", port=1234, api_key_env="EYRIE_TEST_KEY")
    assert spec.fingerprint() == ServerSpec(**{**spec.__dict__, "port": 999}).fingerprint()  # not the port
    assert spec.fingerprint() != ServerSpec(**{**spec.__dict__, "layer_ids": [2, 4, 6, 8]}).fingerprint()
    cmd = spec.command(4321)
    text = " ".join(cmd)
    assert '"eagle_aux_hidden_state_layer_ids": [2, 4, 5, 8]' in text
    assert CONNECTOR_NAME in text and '"shared_storage_path": "/s"' in text and "extract_hidden_states" in text
    assert cmd[cmd.index("--port") + 1] == "4321"
    monkeypatch.delenv("EYRIE_TEST_KEY", raising=False)
    with pytest.raises(ExtractionError, match=r"\$EYRIE_TEST_KEY"):
        spec.api_key()
    monkeypatch.setenv("EYRIE_TEST_KEY", "s3cret-value")
    assert spec.api_key() == "s3cret-value"
    assert "s3cret-value" not in " ".join(spec.command(1)) and "s3cret-value" not in spec.fingerprint()
    monkeypatch.setenv("EYRIE_TEST_KEY", "another")
    assert spec.fingerprint() == ServerSpec(**spec.__dict__).fingerprint()  # the key's value is never part of it


@pytest.mark.parametrize("damage", ["zeros", "flipped_byte", "nan", "truncated", "emptied"])
def test_file_changed_after_completion_is_detected_and_regenerated(prepared, tmp_path, damage):
    client = FakeClient(tmp_path / "staging")
    shard, hidden, manifest, first = _run(prepared, tmp_path, client)
    victim = sample_path(hidden, shard.start + 2)
    ids = load_dataset_rows(prepared, shard.start + 2, shard.start + 3)[0]
    good = victim.read_bytes()
    if damage == "zeros":  # a whole, finite, right-shaped file: only the checksum tells
        save_file({"hidden_states": torch.zeros_like(fake_hidden(ids)), "token_ids": torch.tensor(ids)}, str(victim))
    elif damage == "flipped_byte":
        data = bytearray(good)
        data[-3] ^= 0x01
        victim.write_bytes(bytes(data))
    elif damage == "nan":
        save_file(
            {"hidden_states": torch.full_like(fake_hidden(ids), float("nan")), "token_ids": torch.tensor(ids)},
            str(victim),
        )
    elif damage == "truncated":
        victim.write_bytes(good[: len(good) // 2])
    else:
        victim.write_bytes(b"")
    assert not shard_complete(manifest, "k1", hidden, rehash_changed=True)
    sent_before = len(client.sent)
    _, _, _, second = _run(prepared, tmp_path, client)
    assert len(client.sent) == sent_before + 1  # only the damaged sample is asked for again
    assert second["extracted_samples"] == 1 and second["reused_samples"] == 5
    assert victim.read_bytes() == good
    assert shard_complete(manifest, "k1", hidden, rehash_changed=True)


# ---------------------------------------------------------------------------------------------------------------
# A cached check trusts a file by its stat (size, mtime_ns, inode) and reads nothing; a changed stat means a re-hash


@pytest.fixture
def reads(monkeypatch):
    """The hidden-state files opened for reading, through Python's open or safetensors' loader."""
    import builtins
    import io

    import safetensors.torch

    seen: list[str] = []
    real_open, real_load = builtins.open, safetensors.torch.load_file

    def spy_open(file, *args, **kw):
        if str(file).endswith(".safetensors"):
            seen.append(Path(file).name)
        return real_open(file, *args, **kw)

    def spy_load(file, *args, **kw):
        seen.append(Path(file).name)
        return real_load(file, *args, **kw)

    monkeypatch.setattr(builtins, "open", spy_open)
    monkeypatch.setattr(io, "open", spy_open)
    monkeypatch.setattr(safetensors.torch, "load_file", spy_load)  # imported from there where a file is read
    return seen


def _manifest_json(path: Path) -> dict:
    import json

    return json.loads(path.read_text())


def test_cached_check_reads_no_hidden_state_bytes(prepared, tmp_path, reads):
    client = FakeClient(tmp_path / "staging")
    shard, hidden, manifest, m = _run(prepared, tmp_path, client)
    # Every file's stat is recorded, and the manifest is newer than every file it vouches for.
    for idx, rec in m["files"].items():
        st = sample_path(hidden, int(idx)).stat()
        assert rec["stat"] == {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}
        assert rec["stat"]["mtime_ns"] < manifest.stat().st_mtime_ns
    reads.clear()
    before = (manifest.stat().st_ino, manifest.stat().st_mtime_ns)
    assert shard_complete(manifest, "k1", hidden, rehash_changed=True)
    _run(prepared, tmp_path, client)  # the task itself, on a Prefect cache miss: returns the manifest as it is
    assert reads == []
    assert (manifest.stat().st_ino, manifest.stat().st_mtime_ns) == before  # nothing rewritten
    # The control: a file whose mtime moved is read (re-hashed), and only that one.
    victim = sample_path(hidden, shard.start + 1)
    st = victim.stat()
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert shard_complete(manifest, "k1", hidden, rehash_changed=True)
    assert reads == [victim.name]


def test_touched_file_is_rehashed_once_then_trusted(prepared, tmp_path, reads):
    shard, hidden, manifest, _ = _run(prepared, tmp_path, FakeClient(tmp_path / "staging"))
    victim = sample_path(hidden, shard.start + 3)
    st = victim.stat()
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns - 5 * 10**9))  # same bytes, another mtime (a copy, a touch)
    reads.clear()
    assert shard_complete(manifest, "k1", hidden, rehash_changed=True)
    assert reads == [victim.name]
    assert _manifest_json(manifest)["files"][str(shard.start + 3)]["stat"]["mtime_ns"] == victim.stat().st_mtime_ns
    reads.clear()
    assert shard_complete(manifest, "k1", hidden, rehash_changed=True)
    assert reads == []  # its new stat was recorded: trusted again without a read


def test_manifest_without_stat_is_hashed_once(prepared, tmp_path, reads):
    """A manifest written before stats were kept: every file is hashed once, then trusted by stat."""
    shard, hidden, manifest, m = _run(prepared, tmp_path, FakeClient(tmp_path / "staging"))
    for rec in m["files"].values():
        del rec["stat"]
    atomic_write_json(manifest, m)
    reads.clear()
    assert shard_complete(manifest, "k1", hidden, rehash_changed=True)
    assert sorted(reads) == sorted(sample_path(hidden, i).name for i in range(shard.start, shard.stop))
    assert all("stat" in rec for rec in _manifest_json(manifest)["files"].values())
    reads.clear()
    assert shard_complete(manifest, "k1", hidden, rehash_changed=True)
    assert reads == []


def test_changed_bytes_with_forged_stat_caught_only_within_the_manifests_tick(prepared, tmp_path):
    """Same size, mtime put back, same inode: the stat cannot tell. Within the clock tick the manifest was written
    in (its mtime not newer than the file's), the file is re-hashed and the change caught; later only `eyrie verify`
    (tests/unit/test_verify.py) catches it."""
    shard, hidden, manifest, _ = _run(prepared, tmp_path, FakeClient(tmp_path / "staging"))
    victim = sample_path(hidden, shard.start + 2)
    st = victim.stat()
    data = bytearray(victim.read_bytes())
    data[-2] ^= 0x40
    with open(victim, "r+b") as f:  # in place: the inode stays
        f.write(bytes(data))
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert victim.stat().st_ino == st.st_ino and victim.stat().st_size == st.st_size
    assert shard_complete(manifest, "k1", hidden, rehash_changed=True)  # the documented limit of a stat check
    m_st = manifest.stat()
    os.utime(manifest, ns=(m_st.st_atime_ns, st.st_mtime_ns))  # as if written in the file's own tick
    assert not shard_complete(manifest, "k1", hidden, rehash_changed=True)


def test_pending_shard_hashes_only_changed_and_new_files(prepared, tmp_path, monkeypatch):
    """A shard redone after a sample went missing keeps its intact files without hashing them again (their stat is
    the recorded one), re-hashes a file whose stat changed, and redoes it when its bytes differ."""
    import eyrie.stages.extract

    client = FakeClient(tmp_path / "staging")
    shard, hidden, manifest, _ = _run(prepared, tmp_path, client)
    missing, victim = sample_path(hidden, shard.start), sample_path(hidden, shard.start + 4)
    missing.unlink()
    ids = load_dataset_rows(prepared, shard.start + 4, shard.start + 5)[0]
    # Whole, finite and right-shaped, wrong values: only its checksum tells.
    save_file({"hidden_states": torch.zeros_like(fake_hidden(ids)), "token_ids": torch.tensor(ids)}, str(victim))
    hashed: list[str] = []
    real = eyrie.stages.extract.shard.sha256_file
    for module in (eyrie.stages.extract.shard, eyrie.stages.extract.manifest):
        monkeypatch.setattr(module, "sha256_file", lambda p: hashed.append(Path(p).name) or real(p))
    sent = len(client.sent)
    _, _, _, again = _run(prepared, tmp_path, client)
    assert len(client.sent) == sent + 2 and again["extracted_samples"] == 2 and again["reused_samples"] == 4
    # Only the changed file is read for its checksum; the two extracted ones are hashed from the bytes they were
    # checked from (checked_record), the intact ones not at all.
    assert set(hashed) == {victim.name}
    assert shard_complete(manifest, "k1", hidden, rehash_changed=True)


def test_complete_shard_needs_no_server(prepared, tmp_path):
    """A Prefect cache miss on a complete shard (a new PREFECT_HOME) runs the task without a server: the manifest is
    returned as it is; a shard that is not complete fails with the reason instead of a request to no server."""
    shard, hidden, manifest, m = _run(prepared, tmp_path, FakeClient(tmp_path / "staging"))
    assert _run(prepared, tmp_path, None)[3] == m
    sample_path(hidden, shard.start).unlink()
    with pytest.raises(ExtractionError, match="no server was started for it"):
        _run(prepared, tmp_path, None)


class SlowWriterClient(FakeClient):
    """Like FakeClient, but each file's writer (the connector) holds its lock until the test lets go, as a server
    whose writer pool lags behind its answers would."""

    def __init__(self, staging: Path):
        super().__init__(staging)
        self.release = threading.Event()
        self.writers: list[threading.Thread] = []

    def extract(self, token_ids: list[int], timeout_s: float) -> str:
        import fcntl

        path = super().extract(token_ids, timeout_s)
        fd = os.open(path + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)

        def writer() -> None:
            self.release.wait(30)
            os.close(fd)  # drops the lock

        t = threading.Thread(target=writer, daemon=True)
        t.start()
        self.writers.append(t)
        return path


def test_requests_do_not_wait_for_the_files_of_earlier_ones(prepared, tmp_path):
    """A request's slot is free once the server answers: with one request in flight, every sample of the shard is
    sent while the writers still hold the first files; each is checked, moved and hashed once its writer is done."""
    client = SlowWriterClient(tmp_path / "staging")
    shard = load_shards(prepared)[1]
    hidden, manifest = tmp_path / "hidden_states", tmp_path / "shards" / f"{shard.name}.json"
    result: dict = {}

    def run() -> None:
        result["m"] = extract_shard(
            client, prepared, shard, "k1", hidden, manifest, LAYERS, HIDDEN, concurrency=1, log=lambda *_: None
        )

    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 20
    while len(client.sent) < 6 and time.monotonic() < deadline:
        time.sleep(0.01)
    sent_while_held = len(client.sent)
    assert not manifest.exists()
    client.release.set()
    t.join(30)
    assert sent_while_held == 6, "a request waited for an earlier file's writer"
    assert result["m"]["extracted_samples"] == 6 and sorted(result["m"]["files"], key=int) == [
        str(i) for i in range(6, 12)
    ]
    assert shard_complete(manifest, "k1", hidden, rehash_changed=True)
    assert not list((tmp_path / "staging").iterdir())  # files and their lock files moved or removed


def test_every_file_and_its_folder_reach_the_disk_before_the_manifest(prepared, tmp_path, monkeypatch):
    """The durability order: each extracted file checked and hashed, fsynced once in place, then the folder (the
    names renamed into it), then the manifest, whose checksum and stat are the file's."""
    import eyrie.stages.extract

    events: list[tuple[str, str]] = []
    lock = threading.Lock()
    real_fsync, real_record, real_manifest = (
        eyrie.stages.extract.shard.fsync_path,
        eyrie.stages.extract.shard.checked_record,
        eyrie.stages.extract.shard.write_manifest,
    )

    def fsync(p):
        with lock:
            events.append(("fsync", Path(p).name))
        real_fsync(p)

    shard = load_shards(prepared)[1]
    by_ids = {tuple(ids): shard.start + i for i, ids in enumerate(load_dataset_rows(prepared, shard.start, shard.stop))}
    assert len(by_ids) == shard.stop - shard.start

    def record(p, ids, *a):
        rec = real_record(p, ids, *a)
        with lock:
            events.append(("hash", sample_path(Path("."), by_ids[tuple(ids)]).name))
        return rec

    def manifest(p, m, *a, **k):
        events.append(("manifest", Path(p).name))
        real_manifest(p, m, *a, **k)

    monkeypatch.setattr(eyrie.stages.extract.shard, "fsync_path", fsync)
    monkeypatch.setattr(eyrie.stages.extract.shard, "checked_record", record)
    monkeypatch.setattr(eyrie.stages.extract.shard, "write_manifest", manifest)
    shard, hidden, manifest_path, m = _run(prepared, tmp_path, FakeClient(tmp_path / "staging"))
    names = [sample_path(hidden, i).name for i in range(shard.start, shard.stop)]
    assert [e for e in events if e[0] == "manifest"] == [("manifest", manifest_path.name)]
    at = {e: n for n, e in enumerate(events)}
    for name in names:
        assert at[("fsync", name)] < at[("fsync", hidden.name)] < at[("manifest", manifest_path.name)]
        assert at[("hash", name)] < at[("fsync", name)]
        idx = int(name[3:].split(".")[0])
        rec, p = m["files"][str(idx)], sample_path(hidden, idx)
        assert rec["sha256"] == eyrie.stages.extract.shard.sha256_file(p) and rec[
            "stat"
        ] == eyrie.stages.extract.manifest.stat_record(p.stat())


class CountingClient(FakeClient):
    """Like FakeClient, but counts the requests in flight at once (each answer takes a few milliseconds)."""

    def __init__(self, staging: Path):
        super().__init__(staging)
        self.in_flight = self.most_in_flight = 0

    def extract(self, token_ids: list[int], timeout_s: float) -> str:
        with self.lock:
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            time.sleep(0.005)
            return super().extract(token_ids, timeout_s)
        finally:
            with self.lock:
                self.in_flight -= 1


def test_overlapping_shards_share_one_window_and_each_manifest_comes_last(prepared, tmp_path, monkeypatch):
    """Two shards extracted at once (the flow runs two shard tasks at a time) share one window: at most
    `concurrency` requests in flight over both (a shard's finalisation overlaps the other's requests). Each shard
    still keeps the durability order on its own: every one of its files checked and hashed, fsynced, then
    the folder, then its manifest; the window is closed once its last shard is done."""
    import eyrie.stages.extract

    events: list[tuple[str, str, str]] = []  # (shard thread, event, file)
    lock = threading.Lock()
    real_fsync, real_record, real_manifest = (
        eyrie.stages.extract.shard.fsync_path,
        eyrie.stages.extract.shard.checked_record,
        eyrie.stages.extract.shard.write_manifest,
    )
    shards = load_shards(prepared)[:2]
    index = {tuple(ids): i for i, ids in enumerate(load_dataset_rows(prepared, 0, shards[-1].stop))}

    def note(event: str, name: str) -> None:
        with lock:
            events.append((threading.current_thread().name, event, name))

    def fsync(p):
        note("fsync", Path(p).name)
        real_fsync(p)

    def record(p, ids, *a):
        rec = real_record(p, ids, *a)
        note("hash", sample_path(Path("."), index[tuple(ids)]).name)
        return rec

    def manifest(p, m, *a, **k):
        note("manifest", Path(p).name)
        real_manifest(p, m, *a, **k)

    monkeypatch.setattr(eyrie.stages.extract.shard, "fsync_path", fsync)
    monkeypatch.setattr(eyrie.stages.extract.shard, "checked_record", record)
    monkeypatch.setattr(eyrie.stages.extract.shard, "write_manifest", manifest)
    client = CountingClient(tmp_path / "staging")
    hidden = tmp_path / "hidden_states"
    results: dict[str, dict] = {}

    def run(shard) -> None:
        results[shard.name] = extract_shard(
            client,
            prepared,
            shard,
            "k1",
            hidden,
            tmp_path / "shards" / f"{shard.name}.json",
            LAYERS,
            HIDDEN,
            concurrency=2,
            log=lambda *_: None,
        )

    threads = [threading.Thread(target=run, args=(s,), name=s.name) for s in shards]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(results) == [s.name for s in shards]
    assert client.most_in_flight <= 2  # one window of 2 for both shards, not 2 each
    assert not eyrie.stages.extract.window._windows  # closed with its last shard
    at = {e: n for n, e in enumerate(events)}
    for shard in shards:
        names = [sample_path(hidden, i).name for i in range(shard.start, shard.stop)]
        mine = [e for e in events if e[0] == shard.name]
        assert [e[1:] for e in mine[-2:]] == [("fsync", hidden.name), ("manifest", f"{shard.name}.json")]
        for name in names:
            assert at[(shard.name, "fsync", name)] < at[(shard.name, "fsync", hidden.name)]
            assert any(e[1:] == ("hash", name) and at[e] < at[(shard.name, "fsync", name)] for e in events)
        assert shard_complete(tmp_path / "shards" / f"{shard.name}.json", "k1", hidden, rehash_changed=True)


@pytest.fixture
def fake_vllm(tmp_path):
    """A stand-in for the extraction server's HTTP API (aiohttp, in a thread): writes each prompt's file into
    `staging` as the connector would and answers with its path; checks the API key; `bad_echo` answers with other
    prompt ids."""
    import asyncio
    import socket

    from aiohttp import web

    state = {"staging": tmp_path / "staging", "bad_echo": False, "auth": [], "n": 0, "keys": []}
    state["staging"].mkdir()
    state["written"] = {}

    async def completions(request):
        state["auth"].append(request.headers.get("Authorization"))
        body = await request.json()
        ids = body["prompt"]
        assert body["max_tokens"] == 1 and body["return_token_ids"] is True
        state["n"] += 1
        # As Eyrie's connector: the key the request names rides in the file's name to the writer, which records it.
        key = (body.get("kv_transfer_params") or {}).get(SAMPLE_KEY)
        state["keys"].append(key)
        path = state["staging"] / name_with_key(f"cmpl-{state['n']}.safetensors", key)
        tensors = {"hidden_states": fake_hidden(ids), "token_ids": torch.tensor(ids)}
        save_file(tensors, str(path), metadata=key_metadata(key_from_name(str(path))))
        state["written"][path.name] = hashlib.sha256(path.read_bytes()).hexdigest()
        echo = ids[::-1] if state["bad_echo"] else ids
        return web.json_response(
            {
                "choices": [{"text": "", "prompt_token_ids": echo}],
                "kv_transfer_params": {"hidden_states_path": str(path)},
            }
        )

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    state["url"] = f"http://127.0.0.1:{port}"
    yield state
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    t.join(10)


def test_server_client_extracts_on_one_asyncio_session(prepared, tmp_path, fake_vllm):
    """ServerClient's own path (async_extractor): every sample sent with the API key, answered, checked and vouched
    for; an answer echoing other prompt ids fails the shard, and no manifest vouches for it."""
    from eyrie.vllm.client import ServerClient

    client = ServerClient(fake_vllm["url"], "secret", 10)
    shard, hidden, manifest, m = _run(prepared, tmp_path, client)
    assert m["extracted_samples"] == 6 and fake_vllm["n"] == 6
    assert set(fake_vllm["auth"]) == {"Bearer secret"}
    # Each request named the key its file is made under; the server's files carried it and were kept as written.
    assert fake_vllm["keys"] == ["k1"] * 6 and all(".key-k1." in name for name in fake_vllm["written"])
    assert sorted(r["sha256"] for r in m["files"].values()) == sorted(fake_vllm["written"].values())
    assert {file_key(sample_path(hidden, i)) for i in range(shard.start, shard.stop)} == {"k1"}
    assert shard_complete(manifest, "k1", hidden, rehash_changed=True)
    assert not list(fake_vllm["staging"].iterdir())
    fake_vllm["bad_echo"] = True
    with pytest.raises(ExtractionError, match="different prompt token ids"):
        _run(prepared, tmp_path, client, shard_no=0)
    assert not (tmp_path / "shards" / f"{load_shards(prepared)[0].name}.json").exists()


def test_checked_record_is_load_checked_and_file_record_in_one_read(tmp_path):
    from eyrie.stages.extract.manifest import checked_record, file_record

    ids = [5, 6, 7, 8]
    p = tmp_path / "a.safetensors"
    save_file({"hidden_states": fake_hidden(ids), "token_ids": torch.tensor(ids)}, str(p))
    assert checked_record(p, ids, LAYERS, HIDDEN) == file_record(p, len(ids))
    with pytest.raises(ValueError, match="token ids differ"):
        checked_record(p, [5, 6, 7, 9], LAYERS, HIDDEN)
    p.write_bytes(p.read_bytes()[:-10])
    with pytest.raises(ValueError, match="unreadable"):
        checked_record(p, ids, LAYERS, HIDDEN)


def test_checked_record_writes_the_key_into_a_file_that_lacks_it(tmp_path):
    """A server file without the key (a connector that records none, a test double) gets it from memory, tensors
    unchanged, and is recorded as it is then; one that carries it is not written again."""
    from eyrie.stages.extract.manifest import checked_record, file_record

    ids = [5, 6, 7, 8]
    tensors = {"hidden_states": fake_hidden(ids), "token_ids": torch.tensor(ids)}
    bare, keyed = tmp_path / "bare.safetensors", tmp_path / "keyed.safetensors"
    save_file(tensors, str(bare), metadata={"other": "kept"})
    save_file(tensors, str(keyed), metadata=key_metadata("k1"))
    before = keyed.read_bytes(), keyed.stat().st_mtime_ns
    assert checked_record(keyed, ids, LAYERS, HIDDEN, key="k1") == file_record(keyed, len(ids))
    assert (keyed.read_bytes(), keyed.stat().st_mtime_ns) == before
    raw = bare.read_bytes()
    rec = checked_record(bare, ids, LAYERS, HIDDEN, key="k1")
    assert rec == file_record(bare, len(ids)) and file_key(bare) == "k1"
    with safe_open(str(bare), "pt") as f:
        assert f.metadata() == {"other": "kept", SAMPLE_KEY: "k1"}
    assert all(torch.equal(v, load_file(str(bare))[k]) for k, v in tensors.items())
    new = bare.read_bytes()

    def data(b: bytes) -> bytes:
        return b[8 + int.from_bytes(b[:8], "little") :]

    assert data(new) == data(raw) and len(new) > len(raw)  # the same tensor bytes, after a new header


def test_a_key_rides_in_a_server_file_name_only_when_it_is_one():
    """The connector's scheduler names the file after the key a request names; its writer reads it back. A value
    that could steer the path (or no key) leaves the name as it was."""
    name = "eyrie-0f.safetensors"
    assert key_from_name("/s/" + name_with_key(name, "a1b2c3d4e5f60718")) == "a1b2c3d4e5f60718"
    for bad in (None, "", "../x", "a/b", "k" * 65, 7, "a.b"):
        assert name_with_key(name, bad) == name
    assert key_from_name("/s/" + name) is None and key_from_name("/s/x.key-.safetensors") is None
    assert ServerClient._extract_body([1, 2], "k1")["kv_transfer_params"] == {SAMPLE_KEY: "k1"}
    assert "kv_transfer_params" not in ServerClient._extract_body([1, 2])


def test_a_disk_full_when_the_manifest_is_written_is_a_disk_full_error(prepared, tmp_path, monkeypatch):
    """Every sample saved, then no room for the manifest (a disk filled meanwhile): the shard fails as a full disk
    (not retried by the task, told to free space), and a file the server never wrote is a bad file."""
    import errno

    import eyrie.stages.extract
    from eyrie.errors import DiskFullError
    from eyrie.stages.extract.manifest import checked_record

    def full(*_a, **_k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(eyrie.stages.extract.shard, "write_manifest", full)
    with pytest.raises(DiskFullError, match="free space and run again"):
        _run(prepared, tmp_path, FakeClient(tmp_path / "staging"))
    with pytest.raises(ValueError, match="unreadable"):
        checked_record(tmp_path / "never-written.safetensors", [1], LAYERS, HIDDEN)
