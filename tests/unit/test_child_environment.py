"""Secrets stay where they belong (issue 22, item 6): vLLM servers and the trainer get an allow-listed environment,
and online training's tmpfs folder is this user's alone, never one planted at its predictable name."""

from __future__ import annotations

import json
import os
import sys

import pytest

from eyrie.config import parse_config
from eyrie.errors import RunFolderError
from eyrie.hidden_states.staging import clean, staging_dir, transient_files
from eyrie.run.environment import PASS_ENV, child_environment
from eyrie.run.files import private_dir
from eyrie.stages.train.trainer import trainer_environment
from eyrie.vllm.process import VllmServer
from eyrie.vllm.spec import CPU_KV_CACHE_ENV, ServerSpec, vllm_cpu_build

SECRETS = {
    "PREFECT_API_KEY": "pnu_secret",
    "PREFECT_API_AUTH_STRING": "admin:pass",
    "PREFECT_API_URL": "http://prefect:4200/api",
    "HF_TOKEN": "hf_secret",
    "HUGGING_FACE_HUB_TOKEN": "hf_secret2",
    "AWS_SECRET_ACCESS_KEY": "aws",
    "VLLM_API_KEY": "a key of the flow's own",
    "DATABASE_URL": "postgresql://u:p@db/x",
}
NEEDED = {
    "PATH": "/usr/bin",
    "HOME": "/home/u",
    "CUDA_VISIBLE_DEVICES": "0,1",
    "NCCL_SOCKET_IFNAME": "ib0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HOME": "/cache/hf",
    "HF_HUB_OFFLINE": "1",
    "TORCHINDUCTOR_CACHE_DIR": "/cache/inductor",
    "LD_LIBRARY_PATH": "/usr/local/cuda/lib64",
    "OMP_NUM_THREADS": "4",
    "EYRIE_FAULTS": "extract.shard-00001",
}


def test_the_allow_list_keeps_what_the_stack_needs_and_no_secret():
    env = child_environment({"EXTRA": "x"}, environ={**SECRETS, **NEEDED})
    assert env == {**NEEDED, "EXTRA": "x"}


def test_the_operator_passes_a_named_variable_such_as_the_hub_token():
    env = child_environment(environ={**SECRETS, **NEEDED, PASS_ENV: "HF_TOKEN, SITE_VAR", "SITE_VAR": "s"})
    assert env["HF_TOKEN"] == "hf_secret" and env["SITE_VAR"] == "s"
    assert "PREFECT_API_KEY" not in env and "HUGGING_FACE_HUB_TOKEN" not in env


def test_the_trainer_gets_the_allow_list_and_online_the_servers_key_variable(monkeypatch):
    for k, v in {**SECRETS, **NEEDED, "MY_KEY": "k"}.items():
        monkeypatch.setenv(k, v)
    base = {"target": {"model": "m"}, "data": {"source": "d"}, "extraction": {"api_key_env": "MY_KEY"}}
    offline = trainer_environment(parse_config(base), "cpu", online=False)
    assert not set(SECRETS) & set(offline) and "MY_KEY" not in offline
    assert offline["CUDA_VISIBLE_DEVICES"] == "0,1" and "EYRIE_TRAIN_DEVICE" not in offline  # in its options file
    online = trainer_environment(parse_config({**base, "train": {"hidden_states": "online"}}), "cpu", online=True)
    assert online["MY_KEY"] == "k" and not set(SECRETS) & set(online)


class DumpEnv(ServerSpec):
    """A 'server' that writes its environment and exits: what VllmServer.launch really hands the process."""

    def command(self, port: int) -> list[str]:
        code = "import json, os, sys; open(sys.argv[1], 'w').write(json.dumps(dict(os.environ)))"
        return [sys.executable, "-c", code, self.model]


def test_a_vllm_server_is_started_with_the_allow_list_its_env_and_its_key(tmp_path, monkeypatch):
    for k, v in {**SECRETS, **NEEDED, "EYRIE_TEST_KEY": "the-servers-key"}.items():
        monkeypatch.setenv(k, v)
    out = tmp_path / "env.json"
    spec = DumpEnv(model=str(out), api_key_env="EYRIE_TEST_KEY", server_env={"VLLM_LOGGING_LEVEL": "DEBUG"})
    _, proc = VllmServer(tmp_path / "server").launch(spec, log=lambda *_: None)
    proc.wait(timeout=60)
    env = json.loads(out.read_text())
    assert not {"PREFECT_API_KEY", "PREFECT_API_AUTH_STRING", "HF_TOKEN", "AWS_SECRET_ACCESS_KEY"} & set(env)
    assert env["VLLM_API_KEY"] == "the-servers-key" and env["VLLM_LOGGING_LEVEL"] == "DEBUG"
    assert all(env[k] == v for k, v in NEEDED.items())


