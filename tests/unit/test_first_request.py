"""A server start's `first request` phase (issue 23 item 1): vLLM's log has no request lines, so Eyrie's client
records, once, when the server first answered a request after it became ready (the time from ready to that answer,
and its latency) beside the phases parsed from the log in server.json; the phases table, its artifact and `eyrie
status` show it. A small HTTP server stands in for vLLM's API (in a thread of this process)."""

from __future__ import annotations

import http.server
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import server_recorded_as_this_process

from eyrie.ops.status import server_status
from eyrie.run.files import read_json
from eyrie.vllm import phases
from eyrie.vllm.client import ServerClient, watch_first_answer
from eyrie.vllm.process import VllmServer

ANSWER_DELAY_S = 0.3


@pytest.fixture
def api():
    """A chat and completions endpoint answering after ANSWER_DELAY_S; its URL, and how many it answered."""
    answered = {"n": 0}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            time.sleep(ANSWER_DELAY_S)
            answered["n"] += 1
            if self.path == "/v1/chat/completions":
                out = {"choices": [{"message": {"content": "hi"}}], "usage": {"completion_tokens": 1}}
            else:
                out = {"choices": [{"token_ids": [7], "finish_reason": "stop", "prompt_token_ids": body["prompt"]}]}
            data = json.dumps(out).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", answered
    server.shutdown()
    server.server_close()


def _recorded_server(folder: Path, ready_at: float | None, **extra) -> VllmServer:
    """A serving server.json describing this process as the server, ready at `ready_at`."""
    ready = {"ready_at": ready_at} if ready_at else {}
    return server_recorded_as_this_process(
        folder, kind="serving", started_at=(ready_at or time.time()) - 100, **ready, **extra
    )


def test_with_first_answer_records_only_the_first_answer_sent_once_ready():
    state = {"ready_at": 1000.0, "phases": {"weights": 50.0, "total": 90.0}}
    done = phases.with_first_answer(state, sent_at=1010.0, answered_at=1012.5)
    assert done is not None
    assert done["phases"] == {"weights": 50.0, "total": 90.0, "first request": 2.5, "ready to first answer": 12.5}
    assert state["phases"] == {"weights": 50.0, "total": 90.0}  # the state given is left as it was
    assert phases.with_first_answer(done, 1020.0, 1021.0) is None  # the first is recorded already
    assert phases.with_first_answer({"phases": {}}, 1010.0, 1011.0) is None  # not ready yet
    assert phases.with_first_answer(state, 990.0, 1011.0) is None  # sent before the server became ready


def test_the_table_and_summary_show_the_first_request_apart_from_the_start():
    measured = {"weights": 60.0, "engine init": 30.0, "total": 100.0}
    measured.update({"first request": 1.23, "ready to first answer": 4.56})
    table = phases.table(measured)
    assert "| first request | 1.2 |  |" in table and "| ready to first answer | 4.6 |  |" in table
    assert "| weights | 60 | 60% |" in table  # shares of the start's total, which the first request is not part of
    line = phases.summary(measured)
    assert line == "weights 60 s, engine init 30 s; first request 1.2 s, answered 4.6 s after ready"


def test_the_client_records_the_servers_first_answer_after_ready_once_under_concurrency(tmp_path, api):
    url, answered = api
    ready = time.time()
    server = _recorded_server(tmp_path / "server-trained", ready, phases={"weights": 3.0, "total": 10.0})
    client = ServerClient(url)
    watch_first_answer(url, server.state_path)
    time.sleep(0.2)  # the server sits idle a while after it became ready
    before = time.time()
    with ThreadPoolExecutor(8) as pool:  # eight at once, as evaluation sends them: one records
        list(pool.map(lambda _: client.chat([{"role": "user", "content": "hi"}], 4), range(8)))
    assert answered["n"] == 8
    recorded = read_json(server.state_path)["phases"]
    assert recorded["weights"] == 3.0 and recorded["total"] == 10.0  # the log's phases kept
    assert ANSWER_DELAY_S <= recorded["first request"] < ANSWER_DELAY_S + 2
    assert before - ready <= recorded["ready to first answer"] <= time.time() - ready
    first = dict(recorded)
    client.chat([{"role": "user", "content": "again"}], 4)
    assert read_json(server.state_path)["phases"] == first  # later answers change nothing


def test_a_client_built_from_the_url_alone_records_too_and_a_recorded_first_answer_is_kept(tmp_path, api):
    """Extraction and regeneration build their clients from the server's URL: the watch covers them. A second
    watch of a server whose first answer is recorded (a reused server) keeps the first one."""
    url, _ = api
    server = _recorded_server(tmp_path / "extract", time.time() - 1)
    watch_first_answer(url, server.state_path)
    ServerClient(url).generate([1, 2], 1, 0.0, 1.0, None, 10)
    first = read_json(server.state_path)["phases"]["first request"]
    watch_first_answer(url, server.state_path)  # reused by the next stage
    ServerClient(url).generate([1, 2], 1, 0.0, 1.0, None, 10)
    assert read_json(server.state_path)["phases"]["first request"] == first


def test_a_stopped_server_or_one_with_no_watch_records_nothing(tmp_path, api):
    url, _ = api
    watch_first_answer(url, tmp_path / "gone" / "server.json")  # stopped: its server.json removed
    ServerClient(url).chat([{"role": "user", "content": "hi"}], 4)
    assert not (tmp_path / "gone").exists()


def test_status_shows_the_first_request_or_that_none_was_answered(tmp_path):
    ready = time.time() - 30
    measured = {"weights": 60.0, "total": 100.0}
    waiting = _recorded_server(tmp_path / "a", ready, phases=measured)
    waiting.healthy = lambda *a, **k: True  # type: ignore[method-assign]
    line = server_status(waiting)
    assert "started in 100 s: weights 60 s" in line and "no request answered in the 30 s since it became ready" in line
    answered = {**measured, "first request": 2.0, "ready to first answer": 5.0}
    done = _recorded_server(tmp_path / "b", ready, phases=answered)
    done.healthy = lambda *a, **k: True  # type: ignore[method-assign]
    line = server_status(done)
    assert line.endswith("weights 60 s; first request 2.0 s, answered 5.0 s after ready"), line


def test_the_start_table_is_left_again_with_the_first_request_when_the_server_stops(tmp_path, monkeypatch):
    import logging

    import tasks.serving as ts

    tables = []
    monkeypatch.setattr(ts, "create_table_artifact", lambda **kw: tables.append(kw))
    monkeypatch.setattr(ts, "get_run_logger", lambda: logging.getLogger("test"))
    answered = {"weights": 60.0, "total": 100.0, "first request": 2.0, "ready to first answer": 5.0}
    server = _recorded_server(tmp_path / "evaluate" / "server-current", time.time(), phases=answered)
    monkeypatch.setattr(VllmServer, "stop", lambda self, **kw: True)  # this process stands in for the server
    assert ts.stop_server_task.fn(str(server.folder)) is True
    [table] = tables
    assert table["key"] == "server-start"
    assert {"phase": "first request", "seconds": 2.0} in table["table"]
    assert "first request 2.0 s, answered 5.0 s after ready" in table["description"]
    tables.clear()
    _recorded_server(tmp_path / "export", time.time(), phases={"weights": 1.0})  # never answered: no second table
    ts.stop(tmp_path / "export")
    assert tables == []
