"""The end-to-end DAG: target -> preflight -> prepare -> preflight (disk) -> regenerate (with regenerate.enabled)
-> extract -> vocab -> train -> export -> evaluate (the trained drafter, and the current one or an untrained one of
the same shape) -> promote (with `promotion.dir`: the trained drafter becomes `current` if it is at least as good)."""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from itertools import islice
from pathlib import Path
from typing import Literal

from prefect import flow, get_run_logger, runtime
from prefect.artifacts import create_markdown_artifact
from prefect.states import Completed, State

from eyrie.config import PipelineConfig
from eyrie.errors import EyrieError
from eyrie.ops.tracking import check as check_tracking
from eyrie.ops.tracking import enabled as tracking_enabled
from eyrie.run.files import read_json, sha256_json
from eyrie.run.folder import RunFolder
from eyrie.run.manifest import finished_manifest
from eyrie.stages import UNTIL
from eyrie.stages.evaluate import (
    VALIDATION,
    draft_tokens_key,
    evaluate_key,
    evaluation_sets,
    gap_sentence,
    gap_warning,
    template_variants,
    validation_prompts,
)
from eyrie.stages.export import export_key
from eyrie.stages.extract import online_plan
from eyrie.stages.prepare import iter_eval_prompts, load_seq_lens
from eyrie.stages.promote import choose_base, current_version
from eyrie.stages.regenerate import extraction_source
from eyrie.stages.train.trainer import train_key, untrained_key
from eyrie.stages.vocab import mapping_paths, vocab_key
from eyrie.vllm.process import VllmServer
from eyrie.vllm.spec import ServerSpec
from flows.cancel import own_process_group, stop_on_cancellation
from flows.extract import extract_flow, prove_online_server
from flows.opening import open_run
from flows.regenerate import regenerate_flow
from tasks.evaluate import DraftTokensJob, EvaluateJob, draft_tokens_task, evaluate_task, report_task
from tasks.export import ExportJob, export_task
from tasks.preflight import preflight_task
from tasks.promote import promote_task
from tasks.serving import start_server_task, stop_server_task, stop_unused_servers_task
from tasks.tracking import track_run_task
from tasks.train import TrainingData, TrainJob, UntrainedJob, train_task, untrained_drafter_task
from tasks.vocab import vocab_task


