"""A real PostgreSQL, and real Prefect servers on it, for the tests that run Prefect the way production does.

PostgreSQL runs from a data folder in a private temporary directory, on a free loopback port, with a role that logs
in by password. Each Prefect server gets a database of its own on it, so every test module that starts one begins
from an empty Prefect, whatever ran before it. Prefect servers run with authentication on (a random auth string).

PostgreSQL's binaries are found as the Makefile's test target finds them (it installs the `postgresql` package when
none are there): `pg_config --bindir`, else the newest /usr/lib/postgresql/*/bin, else PATH. initdb and postgres
refuse to run as root, so as root (CI) they run as the `postgres` user.
"""

from __future__ import annotations

import functools
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

STARTUP_TIMEOUT_S = 180
DB_ROLE = "eyrie_test"
COMPOSE = Path(__file__).resolve().parents[1] / "infra" / "docker-compose.yml"
# The production server's database timeouts (infra/docker-compose.yml): the tests' servers answer as it does.
DATABASE_SETTINGS = ("PREFECT_SERVER_DATABASE_TIMEOUT", "PREFECT_SERVER_DATABASE_CONNECTION_TIMEOUT")


@functools.lru_cache(maxsize=1)
def _compose_server_environment() -> dict:
    import yaml

    return yaml.safe_load(COMPOSE.read_text())["services"]["prefect-server"]["environment"]


def server_env(name: str) -> str:
    """A setting of the Prefect server in infra/docker-compose.yml (read once: every server start asks)."""
    return str(_compose_server_environment()[name])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_status(url: str, auth: str | None = None) -> int:
    """The status code of a GET (basic auth from a `user:password` string), 0 when nothing answers."""
    import httpx

    try:
        return httpx.get(url, auth=tuple(auth.split(":", 1)) if auth else None, timeout=5).status_code
    except httpx.HTTPError:
        return 0


def postgres_bindir() -> Path | None:
    candidates = []
    try:
        out = subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True, timeout=30).stdout.strip()
        candidates.append(Path(out))
    except (OSError, subprocess.SubprocessError):
        pass

    def version(p: Path):
        return tuple(int(x) for x in p.parent.name.split(".") if x.isdigit())

    candidates += sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=version, reverse=True)
    if which := shutil.which("initdb"):
        candidates.append(Path(which).parent)
    return next((c for c in candidates if (c / "initdb").exists() and (c / "pg_ctl").exists()), None)


