"""What keeps a run alive when its node's worker dies or the Prefect server restarts: the zombie window declared in
deployments/prefect.yaml (checked against the heartbeat frequency before the setup writes anything) and the
client's retries, set alike for the flow runs (prefect.yaml), the worker's unit and the worker's image. The real
thing runs in tests/e2e/test_production.py (a killed worker, a server restart mid-share)."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
import yaml
from conftest import REPO

from deployments.setup import PREFECT_FILE, SetupError, load_prefect_file, zombie_automation, zombie_window

UNIT = REPO / "infra" / "eyrie-worker.service"
IMAGE = REPO / "infra" / "Dockerfile.gpu-worker"
SETTINGS = ("PREFECT_FLOWS_HEARTBEAT_FREQUENCY", "PREFECT_CLIENT_MAX_RETRIES")


def _job_env(path=PREFECT_FILE) -> dict:
    return yaml.safe_load(path.read_text())["definitions"]["work_pool"]["job_variables"]["env"]


def test_the_shipped_window_and_the_automation_use_it():
    env = _job_env()
    window = zombie_window()
    assert window >= 3 * timedelta(seconds=int(env["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"]))
    assert zombie_automation().trigger.within == window
    assert zombie_automation(timedelta(seconds=120)).trigger.within == timedelta(seconds=120)
    # An outage the client's retries ride out (2 + 4 + ... s) must not outlast the zombie window either.
    retries = int(env["PREFECT_CLIENT_MAX_RETRIES"])
    assert sum(2**i for i in range(1, retries + 1)) < window.total_seconds()


def test_the_worker_gets_what_the_flow_runs_get():
    """The unit's Environment= lines and the image's ENV give the worker the values prefect.yaml gives each flow
    run: the worker's own requests (polling, reporting a crash) ride out the same outage."""
    env = _job_env()
    unit = dict(re.findall(r"^Environment=(PREFECT_[A-Z_]+)=(\S+)$", UNIT.read_text(), re.M))
    image = dict(re.findall(r"^\s+(PREFECT_[A-Z_]+)=(\S+) \\$", IMAGE.read_text(), re.M))
    for name in SETTINGS:
        assert unit.get(name) == image.get(name) == str(env[name]), (name, unit.get(name), image.get(name))


@pytest.mark.parametrize(
    ("freq", "window", "error"),
    [
        ('"60"', "120", "at least 3 of them"),  # two heartbeats: a late one crashes a healthy run
        ('"20"', "600", "at least 30 s apart"),  # Prefect refuses heartbeats under 30 s
        ('"60"', "ten minutes", "must be whole seconds"),
    ],
)
def test_a_window_that_would_crash_healthy_runs_is_refused_before_anything_is_written(tmp_path, freq, window, error):
    text = PREFECT_FILE.read_text()
    text, n_freq = re.subn(r'(PREFECT_FLOWS_HEARTBEAT_FREQUENCY: )"\d+"', rf"\g<1>{freq}", text)
    text, n_window = re.subn(r"^(  zombie_after_s: )\d+$", rf"\g<1>{window}", text, flags=re.M)
    assert n_freq == n_window == 1
    path = tmp_path / "prefect.yaml"
    path.write_text(text)
    with pytest.raises(SetupError, match=error):
        load_prefect_file(path)  # what the setup reads first, before it talks to the server
