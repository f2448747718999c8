"""The end-to-end DAG: target -> preflight -> prepare -> preflight (disk) -> extract -> vocab -> train -> export
-> evaluate (the trained drafter, and the current one or an untrained one of the same shape) -> promote (with
`promotion.dir`: the trained drafter becomes `current` if it is at least as good)."""

from __future__ import annotations

from itertools import islice
from pathlib import Path
from typing import Literal

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from eyrie.config import PipelineConfig
from eyrie.errors import EyrieError
from eyrie.hub import pin_revisions
from eyrie.prepare import is_hub_source, iter_eval_prompts, load_seq_lens
from eyrie.promote import choose_base, current_version
from eyrie.server import ServerSpec
from eyrie.stages import UNTIL
from eyrie.store import RunFolder, remove_staging, sha256_json
from eyrie.target import is_local_target
from eyrie.train import train_key, untrained_key
from eyrie.vocab import mapping_paths, vocab_key
from flows.extract import extract_flow
from tasks.caching import unless_missing
from tasks.evaluate import evaluate_task, export_task, promote_task, report_task
from tasks.preflight import preflight_task
from tasks.prepare import compute_prepare_key, ensure_target, prepare_task
from tasks.train import train_task, untrained_drafter_task, vocab_task


@flow(name="eyrie-pipeline")
def pipeline_flow(config: PipelineConfig, run_dir: str, until: Literal[UNTIL] = "evaluate") -> dict:
    """Run every stage up to and including `until` (evaluate: the whole pipeline)."""
    log = get_run_logger()
    run = RunFolder(run_dir)
    run.ensure()
    with run.lock():
        # Holding the lock, no writer is in flight here: a temporary file left by an atomic write is from a crash.
        removed = remove_staging(run.root)
        if removed:
            log.info(f"removed {removed} temporary files left by an interrupted run")
        ensure_target(config)
        # Hub revisions pinned to the commits they point at now: every stage keys on those, and a weekly run
        # against a moved `main` retrains (the pinned config is in the run's parameters and preflight.json).
        config = pin_revisions(config, not is_local_target(config.target), is_hub_source(config.data))
        if config.target.revision or config.data.revision:
            log.info(f"hub revisions pinned: target {config.target.revision}, data {config.data.revision}")
        serve = until == "evaluate"  # export and evaluation serve target + drafter in vLLM
        preflight_task(config, str(run.root), serve=serve)  # seconds, before anything expensive
        pkey = compute_prepare_key(config)
        prepared = unless_missing(prepare_task, run.manifest("prepare"), pkey)(config, str(run.prepare), pkey)
        report = preflight_task(config, str(run.root), tokens=prepared["stats"]["tokens"], serve=serve)
        if serve and not prepared["stats"]["rows_eval"]:  # known now, not after extraction and training
            raise EyrieError(
                f"no held-out conversations to evaluate on ({prepared['stats']['rows_read']} rows read, "
                f"data.eval_fraction {config.data.eval_fraction}): raise data.eval_fraction, or run "
                "with --until train"
            )
        if until == "prepare":
            return {"run_dir": str(run.root), "prepared": str(run.prepare / "dataset")}
        extracted = extract_flow(config, str(run.root), report)
        if until == "extract":
            return {
                "run_dir": str(run.root),
                "prepared": str(run.prepare / "dataset"),
                "hidden_states": extracted["hidden_states"],
                "shards": extracted["shards"],
            }

        dvs, aux = config.vocab.draft_vocab_size, report["aux_layer_ids"]
        promo_dir = Path(config.promotion.dir).resolve() if config.promotion.dir else None
        current = current_version(promo_dir) if promo_dir else None
        warm = None  # the drafter training starts from
        if promo_dir and config.promotion.warm_start:
            # The drafter that was current when this data was first trained on (none for the first drafter), so a
            # re-run trains the same way even after its own drafter was promoted.
            base = choose_base(run.train / "warm_start.json", sha256_json([pkey, extracted["keys"]]), current)
            warm = str(base) if base else None
        vkey = vocab_key(prepared, dvs, report["vocab_size"], warm)
        token_freq = str(run.prepare / "dataset" / "token_freq.pt")
        unless_missing(vocab_task, run.manifest("vocab"), vkey)(
            token_freq, dvs, report["vocab_size"], str(run.vocab), vkey, warm
        )
        d2t, t2d = (str(p) for p in mapping_paths(run.vocab, dvs))
        data = (str(run.prepare / "dataset"), str(run.hidden_states), d2t, t2d, aux, report["target_facts"])
        tkey = train_key(config, extracted["keys"], vkey, aux, warm)
        spec = ServerSpec.from_config(config, num_speculative_tokens=config.evaluate.num_speculative_tokens)
        ekey = sha256_json([tkey, aux, spec.fingerprint()])[:16]
        # The drafter to beat: the current one, unless this run's own drafter already is it (a re-run).
        rival = current if current and current.name != ekey else None
        baseline = config.evaluate.untrained_baseline
        with_untrained = baseline == "always" or (baseline == "auto" and rival is None)
        trained = unless_missing(train_task, run.manifest("train"), tkey)(
            config, str(run.train), tkey, *data, load_seq_lens(run.prepare), warm
        )
        ukey = untrained_key(config, vkey, aux)
        untrained = untrained_drafter_task(config, str(run.train), ukey, *data) if with_untrained else None
        if until == "train":
            return {"run_dir": str(run.root), "checkpoint": trained["checkpoint"], "untrained": untrained}

        prompts = list(islice(iter_eval_prompts(run.prepare), config.evaluate.num_prompts))
        timeout = config.extraction.startup_timeout_s
        exported = unless_missing(export_task, run.manifest("export"), ekey)(
            trained["checkpoint"],
            str(run.export),
            config.target.model,
            aux,
            report["hidden_size"],
            ekey,
            spec,
            prompts[0],
            timeout,
        )
        drafters = [("trained", exported["drafter"], run.export / "server-trained", ekey)]
        if rival:
            drafters.append(("current", str(rival), run.evaluate / "server-current", rival.name))
        if untrained:
            drafters.append(("untrained", untrained, run.evaluate / "server-untrained", ukey))
        results = []
        for label, drafter, server_dir, identity in drafters:
            key = sha256_json([label, identity, config.evaluate.model_dump(), prompts])[:16]
            out = run.evaluate / f"{label}.json"
            results.append(
                unless_missing(evaluate_task, out, key)(
                    label, drafter, spec, str(server_dir), prompts, config.evaluate.max_tokens, str(out), key, timeout
                )
            )
        summary = report_task(results, str(run.evaluate))
        promotion = None
        if promo_dir:
            promotion = promote_task(
                str(promo_dir),
                exported["drafter"],
                ekey,
                summary["trained"],
                summary.get("current"),
                {"run_dir": str(run.root), "config": config.name, "data": pkey},
            )

    outputs = {
        "run_dir": str(run.root),
        "drafter": exported["drafter"],
        "acceptance_length": summary["trained"]["acceptance_length"],
        **{f"{label}_acceptance_length": r["acceptance_length"] for label, r in summary.items() if label != "trained"},
        "hidden_states": extracted["hidden_states"],
        "evaluation": str(run.evaluate),
        "promotion": promotion,
    }
    create_markdown_artifact(_summary_markdown(config, outputs, summary), key="run-summary")
    log.info(f"outputs: {outputs}")
    return outputs


