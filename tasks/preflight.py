from __future__ import annotations

from pathlib import Path

from prefect.artifacts import create_markdown_artifact

from eyrie.config import PipelineConfig
from eyrie.run.files import atomic_write_json
from eyrie.stages.preflight import report_markdown, run_preflight
from tasks.caching import eyrie_task


@eyrie_task("preflight", retries=0)
def preflight_task(
    config: PipelineConfig,
    run_dir: str,
    tokens: int | None = None,
    serve: bool = False,
    prepare_key: str | None = None,
    card: bool = True,
) -> dict:
    """Seconds of checks before any weights load; raises PreflightError listing every problem. The run runs on this
    host, so what needs a GPU is judged here. `card`: leave the report as the flow run's markdown artifact (a run
    checks two or three times, and shows one card: its last preflight's); a failure always leaves it."""
    report = run_preflight(
        config,
        Path(run_dir),
        tokens=tokens,
        raise_on_failure=False,
        serve=serve,
        prepare_key=prepare_key,
        runs_here=True,
    )
    atomic_write_json(Path(run_dir) / "preflight.json", report.as_dict())
    if card or report.failures:  # the report where a user of the UI looks first: on the flow run
        create_markdown_artifact(
            report_markdown(report), key="preflight", description="preflight: the checks made before any weights load"
        )
    if report.failures:
        from eyrie.errors import PreflightError

        raise PreflightError(report.failures)
    return report.as_dict()
