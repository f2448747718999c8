"""Every check that needs no weights, run in seconds before the expensive steps.

The original failure this project exists for: a 27-minute load of the target ended in "Model does not support
EAGLE3 interface". Here the target's vLLM class is resolved from its config.json and probed with attribute checks
(never `issubclass` on the protocol, which raises TypeError), the layer ids are checked against the layer count, the
installed vLLM is checked for the `extract_hidden_states` method and against what the config asks of it (version,
server arguments, server variables), the disk is checked against the estimated hidden states, and the chat template
is checked. Each failure says what is wrong and how to fix it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from eyrie.config import PipelineConfig
from eyrie.errors import ConfigError, PreflightError
from eyrie.hidden_states.encoding import check_config as check_hidden_states_dtype
from eyrie.hidden_states.proof import aux_refusal, recurrent_state_refusal
from eyrie.run.environment import child_environment
from eyrie.run.folder import RunFolder
from eyrie.run.vllm_python import (
    VllmEnvironmentError,
    check_vllm_environment,
    one_environment,
    probe,
    vllm_python,
    vllm_version,
)
from eyrie.stages.evaluate import evaluation_sets, template_variant_warnings, template_variants
from eyrie.stages.preflight.ahead import wait_for_imports_ahead
from eyrie.stages.preflight.installed_vllm import (
    check_model_runners,
    check_server_arguments,
    check_server_env,
    check_vllm_version,
)
from eyrie.stages.preflight.node import (
    bytes_still_to_write,
    check_lock_filesystem,
    check_online_tmpfs,
    check_train_devices,
    hidden_state_bytes,
    judge_host,
    mount_of,
)
from eyrie.stages.preflight.report import PreflightReport
from eyrie.stages.preflight.run_inputs import check_data_sample, check_run_folder
from eyrie.stages.preflight.startup import check_startup_levers
from eyrie.stages.preflight.target import (
    _first,
    captured_layer_ids,
    check_context,
    check_drafter_inputs,
    check_parallelism,
    check_serving,
    foreign_default_layer_ids,
    probe_eagle3,
    resolve_vllm_class,
    validate_aux_layer_ids,
    vllm_has_extract_hidden_states,
)
from eyrie.stages.preflight.verdict import load_verdict, save_verdict, verdict_key
from eyrie.stages.preflight.warm_start import check_recorded_base
from eyrie.stages.promote import check_base, current_version
from eyrie.target.labels import label_report, label_warnings
from eyrie.target.metadata import load_tokenizer, mask_token_id, read_target_config, text_config, verifier_name
from eyrie.vllm.loading import load_warnings, weights_folder


def check_target(config: PipelineConfig, serve: bool) -> PreflightReport:
    """The verdict on the target, the installed vLLM and the config (the part that imports vLLM and loads the
    tokenizer): what it found and every failure. Keyed (`eyrie.stages.preflight.verdict`) on everything it reads.
    The whole config: it checks every section its verdict's key holds (`VERDICTS["preflight"]`)."""
    import vllm

    cfg = read_target_config(config.target)
    failures = []
    if cfg.get("auto_map") and not config.target.trust_remote_code:
        failures.append(
            f"{config.target.model} ships its own code (config.json `auto_map`): set "
            "target.trust_remote_code: true if you trust it"
        )
    text = text_config(cfg)
    # GPT-2 and OPT-era configs spell these n_layer/n_embd (and word_embed_proj_dim for OPT is not the width).
    num_layers = int(_first(text, "num_hidden_layers", "n_layer", "num_layers"))
    hidden = int(_first(text, "hidden_size", "n_embd", "d_model"))
    vocab = int(text.get("vocab_size", cfg.get("vocab_size", 0)))
    if not num_layers or not hidden:
        failures.append(f"{config.target.model}/config.json has no num_hidden_layers/hidden_size for the decoder")
    aux_ids, problems = validate_aux_layer_ids(config.extraction.layer_ids, num_layers)
    failures += problems

    probe = probe_eagle3(cfg)
    failures += recurrent_state_refusal(resolve_vllm_class(probe.architecture), text, config.target.recurrent_layers)
    proof_failures, proof_warnings = aux_refusal(cfg, aux_ids, num_layers, config.extraction.unproven_aux_layers)
    failures += proof_failures  # aux ids the capture proof cannot recompute, decided before the load
    if probe.path == "unsupported":
        failures.append(f"{probe.reason}. Fix: {probe.fix}" if probe.fix else probe.reason)
    if probe.path == "compat" and not config.extraction.enforce_eager:
        failures.append(
            f"{probe.architecture} takes Eyrie's compatibility layer, whose hooks need eager execution: "
            "set extraction.enforce_eager: true"
        )
    if not vllm_has_extract_hidden_states():
        failures.append(
            f"the installed vLLM {vllm.__version__} lacks the `extract_hidden_states` speculative "
            "method: install vLLM >= 0.17 (pyproject extras `cpu` or `gpu`)"
        )
    failures += check_vllm_version(config.target.vllm_version, vllm.__version__)
    failures += check_server_env(config.extraction.server_env)
    failures += check_hidden_states_dtype(config.extraction.hidden_states_dtype)
    arg_failures, arg_warnings = check_server_arguments(config, captured_layer_ids(aux_ids, num_layers), serve)
    failures += arg_failures
    runners, runner_failures = check_model_runners(
        config, captured_layer_ids(aux_ids, num_layers), serve, cfg, probe.path
    )
    failures += runner_failures
    levers, lever_notes, lever_failures = check_startup_levers(config, serve, cfg, child_environment())
    failures += lever_failures
    if config.vocab.draft_vocab_size > vocab > 0:
        failures.append(
            f"vocab.draft_vocab_size {config.vocab.draft_vocab_size} is larger than the target's "
            f"vocabulary ({vocab}): set it to at most {vocab}"
        )
    failures += (
        check_context(config.data.max_length, config.max_model_len, cfg)
        + check_parallelism(config.target, text)
        + (check_serving(cfg) if serve else [])
    )
    tok = None
    try:
        tok = load_tokenizer(config.target)
        probe_msgs = [{"role": "user", "content": "ping"}, {"role": "assistant", "content": "pong"}]
        if "pong" not in tok.apply_chat_template(probe_msgs, tokenize=False):
            failures.append("the chat template drops the assistant's content: the loss mask would be empty")
        if len(tok) > vocab > 0:
            failures.append(
                f"the tokenizer has {len(tok)} tokens but the model's vocabulary has {vocab} rows: token "
                "ids beyond it would fail in vLLM; use the tokenizer that belongs to this checkpoint"
            )
    except Exception as err:  # DataError and template errors both end here with their own message
        failures.append(str(err))

    report = PreflightReport(
        probe.architecture,
        probe.vllm_class,
        probe.path,
        probe.reason,
        probe.language_model,
        num_layers,
        hidden,
        vocab,
        aux_ids,
        captured_layer_ids(aux_ids, num_layers),
        vllm.__version__,
        config.max_model_len,
    )
    report.warnings += arg_warnings + proof_warnings
    report.startup_levers = levers
    report.notes += lever_notes
    report.warnings += filter(None, [foreign_default_layer_ids(config.extraction.layer_ids, num_layers)])
    report.target_facts["model_runners"] = runners
    report.notes += [
        f"the {label} server runs on model runner {r['runner']}: {r['why']}" for label, r in runners.items()
    ]
    # Where speculators' labels approximate the target: what the trainer applies (train.target_transform) is a note,
    # what it cannot apply stays a warning.
    if config.train.target_transform:
        left, applied = label_report(config.target, cfg)
        report.warnings += left
        report.notes += applied
    else:
        report.warnings += label_warnings(config.target, cfg)
    if tok is not None:  # a chat-template variant whose switch the template never reads measures nothing new
        report.warnings += template_variant_warnings(tok.chat_template, template_variants(config))
    mask = config.train.mask_token_id
    report.target_facts["mask_token_id"] = mask if mask is not None or tok is None else mask_token_id(tok, vocab)
    if probe.path != "unsupported":  # a refused class is the one problem worth reading; its metadata may be odd
        failures += check_drafter_inputs(config.target, config.train.num_layers, cfg, report)
    report.failures = failures
    return report


