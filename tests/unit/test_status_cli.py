"""`eyrie status` on the command line: a folder that is no run is said so, not reported as a run not started."""

from __future__ import annotations

from flows.cli import main


def test_status_of_a_missing_folder_is_an_error(tmp_path, capsys):
    assert main(["status", "--run-dir", str(tmp_path / "nowhere")]) == 2
    assert "no run folder at" in capsys.readouterr().err


def test_status_of_a_folder_no_run_opened_says_so(tmp_path, capsys):
    assert main(["status", "--run-dir", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert "no eyrie-run.json: no Eyrie run has opened it" in err and "train" in out