# Cancelled in the UI: its servers and its trainer are stopped (flows/cancel.py); a crash keeps them for the retry.
@flow(name="eyrie-pipeline", on_cancellation=[stop_on_cancellation])
def pipeline_flow(config: PipelineConfig, run_dir: str, until: Literal[UNTIL] = "evaluate") -> dict:
    """Run every stage up to and including `until` (evaluate: the whole pipeline)."""
    log = get_run_logger()
    check_tracking(config.tracking)  # a tracker that is on can export, said before any stage runs
    run = RunFolder(run_dir)
    run.ensure()
    with run.lock(), own_process_group(run):
        serve = until == "evaluate"  # export and evaluation serve target + drafter in vLLM
        # One preflight card per run: the last preflight's (after regeneration, where the run regenerates).
        opened = open_run(config, run, serve=serve, card=not (config.regenerate.enabled and until != "prepare"))
        config, prepare_stage_key, prepared, report = opened.config, opened.prepare_key, opened.prepared, opened.report
        if serve and not prepared["stats"]["rows_eval"]:  # known now, not after extraction and training
            raise EyrieError(
                f"no held-out conversations to evaluate on ({prepared['stats']['rows_read']} rows read, "
                f"data.eval_fraction {config.data.eval_fraction}): raise data.eval_fraction, or run "
                "with --until train"
            )
        if until == "prepare":
            return {"run_dir": str(run.root), "prepared": str(run.prepare / "dataset")}
        # What extraction, vocab and training read: the regenerated conversations, or the prepared ones.
        regenerated = None
        if config.regenerate.enabled:
            # On the extraction server, left up for extraction to reuse: the target loads once for both stages.
            regenerated = regenerate_flow(config, str(run.root), report, keep_server=until != "regenerate")
            # The disk check again, on the regenerated data's length (seconds; nothing loads).
            report = preflight_task(config, str(run.root), tokens=regenerated["stats"]["tokens"], serve=serve)
        elif until == "regenerate":
            raise EyrieError("--until regenerate needs `regenerate: {enabled: true}` in the config")
        data_dir = extraction_source(
            run, config.regenerate
        )  # the folder extraction reads, and vocab and training after it
        data_manifest = read_json(data_dir / "manifest.json")
        if until == "regenerate":
            return {"run_dir": str(run.root), "regenerated": str(data_dir / "dataset")}
        online = config.train.hidden_states == "online"
        if online:
            # No extract stage: the trainer asks the extraction server for each sample as it trains
            # (eyrie/stages/train/online.py).
            plan = online_plan(config, run, report, data_dir)
            keys = [plan.keys[s.name] for s in plan.shards]
            extracted = {
                "keys": keys,
                "data_keys": [plan.data_keys[s.name] for s in plan.shards],
                "hidden_states": str(plan.staging),
                "shards": len(keys),
            }
        else:
            extracted = extract_flow(config, str(run.root), report)
        if (
            not online
            and regenerated
            and regenerated["server_up"]
            and VllmServer(Path(regenerated["server_dir"])).state
        ):
            stop_server_task(regenerated["server_dir"])  # left up for extraction, which had nothing to extract
        if until == "extract":
            return {
                "run_dir": str(run.root),
                "prepared": str(run.prepare / "dataset"),
                "data": str(data_dir / "dataset"),
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
            base = choose_base(
                run.train / "warm_start.json", sha256_json([prepare_stage_key, extracted["keys"]]), current
            )
            warm = str(base) if base else None
        vocab_stage_key = vocab_key(data_manifest, dvs, report["vocab_size"], warm)
        token_freq = str(data_dir / "dataset" / "token_freq.pt")
        vocab_task(token_freq, dvs, report["vocab_size"], str(run.vocab), vocab_stage_key, warm)
        d2t, t2d = (str(p) for p in mapping_paths(run.vocab, dvs))
        hidden = extracted["hidden_states"]
        data = TrainingData(str(data_dir / "dataset"), hidden, d2t, t2d, aux, report["target_facts"])
        train_stage_key = train_key(config, extracted["data_keys"], vocab_stage_key, aux, warm)
        spec = ServerSpec.for_serving(config)  # each drafter set per use
        export_stage_key = export_key(config, train_stage_key, aux, spec.output_identity())
        # The drafter to beat: the current one, unless this run's own drafter already is it (a re-run).
        rival = current if current and current.name != export_stage_key else None
        # An untrained drafter is served only when asked for (`always`): its acceptance length is known without a
        # target load (the floor, 1.0: no draft accepted, each step yields the target's own token; served on the
        # demo it measured 1.00), and the floor is the comparison the report makes (`auto`, `never`).
        with_untrained = config.evaluate.untrained_baseline == "always"
        server_url = None
        if not finished_manifest(run.manifest("train"), train_stage_key):
            # The GPUs free for the trainer: no server of this run left up (online: but the extraction server).
            stop_unused_servers_task(str(run.root), [str(plan.server_dir)] if online else [], "train")
            if online:  # the server up (reused, or started) for training, its capture proved before the trainer
                server_url = start_server_task(plan.spec, str(plan.server_dir), config.extraction.startup_timeout_s)
                extracted["warnings"] = prove_online_server(config, report, run, data_dir, plan, server_url)
        trained = train_task(
            config, TrainJob(str(run.train), train_stage_key, data, load_seq_lens(data_dir), warm, server_url)
        )
        if online and VllmServer(plan.server_dir).state:  # kept up on failure, for the resume to reuse
            stop_server_task(str(plan.server_dir))
        untrained_stage_key = untrained_key(config, vocab_stage_key, aux)
        untrained = (
            untrained_drafter_task(config, UntrainedJob(str(run.train), untrained_stage_key, data))
            if with_untrained
            else None
        )
        if until == "train":
            return {"run_dir": str(run.root), "checkpoint": trained["checkpoint"], "untrained": untrained}

        prompts = list(islice(iter_eval_prompts(run.prepare), config.evaluate.num_prompts))
        timeout = config.extraction.startup_timeout_s
        if not finished_manifest(
            run.manifest("export"), export_stage_key
        ):  # its proof serves the drafter: no other server of this run up
            stop_unused_servers_task(str(run.root), [str(run.export / "server-trained")], "export")
        exported = export_task(
            ExportJob(
                trained["checkpoint"],
                str(run.export),
                config.target.model,
                aux,
                report["hidden_size"],
                export_stage_key,
                spec,
                prompts[0],
                timeout,
            )
        )
        drafters = [("trained", exported["drafter"], run.export / "server-trained", export_stage_key)]
        if rival:
            drafters.append(("current", str(rival), run.evaluate / "server-current", rival.name))
        if untrained:
            drafters.append(("untrained", untrained, run.evaluate / "server-untrained", untrained_stage_key))
        results = []
        sweep = config.evaluate.sweep_draft_tokens
        sets, variants = evaluation_sets(config), template_variants(config)  # read before any server starts
        # The validation conversations' own prompts, served apart: what the train/serve gap compares validation with.
        own = validation_prompts(
            data_dir, run.prepare / "conversations.jsonl", config.train.val_fraction, config.evaluate.num_prompts
        )
        sets = {**sets, VALIDATION: own} if own else sets
        for label, drafter, server_dir, identity in drafters:
            served = replace(spec, drafter=str(drafter)).output_identity()
            key = evaluate_key(config, label, identity, prompts, served, sets)
            out = run.evaluate / f"{label}.json"
            # The trained drafter's server also measures throughput when the draft-token sweep needs it.
            concurrency = config.evaluate.throughput_concurrency if sweep and label == "trained" else None
            results.append(
                evaluate_task(
                    EvaluateJob(
                        label,
                        drafter,
                        spec,
                        str(server_dir),
                        prompts,
                        config.evaluate.max_tokens,
                        str(out),
                        key,
                        timeout,
                        concurrency,
                        prompt_sets=sets,
                        template_variants=variants,
                    )
                )
            )
        # The train manifest's validation is counted over the draft starts vLLM makes
        # (eyrie.stages.train.validation.like_for_like).
        evaluation = report_task(
            results,
            str(run.evaluate),
            trained["val_metrics"],
            config.evaluate.max_train_serve_gap,
            training_data=str(data_dir),  # its chat-template variants beside evaluation's
            val_fraction=config.train.val_fraction,
        )
        if sweep:
            evaluate_max = config.evaluate.max_tokens
            sweep_stage_key = draft_tokens_key(config, results[0]["key"])
            evaluation["draft_tokens"] = draft_tokens_task(
                DraftTokensJob(
                    exported["drafter"], spec, str(run.evaluate), prompts, evaluate_max, sweep_stage_key, timeout, sweep
                ),
                results[0],
            )
        summary = evaluation["results"]
        promotion = None
        if promo_dir:
            promotion = promote_task(
                str(promo_dir),
                exported["drafter"],
                export_stage_key,
                summary["trained"],
                summary.get("current"),
                {"run_dir": str(run.root), "config": config.name, "data": prepare_stage_key},
            )

    outputs = {
        "run_dir": str(run.root),
        "drafter": exported["drafter"],
        "acceptance_length": summary["trained"]["acceptance_length"],
        **{f"{label}_acceptance_length": r["acceptance_length"] for label, r in summary.items() if label != "trained"},
        "hidden_states": extracted["hidden_states"],
        "evaluation": str(run.evaluate),
        "draft_tokens_plot": evaluation.get("draft_tokens", {}).get("plot"),
        "promotion": promotion,
        # What the team should read before shipping: undertraining, training that does not predict serving.
        "warnings": [
            *(regenerated or {}).get("warnings", []),  # rows lost to server errors, retried by the next run
            *extracted.get("warnings", []),  # aux layers the capture proof could not recompute
            *trained.get("warnings", []),
            *filter(None, [gap_warning(evaluation["train_serve_gap"])]),
            *evaluation.get("warnings", []),  # a drafter not clearly better than its baseline (issue 25 item 2)
        ],
    }
    # The run summary, rendered from `outputs` as they are when called: the card below includes a failed export's
    # warning, which the summary the trackers get cannot.
    summary_markdown = partial(
        _summary_markdown,
        config,
        outputs,
        summary,
        evaluation["train_serve_gap"],
        evaluation.get("draft_tokens"),
        evaluation.get("markdown", []),
    )
    if tracking_enabled(config.tracking):  # to MLflow / W&B (eyrie.ops.tracking); one that fails: a run warning
        outputs["warnings"] += track_run_task(config, str(run.root), outputs, summary_markdown())
    for warning in outputs["warnings"]:
        log.warning(warning)
    create_markdown_artifact(summary_markdown(), key="run-summary")
    log.info(f"outputs: {outputs}")
    return completion(outputs)


WARNINGS_TAG = "warnings"


def warnings_message(warnings: list[str], limit: int = 500) -> str:
    """The flow run's state message for a run that finished with `warnings`: how many, and the first."""
    first = warnings[0] if len(warnings[0]) <= limit else warnings[0][: limit - 3] + "..."
    return f"Completed with {len(warnings)} warning(s) (the run summary lists them); the first: {first}"


def completion(outputs: dict) -> dict | State:
    """What the flow returns: its outputs; with warnings, a Completed state whose message names how many and the
    first, and the flow run tagged `warnings`, so the UI's run list shows them (a bare "Completed" hid them)."""
    warnings = outputs.get("warnings") or []
    if not warnings:
        return outputs
    flow_run_id = runtime.flow_run.id
    if flow_run_id:
        try:
            from prefect.client.orchestration import get_client

            with get_client(sync_client=True) as client:
                tags = list(client.read_flow_run(flow_run_id).tags or [])
                if WARNINGS_TAG not in tags:
                    client.update_flow_run(flow_run_id, tags=[*tags, WARNINGS_TAG])
        except Exception as err:  # the tag is a convenience: the state message and the summary still say it
            get_run_logger().warning(f"could not tag the flow run `{WARNINGS_TAG}`: {err}")
    return Completed(data=outputs, message=warnings_message(warnings))


def _gap_flag(row: dict, gap: dict) -> str:
    if row["position"] in gap["flagged"]:
        return " (over the bound)"
    if abs(row["gap"]) > gap["bound"]:  # past the bound by less than the measurement's noise
        return f" (within the noise, ±{row.get('margin', 0)})"
    return ""


def _gap_table(gap: dict) -> list[str]:
    """The gap's rows; the held-out prompts' acceptance beside, when the gap was served on the validation prompts."""
    beside = any("held_out" in r for r in gap["rows"])
    head = "| position | validation | served | gap |" + (" held-out prompts |" if beside else "")
    return [
        head,
        "|---|---|---|---|" + ("---|" if beside else ""),
        *(
            f"| {r['position']} | {r['validation']} | {r['served']} | {r['gap']}{_gap_flag(r, gap)} |"
            + (f" {r.get('held_out', '-')} |" if beside else "")
            for r in gap["rows"]
        ),
    ]


def _draft_token_markdown(report: dict | None) -> list[str]:
    if not report:
        return []
    lines = ["How many draft tokens (acceptance length for k, from one server drafting the most):", ""]
    lines += ["| k | acceptance length | acceptance at k |", "|---|---|---|"]
    lines += [f"| {r['k']} | {r['acceptance_length']} | {r['acceptance_at_k']} |" for r in report["draft_tokens"]]
    keys = list(report["throughput"][0])
    lines += ["", "Output tokens per second:", "", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in report["throughput"]]
    lines += ["", f"Plot: `{report['plot']}`.", ""]
    if report.get("speculative_config"):
        note = report.get("schedule", {}).get("note", "the best k per batch size")
        lines += [f"Serve with `{report['speculative_config']}` ({note}).", ""]
    return lines


def _summary_markdown(
    config: PipelineConfig,
    outputs: dict,
    summary: dict,
    gap: dict,
    draft_tokens: dict | None = None,
    measured: list[str] | None = None,  # the report's own section: intervals, per position, set and category
) -> str:
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
            # Not served: what no drafter, or one whose drafts are never accepted, gives (each step the target's
            # own token).
            *([] if "untrained" in summary else ["| none (the floor, not served) | 1.0 | no draft accepted |"]),
            "",
            gap_sentence(gap),  # said from the rows and flags of the table below
            "",
            *_gap_table(gap),
            "",
            *(measured or []),
            *_draft_token_markdown(draft_tokens),
            *(f"**Warning:** {w}" for w in outputs["warnings"]),
            *([""] if outputs["warnings"] else []),
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