def check_target_through_probe(config: PipelineConfig, serve: bool) -> PreflightReport:
    """`check_target` run by the interpreter that runs vLLM (`EYRIE_VLLM_PYTHON`, another environment than this
    one), so this process never imports vLLM: the same checks on the vLLM the servers will run."""
    answer = probe("check_target", {"config": config.model_dump(mode="json"), "serve": serve})
    return PreflightReport(**answer["report"])


def unchecked_report(config: PipelineConfig, failures: list[str]) -> PreflightReport:
    """The report when the interpreter that runs vLLM cannot be asked (`check_vllm_environment`'s `failures`): the
    target was not checked, and no verdict is kept."""
    reason = f"not checked: the vLLM of {vllm_python()} cannot run Eyrie's servers"
    return PreflightReport(
        "?",
        None,
        "unsupported",
        reason,
        None,
        0,
        0,
        0,
        [],
        [],
        vllm_version() or "none",
        config.max_model_len,
        failures=list(failures),
    )


def target_verdict(config: PipelineConfig, run_dir: Path, serve: bool) -> PreflightReport:
    """The verdict on the target, vLLM and the config: the passing one kept in `run_dir` under the same key, else
    checked (in this process with one environment, else by the vLLM interpreter) and kept when it passes."""
    key = verdict_key(config, serve)
    report = load_verdict(run_dir, key)
    if report is None and not serve:  # a verdict that checked serving too holds for a run that does not serve
        report = load_verdict(run_dir, verdict_key(config, serve=True))
    if report is not None:
        return report
    try:
        report = check_target(config, serve) if one_environment() else check_target_through_probe(config, serve)
    except VllmEnvironmentError as err:  # the probe failed there: its error is the verdict
        return unchecked_report(config, [str(err)])
    if not report.failures:
        save_verdict(run_dir, key, report)
    return report