def test_on_vllms_cpu_build_a_server_whose_kv_cache_nobody_sized_gets_one_gib():
    """vLLM's CPU default reserves 92% of the machine's memory at start, which fails beside the flow: Eyrie gives the
    KV cache 1 GiB unless the operator sized it, by the variable, vLLM's flag or the memory fraction."""
    environ = {k: v for k, v in NEEDED.items() if k != CPU_KV_CACHE_ENV}
    spec = ServerSpec(model="m")
    assert spec.environment(environ, cpu_build=True)[CPU_KV_CACHE_ENV] == "1"
    assert CPU_KV_CACHE_ENV not in spec.environment(environ, cpu_build=False)  # a GPU build sizes its own
    assert spec.environment({**environ, CPU_KV_CACHE_ENV: "8"}, cpu_build=True)[CPU_KV_CACHE_ENV] == "8"
    assert spec.environment({**environ, CPU_KV_CACHE_ENV: ""}, cpu_build=True)[CPU_KV_CACHE_ENV] == "1"  # vLLM: unset
    sized = [
        ServerSpec(model="m", server_env={CPU_KV_CACHE_ENV: "4"}),
        ServerSpec(model="m", gpu_memory_utilization=0.5),
        ServerSpec(model="m", server_args=["--kv-cache-memory-bytes", "2G"]),
        ServerSpec(model="m", server_args=["--kv-cache-memory-bytes=2G"]),
    ]
    assert [s.environment(environ, cpu_build=True).get(CPU_KV_CACHE_ENV) for s in sized] == ["4", None, None, None]


@pytest.mark.parametrize(
    "versions, cpu",
    [({"vllm-cpu": "0.32.0"}, True), ({"vllm": "0.32.0+cpu"}, True), ({"vllm": "0.32.0"}, False), ({}, False)],
)
def test_vllms_cpu_build_is_told_by_its_distribution_or_its_version(versions, cpu):
    from eyrie.run.vllm_env_facts import cpu_build

    assert any(cpu_build(name, version) for name, version in versions.items()) is cpu
    assert vllm_cpu_build() is cpu_build(*_installed_vllm())  # the installed one, told the same way


def _installed_vllm() -> tuple[str, str]:
    from importlib import metadata

    for name in ("vllm-cpu", "vllm"):
        try:
            return name, metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return "", ""


def test_the_online_staging_folder_is_private_and_a_planted_one_is_refused(tmp_path):
    tmpfs = tmp_path / "shm"
    tmpfs.mkdir()
    staging = staging_dir(tmp_path / "run", tmpfs=str(tmpfs))
    assert private_dir(staging) and (staging.stat().st_mode & 0o777) == 0o700
    # A symlink planted at the predictable name (to make the trainer's start-up clean another folder) is refused.
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "theirs.safetensors").write_text("x")
    other = staging_dir(tmp_path / "other-run", tmpfs=str(tmpfs))
    other.symlink_to(victim)
    with pytest.raises(RunFolderError, match="is a symlink"):
        private_dir(other)
    with pytest.raises(RunFolderError, match="is a symlink"):
        clean(other)
    assert (victim / "theirs.safetensors").exists()
    # An older Eyrie's folder (0755) is narrowed; one of another user is refused (as root here, chown makes one).
    wide = tmpfs / "wide"
    wide.mkdir(mode=0o755)
    assert private_dir(wide) and (wide.stat().st_mode & 0o777) == 0o700
    assert transient_files(tmpfs / "missing") == []
    if os.getuid() == 0:
        foreign = tmpfs / "foreign"
        foreign.mkdir()
        os.chown(foreign, 12345, 12345)
        with pytest.raises(RunFolderError, match="a folder of another user \\(uid 12345\\)"):
            private_dir(foreign)


def test_the_servers_staging_folder_is_made_private_at_launch(tmp_path):
    out = tmp_path / "env.json"
    staging = tmp_path / "shm" / "eyrie-online-x"
    spec = DumpEnv(model=str(out), storage_path=str(staging), layer_ids=[1])
    _, proc = VllmServer(tmp_path / "server").launch(spec, log=lambda *_: None)
    proc.wait(timeout=60)
    assert (staging.stat().st_mode & 0o777) == 0o700


def test_a_runs_children_get_the_environment_of_its_start_not_what_imports_wrote_since(tmp_path, monkeypatch):
    """Importing vLLM in the flow's process sets TORCHINDUCTOR_COMPILE_THREADS=1, PYTORCH_NVML_BASED_CUDA_CHECK,
    TRITON_CACHE_AUTOTUNING and TORCHINDUCTOR_CACHE_DIR: a trainer started after it compiled on one thread. Whatever
    holds the run folder (the pipeline, an extraction, a node's share) is a run: its children get the environment of
    the moment it took the folder; a nested hold keeps the outer one."""
    from eyrie.run.folder import RunFolder

    written = {
        "TORCHINDUCTOR_COMPILE_THREADS": "1",
        "PYTORCH_NVML_BASED_CUDA_CHECK": "1",
        "TRITON_CACHE_AUTOTUNING": "1",
        "TORCHINDUCTOR_CACHE_DIR": "/tmp/elsewhere",
    }
    for k in written:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    config = parse_config({"target": {"model": "m"}, "data": {"source": "d"}})
    run = RunFolder(tmp_path / "run")
    with run.lock():
        for k, v in written.items():
            monkeypatch.setenv(k, v)  # what `import vllm` does, in this process
        trainer = trainer_environment(config, "cpu", online=False)
        server = ServerSpec(model="m").environment(cpu_build=False)
        assert not set(written) & set(trainer) and not set(written) & set(server)
        assert trainer["OMP_NUM_THREADS"] == "4" == server["OMP_NUM_THREADS"]
    assert all(child_environment()[k] == v for k, v in written.items())  # no run holds a folder: as it is now
    for k in written:
        monkeypatch.delenv(k)
    with RunFolder(tmp_path / "share").share_lock("extract", ["shard-00000"], "n1", "a test"):
        monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")
        with RunFolder(tmp_path / "other").lock():  # nested: the outer start holds
            assert "TORCHINDUCTOR_COMPILE_THREADS" not in child_environment()
