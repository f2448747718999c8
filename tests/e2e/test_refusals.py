"""Each class of target or config that would fail after the load is refused by `eyrie run` at preflight: exit code 2,
a message that names the problem and the fix, and no vLLM process started (no server recorded under the run folder,
no vLLM process naming it). The same targets pass `eyrie preflight`'s exit code 1 test in-process, in seconds."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import REPO, build_tiny_target, eyrie_run, write_config
from safetensors.torch import load_file, save_file

from eyrie.target.tiny.tokenizer import build_tokenizer
from flows.cli import main as eyrie_main


def _copy_llama(tmp_path: Path, name: str) -> Path:
    folder = tmp_path / name
    shutil.copytree(build_tiny_target("tiny-llama"), folder)
    return folder


def encoder_decoder(tmp_path: Path) -> tuple[Path, dict]:
    from transformers import WhisperConfig

    folder = tmp_path / "whisper"
    folder.mkdir()
    build_tokenizer(folder)
    cfg = WhisperConfig(
        vocab_size=512,
        d_model=64,
        encoder_layers=2,
        decoder_layers=8,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
    ).to_dict()
    (folder / "config.json").write_text(json.dumps({**cfg, "architectures": ["WhisperForConditionalGeneration"]}))
    (folder / "model.safetensors").write_bytes(b"never read")
    return folder, {}


def other_tensor_names(tmp_path: Path) -> tuple[Path, dict]:
    """A Llama config over a checkpoint whose embedding is stored under another name: the trainer would die with
    KeyError 'embed_tokens.weight' after extraction."""
    folder = _copy_llama(tmp_path, "renamed")
    weights = load_file(str(folder / "model.safetensors"))
    weights["tok_emb.weight"] = weights.pop("model.embed_tokens.weight")
    save_file(weights, str(folder / "model.safetensors"))
    return folder, {}


def no_room_for_the_generated_token(tmp_path: Path) -> tuple[Path, dict]:
    return build_tiny_target("tiny-llama"), {"max_model_len": 256}  # == data.max_length


def unbuildable_drafter(tmp_path: Path) -> tuple[Path, dict]:
    folder = _copy_llama(tmp_path, "odd-heads")
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(num_attention_heads=3, num_key_value_heads=3)
    del cfg["head_dim"]
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder, {}


REFUSALS = {
    "encoder-decoder": (
        encoder_decoder,
        [
            "WhisperForConditionalGeneration is an encoder-decoder model",
            "Fix: point target.model at a decoder-only text-generation model",
        ],
    ),
    "tensor names": (
        other_tensor_names,
        ["checkpoint has no tensor for the input embedding `model.embed_tokens.weight`"],
    ),
    "max_model_len": (
        no_room_for_the_generated_token,
        ["target.max_model_len 256 leaves no room", "set target.max_model_len to at least 257"],
    ),
    "drafter layer": (
        unbuildable_drafter,
        ["the drafter's decoder layer cannot be shaped", "not a multiple of the number of attention heads (3)"],
    ),
}


def _eyrie_run(config: Path, run: Path) -> subprocess.CompletedProcess:
    """`eyrie run` as a user types it; it must fail as a usage error (exit 2)."""
    out = subprocess.run(
        eyrie_run(config, run),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert out.returncode == 2, (out.stdout + out.stderr)[-3000:]
    return out


def _vllm_processes_for(run: Path) -> list[str]:
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "vllm" in line and str(run) in line]


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_preflight_command_refuses(case, tmp_path, capsys):
    make, messages = REFUSALS[case]
    target, config_keys = make(tmp_path)
    config, _ = write_config(tmp_path / "config.yaml", target, **config_keys)
    assert eyrie_main(["preflight", "--config", str(config), "--run-dir", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err
    assert all(m in err for m in messages), err


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.usefixtures("flow_api")
@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_run_refuses_before_any_server_starts(case, tmp_path):
    make, messages = REFUSALS[case]
    target, config_keys = make(tmp_path)
    config, _ = write_config(tmp_path / "config.yaml", target, **config_keys)
    run = tmp_path / "run"
    out = _eyrie_run(config, run)
    assert "eyrie: error: preflight failed" in out.stderr and "no weights were loaded" in out.stderr
    assert all(m in out.stderr for m in messages), out.stderr[-3000:]
    # The problems once, in the error printed last; Prefect's lines about the failed runs carry no traceback.
    assert "Traceback" not in out.stderr and out.stderr.count(messages[0]) == 1, out.stderr[-3000:]
    assert json.loads((run / "preflight.json").read_text())["failures"]
    assert not list(run.rglob("server.json")) and not (run / "extract").exists()
    assert _vllm_processes_for(run) == []


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.usefixtures("flow_api")
def test_nothing_held_out_is_refused_before_extraction(tmp_path, tiny_llama):
    """With no held-out conversation there is nothing to evaluate on: known once prepare has run, so the run stops
    there, not after extraction and training."""
    config, _ = write_config(tmp_path / "config.yaml", tiny_llama, data={"eval_fraction": 0.0})
    run = tmp_path / "run"
    out = _eyrie_run(config, run)
    assert "no held-out conversations to evaluate on" in out.stderr and "--until train" in out.stderr
    assert (run / "prepare" / "manifest.json").exists()  # prepare's work is kept for the next run
    assert not (run / "extract").exists() and _vllm_processes_for(run) == []
