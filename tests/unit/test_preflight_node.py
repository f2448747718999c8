"""Refused before anything loads (issue 22, item 7): more training GPUs than the node has, a /dev/shm too small for
online training's samples in flight, a run folder whose flock is node-local or absent, and a vLLM model class that
exists but fails to import (named with its import error, not "no model class")."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from eyrie.config import parse_config
from eyrie.stages.preflight.check import run_preflight
from eyrie.stages.preflight.node import check_lock_filesystem, check_online_tmpfs, check_train_devices, mount_of
from eyrie.stages.preflight.target import probe_eagle3

BASE = {"target": {"model": "m"}, "data": {"source": "d"}}


def _config(**sections):
    return parse_config({**BASE, **sections})


def _train_target(config):
    return config.train, config.target


def test_train_devices_beyond_the_gpus_present_are_refused():
    assert check_train_devices(*_train_target(_config(train={"devices": 8})), gpus=8) == []
    [msg] = check_train_devices(*_train_target(_config(train={"devices": 8})), gpus=4)
    assert "train.devices 8 need 8 GPUs, but 4 are visible" in msg
    # Online, the extraction server keeps its GPUs while the trainer runs.
    online = _config(train={"devices": 4, "hidden_states": "online"}, target={"model": "m", "tensor_parallel_size": 8})
    [msg] = check_train_devices(online.train, online.target, gpus=8)
    assert "need 12 GPUs, but 8 are visible" in msg and "online" in msg
    assert check_train_devices(*_train_target(_config(train={"device": "cpu", "devices": 1})), gpus=0) == []
    # A host with no GPU at all (a login node checking a GPU config) is not judged: the GPU node's preflight is.
    assert check_train_devices(*_train_target(_config(train={"device": "cuda", "devices": 8})), gpus=0) == []


def test_train_devices_are_counted_on_this_machine(tiny_llama, tmp_path, monkeypatch):
    """run_preflight counts the GPUs itself: one more than are here is refused (on a CPU host, as if it had one)."""
    import eyrie.stages.preflight.node as preflight

    n = preflight.gpu_count()
    if n == 0:
        monkeypatch.setattr(preflight, "gpu_count", lambda: 1)
    train = {"device": "cuda", "devices": max(n, 1) + 1}
    config = parse_config({"target": {"model": str(tiny_llama)}, "data": {"source": "d"}, "train": train})
    report = run_preflight(config, tmp_path / "run", raise_on_failure=False, serve=False)
    assert any(f"{max(n, 1)} are visible here" in f for f in report.failures)


MOUNTS = textwrap.dedent(
    """\
    /dev/sda1 / ext4 rw,relatime 0 0
    tmpfs /dev/shm tmpfs rw,nosuid,nodev,size=65536k 0 0
    10.0.0.1@o2ib:/lus /lustre/good lustre rw,flock,lazystatfs 0 0
    10.0.0.1@o2ib:/lus /lustre/local lustre rw,localflock,lazystatfs 0 0
    10.0.0.1@o2ib:/lus /lustre/none lustre rw,lazystatfs 0 0
    nas:/export /nfs/good nfs4 rw,vers=4.2,hard,proto=tcp 0 0
    nas:/export /nfs/nolock nfs rw,vers=3,nolock,proto=tcp 0 0
    nas:/export /nfs/locallock nfs rw,vers=3,local_lock=flock 0 0
    nas:/export /mnt/with\\040space nfs rw,vers=3,nolock 0 0
    """
)


@pytest.mark.parametrize(
    "path,refused",
    [
        ("/lustre/good/runs/a", None),
        ("/lustre/local/runs/a", "localflock"),
        ("/lustre/none/runs/a", "without `flock`"),
        ("/nfs/good/runs/a", None),
        ("/nfs/nolock/runs/a", "nolock"),
        ("/nfs/locallock/runs/a", "local_lock"),
        ("/mnt/with space/runs/a", "nolock"),
        ("/home/u/runs/a", None),
    ],
)
def test_a_run_folder_whose_flock_is_node_local_or_absent_is_refused(path, refused):
    failures = check_lock_filesystem(Path(path), MOUNTS)
    if refused is None:
        assert failures == []
    else:
        [msg] = failures
        assert refused in msg and "run lock" in msg and "--run-dir" in msg


def test_the_mount_of_a_real_folder_is_read_from_proc_mounts(tmp_path):
    point, fstype, options = mount_of(tmp_path / "not" / "yet")  # type: ignore[misc]
    assert tmp_path.as_posix().startswith(point) and fstype and options
    assert check_lock_filesystem(tmp_path) == []  # this machine's disk: a local filesystem


def test_dev_shm_too_small_for_online_samples_in_flight_is_refused(tmp_path, monkeypatch):
    import shutil

    monkeypatch.setenv("EYRIE_ONLINE_TMPFS", str(tmp_path))
    online = _config(
        train={"hidden_states": "online"}, data={"source": "d", "max_length": 8192}, extraction={"concurrency": 16}
    )
    per_sample = 8192 * 4 * 7168 * 2  # Kimi-K2.5's width, four captured layers: 448 MiB a sample
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=per_sample * 31))
    [msg] = check_online_tmpfs(online.train, online.data, online.extraction, tmp_path / "run", 4, 7168)
    assert "32 samples of up to 448 MiB" in msg and "EYRIE_ONLINE_TMPFS" in msg
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=per_sample * 33))
    assert check_online_tmpfs(online.train, online.data, online.extraction, tmp_path / "run", 4, 7168) == []
    offline = _config()
    assert (
        check_online_tmpfs(offline.train, offline.data, offline.extraction, tmp_path / "run", 4, 7168) == []
    )  # offline: no tmpfs used


def test_a_model_class_whose_module_fails_to_import_is_named_with_the_error(tmp_path, monkeypatch):
    """A class vLLM registers whose module needs a missing package (a multimodal wrapper's, say) was reported as
    'the installed vLLM has no model class'."""
    from vllm.model_executor.models.registry import ModelRegistry

    (tmp_path / "eyrie_test_broken_model.py").write_text(
        "import eyrie_test_missing_package  # noqa\n\nclass EyrieBrokenForCausalLM: ...\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    ModelRegistry.register_model("EyrieBrokenForCausalLM", "eyrie_test_broken_model:EyrieBrokenForCausalLM")
    try:
        probe = probe_eagle3({"architectures": ["EyrieBrokenForCausalLM"]})
    finally:
        ModelRegistry.models.pop("EyrieBrokenForCausalLM", None)
    assert probe.path == "unsupported"
    assert "has a model class for EyrieBrokenForCausalLM, but its module fails to import" in probe.reason
    assert "eyrie_test_missing_package" in probe.reason and "install the missing package" in probe.reason
    assert probe_eagle3({"architectures": ["NoSuchArchForCausalLM"]}).reason == (
        "the installed vLLM has no model class for NoSuchArchForCausalLM"
    )


def test_a_host_with_no_gpu_device_node_counts_no_gpu_without_torch(tmp_path):
    """No /dev/nvidia<N> and no /dev/kfd: no GPU torch could see, so none is counted (torch is not imported for it)."""
    import eyrie.stages.preflight.node as node

    dev = tmp_path / "dev"
    dev.mkdir()
    (dev / "null").touch()
    (dev / "nvidiactl").touch()  # the driver's control node is not a GPU
    assert node.gpu_count(dev) == 0
    (dev / "nvidia0").touch()
    import torch

    assert node.gpu_count(dev) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
