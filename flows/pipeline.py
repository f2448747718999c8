"""The end-to-end DAG: target -> preflight -> prepare -> preflight (disk) -> extract -> vocab -> train -> export
-> evaluate (trained drafter and an untrained one of the same shape)."""

from __future__ import annotations

import os
from contextlib import nullcontext
from itertools import islice
from typing import Literal

from prefect import flow, get_run_logger
from prefect.concurrency.sync import concurrency
from prefect.artifacts import create_markdown_artifact

from eyrie.config import PipelineConfig
from eyrie.data import iter_eval_prompts, load_seq_lens
from eyrie.errors import EyrieError
from eyrie.server import ServerSpec
from eyrie.store import RunFolder, remove_staging, sha256_json
from eyrie.train import train_key
from eyrie.vocab import mapping_paths, vocab_key
from flows.extract import extract_flow
from tasks.caching import unless_missing
from tasks.evaluate import evaluate_task, export_task, report_task
from tasks.prepare import compute_prepare_key, ensure_target, prepare_task
from tasks.preflight import preflight_task
from tasks.train import train_task, untrained_drafter_task, vocab_task


STAGES = ("prepare", "extract", "train", "evaluate")


@flow(name="eyrie-pipeline")
def pipeline_flow(config: PipelineConfig, run_dir: str, until: Literal[STAGES] = "evaluate") -> dict:
    """Run every stage up to and including `until` (evaluate: the whole pipeline)."""
    log = get_run_logger()
    run = RunFolder(run_dir)
    run.ensure()
    with run.lock(), gpu_slot():
        # Holding the lock, no writer is in flight here: a temporary file left by an atomic write is from a crash.
        removed = remove_staging(run.root)
        if removed:
            log.info(f"removed {removed} temporary files left by an interrupted run")
        ensure_target(config)
        preflight_task(config, str(run.root))  # seconds, before anything expensive
        pkey = compute_prepare_key(config)
        prepared = unless_missing(prepare_task, run.manifest("prepare"), pkey)(config, str(run.prepare), pkey)
        report = preflight_task(config, str(run.root), tokens=prepared["stats"]["tokens"])
        if until == "prepare":
            return {"run_dir": str(run.root), "prepared": str(run.prepare / "dataset")}
        extracted = extract_flow(config, str(run.root), report)
        if until == "extract":
            return {"run_dir": str(run.root), "prepared": str(run.prepare / "dataset"),
                    "hidden_states": extracted["hidden_states"], "shards": extracted["shards"]}

        dvs, aux = config.vocab.draft_vocab_size, report["aux_layer_ids"]
        vkey = vocab_key(prepared, dvs, report["vocab_size"])
        token_freq = str(run.prepare / "dataset" / "token_freq.pt")
        unless_missing(vocab_task, run.manifest("vocab"), vkey)(token_freq, dvs, report["vocab_size"],
                                                               str(run.vocab), vkey)
        d2t, t2d = (str(p) for p in mapping_paths(run.vocab, dvs))
        data = (str(run.prepare / "dataset"), str(run.hidden_states), d2t, t2d, aux)
        tkey = train_key(config, extracted["keys"], vkey, aux)
        trained = unless_missing(train_task, run.manifest("train"), tkey)(config, str(run.train), tkey, *data,
                                                                          load_seq_lens(run.prepare))
        untrained = untrained_drafter_task(config, str(run.train), *data)
        if until == "train":
            return {"run_dir": str(run.root), "checkpoint": trained["checkpoint"], "untrained": untrained}

        spec = ServerSpec.from_config(config, num_speculative_tokens=config.evaluate.num_speculative_tokens)
        prompts = list(islice(iter_eval_prompts(run.prepare), config.evaluate.num_prompts))
        if not prompts:
            raise EyrieError("no held-out prompts to evaluate on: set data.eval_fraction above 0")
        ekey = sha256_json([tkey, aux, spec.fingerprint()])[:16]
        timeout = config.extraction.startup_timeout_s
        exported = unless_missing(export_task, run.manifest("export"), ekey)(
            trained["checkpoint"], str(run.export), config.target.model, aux, report["hidden_size"], ekey, spec,
            prompts[0], timeout)
        results = []
        for label, drafter, server_dir in (("trained", exported["drafter"], run.export / "server-trained"),
                                           ("untrained", untrained, run.evaluate / "server-untrained")):
            key = sha256_json([label, ekey, config.evaluate.model_dump(), prompts])[:16]
            out = run.evaluate / f"{label}.json"
            results.append(unless_missing(evaluate_task, out, key)(
                label, drafter, spec, str(server_dir), prompts, config.evaluate.max_tokens, str(out), key, timeout))
        summary = report_task(results, str(run.evaluate))

    outputs = {"run_dir": str(run.root), "drafter": exported["drafter"],
               "acceptance_length": summary["trained"]["acceptance_length"],
               "untrained_acceptance_length": summary["untrained"]["acceptance_length"],
               "hidden_states": extracted["hidden_states"], "evaluation": str(run.evaluate)}
    create_markdown_artifact(_summary_markdown(config, outputs, summary), key="run-summary")
    log.info(f"outputs: {outputs}")
    return outputs


def gpu_slot():
    """On a production server (EYRIE_GPU_LIMIT names the global concurrency limit `deployments.setup` creates), hold
    the GPU node's one slot; strict, so a missing limit is an error and never silently unlimited."""
    limit = os.environ.get("EYRIE_GPU_LIMIT")
    return concurrency(limit, occupy=1, strict=True) if limit else nullcontext()


def _summary_markdown(config: PipelineConfig, outputs: dict, summary: dict) -> str:
    t, u = summary["trained"], summary["untrained"]
    return "\n".join([
        f"# Eyrie run `{config.name}`", "",
        f"Target `{config.target.model}`; drafter `{outputs['drafter']}`.", "",
        "| drafter | acceptance length | per-position acceptance |", "|---|---|---|",
        f"| trained | {t['acceptance_length']} | {t['per_position_acceptance']} |",
        f"| untrained (same shape) | {u['acceptance_length']} | {u['per_position_acceptance']} |", "",
        f"Run folder: `{outputs['run_dir']}`; hidden states `{outputs['hidden_states']}`; "
        f"evaluation `{outputs['evaluation']}`.",
        "", "Serve it: `vllm serve <target> --speculative-config "
        f"'{{\"method\": \"eagle3\", \"model\": \"{outputs['drafter']}\", \"num_speculative_tokens\": "
        f"{config.evaluate.num_speculative_tokens}}}'`"])