class Postgres:
    """One PostgreSQL instance in a private temporary directory; `start()`, `create_database()`, `stop()`."""

    def __init__(self):
        bindir = postgres_bindir()
        if bindir is None:
            raise RuntimeError(
                "PostgreSQL is not installed (no initdb found via pg_config, /usr/lib/postgresql/*/bin "
                "or PATH): `apt-get install postgresql`, as `make test` does"
            )
        self.bindir = bindir
        self.as_root = os.geteuid() == 0
        # Not under pytest's temporary folder: that one is private to root, and the server runs as `postgres`.
        self.root = Path(tempfile.mkdtemp(prefix="eyrie-pg-"))
        self.data = self.root / "data"
        self.port = free_port()
        self.password = secrets.token_hex(16)
        self.log = self.root / "postgres.log"

    def _cmd(self, *args: str, **kw) -> subprocess.CompletedProcess:
        cmd = [str(self.bindir / args[0]), *args[1:]]
        if self.as_root:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120, **kw)

    def _check(self, proc: subprocess.CompletedProcess, what: str) -> None:
        if proc.returncode != 0:
            log = self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""
            raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}\n{log}")

    def start(self) -> Postgres:
        if self.as_root:
            shutil.chown(self.root, "postgres", "postgres")
        # Password logins over TCP; the unix socket (in the private folder) trusts its owner, for the setup below.
        self._check(
            self._cmd(
                "initdb",
                "-D",
                str(self.data),
                "-U",
                "postgres",
                "--auth-local=trust",
                "--auth-host=scram-sha-256",
                "--no-sync",
            ),
            "initdb",
        )
        opts = (
            f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.root} -c fsync=off "
            "-c synchronous_commit=off -c full_page_writes=off"
        )
        self._check(
            self._cmd("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", opts, "-w", "-t", "60", "start"),
            "pg_ctl start",
        )
        # Through stdin, so that the password is on no command line.
        self.sql(f"CREATE ROLE {DB_ROLE} LOGIN PASSWORD '{self.password}'")
        return self

    def sql(self, statement: str) -> None:
        self._check(
            self._cmd(
                "psql",
                "-h",
                str(self.root),
                "-p",
                str(self.port),
                "-U",
                "postgres",
                "-d",
                "postgres",
                "-v",
                "ON_ERROR_STOP=1",
                "-q",
                "-f",
                "-",
                input=statement + ";\n",
            ),
            "psql",
        )

    def create_database(self, name: str) -> str:
        """A new, empty database owned by the test role; returns Prefect's connection URL for it."""
        self.sql(f"CREATE DATABASE {name} OWNER {DB_ROLE}")
        return f"postgresql+asyncpg://{DB_ROLE}:{self.password}@127.0.0.1:{self.port}/{name}"

    def stop(self) -> None:
        if self.data.exists():
            proc = self._cmd("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "-t", "60", "stop")
            pid_file = self.data / "postmaster.pid"
            if proc.returncode != 0 and pid_file.exists():  # last resort: the postmaster and its children
                pid = int(pid_file.read_text().split()[0])
                for sig in (signal.SIGQUIT, signal.SIGKILL):
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        break
                    time.sleep(2)
        shutil.rmtree(self.root, ignore_errors=True)


class PrefectServer:
    """`prefect server start` on a PostgreSQL database, with authentication on; `url` is its API."""

    def __init__(self, root: Path, database_url: str, services: bool = True, python: str = sys.executable):
        self.root = Path(root)
        self.python = python  # whose Prefect serves: this venv's, or another's (the flow venv's 3.9)
        self.database_url = database_url
        self.services = services
        self.auth = f"eyrie-admin:{secrets.token_hex(16)}"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/api"
        self.log = self.root / "server.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> PrefectServer:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API_")}
        env.update(
            {
                "PREFECT_HOME": str(self.root / "home"),
                "PREFECT_API_DATABASE_CONNECTION_URL": self.database_url,
                "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                "PREFECT_UI_ENABLED": "false",
                "PREFECT_SERVER_API_AUTH_STRING": self.auth,
                "PREFECT_SERVER_LOGGING_LEVEL": "WARNING",
                **{name: server_env(name) for name in DATABASE_SETTINGS},
            }
        )
        cmd = [self.python, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(self.port)]
        if not self.services:
            cmd.append("--no-services")
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.log, "wb") as log:
            # Its own session, so that the whole process group (uvicorn, services) can be stopped at the end.
            self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while http_status(f"{self.url}/health") != 200:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"prefect server did not come up (exit {self.proc.returncode}):\n"
                    + self.log.read_text(errors="replace")[-3000:]
                )
            time.sleep(1)
        return self

    def errors(self, chars: int = 4000) -> str:
        """The end of the server's log from its last logged error on: why a request got a 5xx."""
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        at = text.rfind("ERROR")
        return text[at:][:chars] if at >= 0 else "(no error in the server's log)"

    def client_env(self, home: Path, **extra: str) -> dict[str, str]:
        """The environment of a client process (setup, worker): this server, its credential, its own PREFECT_HOME."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API_")}
        env.update({"PREFECT_API_URL": self.url, "PREFECT_API_AUTH_STRING": self.auth, "PREFECT_HOME": str(home)})
        env.update(extra)
        return env

    def client(self):
        from prefect.client.orchestration import PrefectClient

        return PrefectClient(self.url, auth_string=self.auth)

    def stop(self) -> None:
        if self.proc is None:
            return
        for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, None)):  # the group: uvicorn and services too
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                pass


@contextmanager
def running_prefect_server(
    postgres: Postgres, root: Path, name: str, services: bool = True, python: str = sys.executable
):
    """A Prefect server on a new database `name` of `postgres`, stopped on exit; `python`'s Prefect serves."""
    server = PrefectServer(root, postgres.create_database(name), services=services, python=python)
    try:
        yield server.start()
    finally:
        server.stop()