def run_preflight(
    config: PipelineConfig,
    run_dir: Path,
    tokens: int | None = None,
    raise_on_failure: bool = True,
    serve: bool = True,
    prepare_key: str | None = None,
    runs_here: bool = False,
) -> PreflightReport:
    """Every check that needs no weights, of the whole config; the report lists every failure found, not only the
    first. `serve`: the run goes on to export and evaluation (vLLM serves target + drafter), so check that too.
    `prepare_key` (after prepare): the warm-start base recorded for this data is checked too.

    The verdict on the target, vLLM and the config is a keyed result: a run folder holding a passing verdict under
    the same key (`eyrie.stages.preflight.verdict`) reuses it and imports no vLLM. The node's checks run every time."""
    wait_for_imports_ahead()  # vLLM may be being imported already (ahead.py): never two importers at once
    environment_failures = check_vllm_environment()  # the interpreter that runs vLLM: nothing else is asked of it
    if environment_failures:
        report = unchecked_report(config, environment_failures)
    else:
        report = target_verdict(config, run_dir, serve)
    failures = list(report.failures)
    report.vllm_python = None if one_environment() else vllm_python()
    report.revisions = {"target": config.target.revision, "data": config.data.revision}
    report.hidden_states = config.train.hidden_states
    aux_ids, hidden = report.aux_layer_ids, report.hidden_size
    failures += check_train_devices(config.train, config.target)
    # This host, where it cannot be judged (no GPU here for a GPU config, /proc/mounts unreadable): said in the
    # verdict, not passed silently; the run's own preflight (`runs_here`) refuses a cuda run on a host without a GPU.
    host_failures, report.unjudged = judge_host(config.train, config.target, runs_here)
    failures += host_failures
    if mount_of(run_dir) is None:
        report.unjudged.append("the run folder's filesystem (its flock across nodes): /proc/mounts cannot be read")
    failures += check_run_folder(run_dir)
    failures += check_lock_filesystem(run_dir)
    if prepare_key is None and tokens is None:  # before prepare: after it, prepare has read every row
        data_failures, data_warnings, data_notes = check_data_sample(config.data)
        failures += data_failures
        report.warnings += data_warnings
        report.notes += data_notes
    failures += check_online_tmpfs(
        config.train, config.data, config.extraction, run_dir, len(report.captured_layer_ids), hidden
    )
    if config.promotion.dir and config.promotion.warm_start and report.captured_layer_ids:
        current = current_version(Path(config.promotion.dir))
        if current is not None:
            failures += check_base(current, verifier_name(config.target.model), config.vocab.draft_vocab_size, aux_ids)
    failures += check_recorded_base(config.promotion, config.train, config.regenerate, run_dir, prepare_key)
    try:  # the evaluation prompt files, read every time (their content is not in the verdict's key)
        evaluation_sets(config)
    except ConfigError as err:
        failures.append(str(err))
    x = config.extraction
    report.warnings += load_warnings(weights_folder(config.target), x.server_args, x.enforce_eager, x.server_env)
    if tokens is not None and hidden:
        fp8 = config.extraction.hidden_states_dtype == "float8_e4m3fn"
        report.estimated_bytes = hidden_state_bytes(tokens, len(report.captured_layer_ids), hidden, 1 if fp8 else 2)
        run_dir.mkdir(parents=True, exist_ok=True)
        report.free_bytes = shutil.disk_usage(run_dir).free
        todo = bytes_still_to_write(config.train, report.estimated_bytes, RunFolder(run_dir).hidden_states)
        need = todo + int(config.extraction.min_free_disk_gib * 2**30)
        if need > report.free_bytes:
            failures.append(
                f"hidden states need about {todo / 2**30:.1f} GiB more (of "
                f"{report.estimated_bytes / 2**30:.1f} GiB in all; + {config.extraction.min_free_disk_gib} GiB "
                f"head-room) but {run_dir} has {report.free_bytes / 2**30:.1f} GiB free: free space, use a larger "
                "volume for --run-dir, or lower data.max_samples / data.max_length"
            )
    report.failures = failures
    if failures and raise_on_failure:
        raise PreflightError(failures)
    return report