def _summary_markdown(config: PipelineConfig, outputs: dict, summary: dict) -> str:
    promotion = outputs["promotion"]
    serving = promotion["current"] if promotion and promotion["promoted"] else outputs["drafter"]
    return "\n".join(
        [
            f"# Eyrie run `{config.name}`",
            "",
            f"Target `{config.target.model}`; drafter `{outputs['drafter']}`.",
            "",
            "| drafter | acceptance length | per-position acceptance |",
            "|---|---|---|",
            *(
                f"| {label} | {r['acceptance_length']} | {r['per_position_acceptance']} |"
                for label, r in summary.items()
            ),
            "",
            *(
                [
                    f"Promotion: {'promoted' if promotion['promoted'] else 'not promoted'}, {promotion['reason']} "
                    f"(`{promotion['current']}`).",
                    "",
                ]
                if promotion
                else []
            ),
            f"Run folder: `{outputs['run_dir']}`; hidden states `{outputs['hidden_states']}`; "
            f"evaluation `{outputs['evaluation']}`.",
            "",
            "Serve it: `vllm serve <target> --speculative-config "
            f'\'{{"method": "eagle3", "model": "{serving}", "num_speculative_tokens": '
            f"{config.evaluate.num_speculative_tokens}}}'`",
        ]
    )
