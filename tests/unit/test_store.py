"""The run folder: one holder at a time, a stamp that refuses folders of another format, atomic writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO

from eyrie import FORMAT_VERSION
from eyrie.errors import RunFolderError
from eyrie.run.files import atomic_write_json, read_json
from eyrie.run.folder import STAMP, RunFolder, remove_staging

HOLDER = """
import sys
from eyrie.run.folder import RunFolder
with RunFolder(sys.argv[1]).lock():
    print("locked", flush=True)
    sys.stdin.readline()
"""


def test_lock_refuses_a_second_holder(tmp_path):
    run = RunFolder(tmp_path / "run")
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(run.root)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RunFolderError) as info:
            with run.lock():
                pytest.fail("a second holder got the lock")
        msg = str(info.value)
        assert f"pid {holder.pid}" in msg and "--run-dir" in msg
    finally:
        holder.stdin.close()  # the holder exits and so releases the lock
        holder.wait(timeout=30)
    with run.lock():  # free again
        assert f"pid {os.getpid()}" in (run.root / ".eyrie.lock").read_text()


def test_lock_is_released_by_a_killed_holder(tmp_path):
    run = RunFolder(tmp_path / "run")
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(run.root)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    assert holder.stdout.readline().strip() == "locked"
    holder.kill()
    holder.wait(timeout=30)
    with run.lock():  # no stale lock to clean by hand
        pass


def test_lock_in_one_process_is_exclusive_too(tmp_path):
    run = RunFolder(tmp_path / "run")
    with run.lock():
        with pytest.raises(RunFolderError, match="is in use"):
            with run.lock():
                pass


def test_stamp_written_then_checked(tmp_path):
    run = RunFolder(tmp_path / "run")
    run.ensure()
    stamp = read_json(run.root / STAMP)
    assert stamp["format_version"] == FORMAT_VERSION
    run.ensure()  # a compatible folder is accepted again


def test_incompatible_stamp_refused(tmp_path):
    run = RunFolder(tmp_path / "run")
    run.root.mkdir()
    (run.root / STAMP).write_text(json.dumps({"format_version": FORMAT_VERSION + 98, "eyrie_version": "9.9"}))
    with pytest.raises(RunFolderError) as info:
        run.ensure()
    msg = str(info.value)
    assert f"format {FORMAT_VERSION + 98}" in msg and "9.9" in msg and "new --run-dir" in msg


def test_damaged_stamp_refused(tmp_path):
    run = RunFolder(tmp_path / "run")
    run.root.mkdir()
    (run.root / STAMP).write_text("{half a json")
    with pytest.raises(RunFolderError, match="unreadable"):
        run.ensure()


def test_atomic_json_and_staging_cleanup(tmp_path):
    RunFolder(tmp_path).ensure()
    path = tmp_path / "m" / "manifest.json"
    atomic_write_json(path, {"a": 1})
    assert read_json(path) == {"a": 1}
    assert read_json(tmp_path / "missing.json") is None
    path.write_text('{"a": ')  # a torn manifest is no manifest
    assert read_json(path) is None
    assert [p.name for p in path.parent.iterdir()] == ["manifest.json"]  # no temporary file left behind
    (path.parent / ".manifest.json.abc.eyrie-tmp").write_text("x")
    assert remove_staging(tmp_path) == 1
    assert not list(tmp_path.rglob("*.eyrie-tmp"))
