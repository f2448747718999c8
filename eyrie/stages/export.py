"""export: the final drafter in speculators' format, checked against the extraction and the installed vLLM.

The checkpoint's `eagle_aux_hidden_state_layer_ids` must be exactly the ids extraction captured (minus the last
layer), its verifier must point at the target, and every norm flag it sets must be one the installed vLLM reads
(older vLLMs silently ignore some, which silently costs acceptance). Then vLLM loads target + drafter as `eagle3`
and generates: that is the proof the export is servable.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from eyrie.errors import EyrieError
from eyrie.run.faults import fault_point
from eyrie.run.files import atomic_write_json, located, portable
from eyrie.run.manifest import files_under, finished_manifest, list_files
from eyrie.target.metadata import verifier_name

NORM_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
KEEP = ("config.json", "model.safetensors", "config.py")


def flags_vllm_reads() -> set[str]:
    """The speculators config keys the EAGLE-3 config adapter of the vLLM that serves reads: this environment's, or
    asked of the interpreter $EYRIE_VLLM_PYTHON names (`eyrie.run.vllm_python.probe`), never imported here then."""
    from eyrie.run.vllm_python import one_environment, probe

    if not one_environment():
        return set(probe("drafter_flags")["flags"])
    from vllm.transformers_utils.configs.speculators import algos

    return set(re.findall(r'config_dict\.get\(\s*"(\w+)"', Path(algos.__file__).read_text()))


def check_drafter_config(cfg: dict, aux_ids: list[int], target_hidden_size: int) -> list[str]:
    problems = []
    if cfg.get("speculators_model_type") != "eagle3":
        problems.append(f"speculators_model_type is {cfg.get('speculators_model_type')!r}, expected 'eagle3'")
    if list(cfg.get("eagle_aux_hidden_state_layer_ids") or []) != list(aux_ids):
        problems.append(
            f"eagle_aux_hidden_state_layer_ids {cfg.get('eagle_aux_hidden_state_layer_ids')} differ "
            f"from the ids extraction captured {aux_ids}: the drafter would read other layers"
        )
    read = flags_vllm_reads()
    ignored = [f for f in NORM_FLAGS if cfg.get(f) and f not in read]
    if ignored:
        problems.append(
            f"the drafter sets {ignored}, which the installed vLLM does not read: upgrade vLLM or train "
            "without those flags"
        )
    hidden = cfg.get("target_hidden_size") or cfg.get("transformer_layer_config", {}).get("hidden_size")
    if hidden != target_hidden_size:
        problems.append(f"target hidden size {hidden} differs from the target's {target_hidden_size}")
    return problems


def export_key(config, train_key: str, aux_ids: list[int], server: str) -> str:
    """What the exported drafter and its vLLM proof are made of (`eyrie.run.identity.STAGES["export"]`): the
    trained checkpoint, the captured layers, the verifier it names, and what the proving server computes (`server`:
    its `ServerSpec.output_identity`: target identity, output-shaping arguments, vLLM version, draft tokens)."""
    from eyrie.target.metadata import stage_key

    return stage_key("export", config, train=train_key, aux=list(aux_ids), server=server)


def export_drafter(
    checkpoint: Path, out_dir: Path, target_model: str, aux_ids: list[int], target_hidden_size: int, key: str
) -> dict:
    """Copy the checkpoint's servable files into `out_dir/drafter`, verifier pointed at the target."""
    cfg = json.loads((checkpoint / "config.json").read_text())
    verifier = verifier_name(target_model)
    cfg.setdefault("speculators_config", {}).setdefault("verifier", {})["name_or_path"] = verifier
    cfg["target_hidden_size"] = target_hidden_size
    problems = check_drafter_config(cfg, aux_ids, target_hidden_size)
    if problems:
        raise EyrieError(f"the trained checkpoint {checkpoint} cannot be exported: " + "; ".join(problems))
    staging = out_dir / "drafter.staging"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for name in KEEP:
        if (checkpoint / name).exists() and name != "config.json":
            shutil.copy2(checkpoint / name, staging / name)
    atomic_write_json(staging / "config.json", cfg)
    drafter = out_dir / "drafter"
    shutil.rmtree(drafter, ignore_errors=True)
    staging.rename(drafter)
    manifest = {
        "stage": "export",
        "key": key,
        "drafter": str(drafter),  # recorded relative to out_dir (`export_and_prove`)
        "checkpoint": str(checkpoint),
        "verifier": verifier,
        "eagle_aux_hidden_state_layer_ids": aux_ids,
        "norm_flags": {f: cfg.get(f) for f in NORM_FLAGS},
        "files": list_files(out_dir, files_under(drafter)),
    }
    return manifest  # the caller adds the vLLM proof, then writes it


def placed(manifest: dict, out_dir: Path) -> dict:
    """The export manifest with its paths under the folder's current place: the drafter is always `<out_dir>/drafter`
    (its files are listed relative to `out_dir` and checked there), whatever an older manifest recorded."""
    checkpoint = located(manifest.get("checkpoint"), out_dir)
    return {**manifest, "drafter": str(out_dir.absolute() / "drafter"), "checkpoint": checkpoint}


def recorded(manifest: dict, out_dir: Path) -> dict:
    """The export manifest as written: its paths relative to `out_dir` (`portable`), so a moved run folder is
    reused whole."""
    return {
        **manifest,
        "drafter": portable(manifest["drafter"], out_dir),
        "checkpoint": portable(manifest["checkpoint"], out_dir),
    }


def export_and_prove(
    checkpoint: Path,
    out_dir: Path,
    target_model: str,
    aux_ids: list[int],
    target_hidden_size: int,
    key: str,
    serve: Callable[[str], object],
    probe: list[dict],
) -> dict:
    """Export, then prove vLLM serves the drafter (`serve(drafter_dir)` returns a client); the manifest, written
    last, records the proof. A finished export with the same key is returned as it is."""
    if manifest := finished_manifest(out_dir / "manifest.json", key):  # written last, with the proof
        return placed(manifest, out_dir)
    started = time.monotonic()
    manifest = export_drafter(checkpoint, out_dir, target_model, aux_ids, target_hidden_size, key)
    fault_point("export.before-proof")
    manifest["vllm_proof"] = prove_servable(serve(manifest["drafter"]), probe)
    manifest["seconds"] = round(time.monotonic() - started, 1)  # the stage's own time, its server's start included
    atomic_write_json(out_dir / "manifest.json", recorded(manifest, out_dir))
    return placed(manifest, out_dir)


def prove_servable(client, prompt: list[dict], max_tokens: int = 16) -> dict:
    """One greedy chat completion from target + drafter: the drafter loaded and speculation ran."""
    out = client.chat(prompt, max_tokens)
    return {
        "prompt": prompt,
        "completion": out["choices"][0]["message"]["content"],
        "completion_tokens": out["usage"]["completion_tokens"],
    }
