"""Shared test helpers. Every process a test starts is stopped by that test, by its id: CLI runs
get their own session, and the whole group (driver plus the embedded Ray it started) is killed
by process-group id if it outlives the test."""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import functools
import json
import os
import queue
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

# The two xdist workers and every process their tests start share 2 cores. A process with one
# torch thread per core (a one-process run; torchrun and Ray give their ranks one) spins while the
# others hold the cores: a 20-step --local fine-tune took 8 s alone and 61 s beside the suite.
# One thread each, as torchrun and Ray give their ranks; inherited by every process started here.
os.environ.setdefault("OMP_NUM_THREADS", "1")

REPO = Path(__file__).resolve().parents[1]
RAYLANE = [sys.executable, "-m", "raylane"]
# `torchrun --standalone --nproc_per_node N -m raylane train ...`, through this interpreter.
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]


def cli_env(tmp_path: Path, *, new_database: bool = True, **extra: str) -> dict[str, str]:
    """The environment of a test's `raylane` process: MLflow on tmp_path/mlflow.db, which is laid
    out already (a copy of an empty one, see _empty_mlflow_database) unless new_database is False."""
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    db = tmp_path / "mlflow.db"
    env.update(
        MLFLOW_TRACKING_URI=f"sqlite:///{db}",
        PYTHONUNBUFFERED="1",
        RAY_DEDUP_LOGS="0",
        # A `raylane up` head of the user's (~/.raylane) is never joined by a test: an empty home
        # of the test's own, unless the test is marked shared_ray (see run_cli).
        RAYLANE_HOME=str(tmp_path / "raylane-home"),
    )
    env.update(extra)
    if new_database and env["MLFLOW_TRACKING_URI"] == f"sqlite:///{db}" and tmp_path.is_dir() and not db.exists():
        _empty_mlflow_database(db)
    return env


@functools.cache
def _mlflow_database_template() -> Path:
    where = Path(tempfile.mkdtemp(prefix="raylane-test-mlflow-"))
    atexit.register(shutil.rmtree, where, ignore_errors=True)
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    SqlAlchemyStore(f"sqlite:///{where / 'mlflow.db'}", str(where / "mlruns")).engine.dispose()
    return where / "mlflow.db"


def _empty_mlflow_database(db: Path) -> None:
    """MLflow lays out a new SQLite database in ~2.5 s of CPU (its migrations), paid by the first
    process of every test that records a run: a hundred tests' worth on 2 cores. A copy of one
    laid out once per test process is the same database; only the Default experiment's folder
    (never used by raylane, whose runs go to named experiments) is pointed back beside it."""
    shutil.copyfile(_mlflow_database_template(), db)
    with contextlib.closing(sqlite3.connect(db)) as con, con:
        con.execute(
            "UPDATE experiments SET artifact_location = ? WHERE experiment_id = 0", (str(db.parent / "mlruns" / "0"),)
        )


class CliProcess:
    """A `raylane` subprocess in its own session, killed as a group on cleanup."""

    def __init__(self, argv: list[str], cwd: Path, env: dict[str, str], log_path: Path) -> None:
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(
            argv, cwd=cwd, env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self._log.flush()

    @property
    def output(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def session_pids(self) -> list[int]:
        """Every live process of this CLI's session: the driver, the embedded Ray's daemons and
        its workers (Ray gives workers their own process groups, but they keep the session)."""
        return session_processes(self.proc.pid)

    def kill_group(self) -> None:
        # torchrun starts each rank in a session of its own: those are found as descendants.
        for pid in [self.proc.pid, *self.session_pids(), *descendants(self.proc.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(timeout=30)
        self._log.close()


class Zygote:
    """This pytest process's fork server (tests/helpers/zygote.py), started at its first use and
    stopped by closing its stdin (it exits) and then by its pid. The commands it forks are its
    children: it reports their exit codes, on which `ForkedProcess` waits."""

    def __init__(self, root: Path) -> None:
        self.socket = str(root / f"zygote-{os.getpid()}.sock")
        log_path = root / f"zygote-{os.getpid()}.log"
        self._proc = subprocess.Popen(
            [sys.executable, "-u", str(REPO / "tests/helpers/zygote.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(log_path, "w"),
            cwd=REPO,
            env={**os.environ, "RAYLANE_TESTS_ZYGOTE_SOCKET": self.socket},
            start_new_session=True,
        )
        self._lock = threading.Lock()
        self._codes: dict[int, int] = {}
        self._pids: queue.Queue[int] = queue.Queue()
        self._changed = threading.Condition()
        ready = self._proc.stdout.readline()  # bounded: the imports end or the process dies
        assert ready.startswith(b'{"ready"'), (ready, log_path.read_text()[-3000:])
        threading.Thread(target=self._read, name="zygote-replies", daemon=True).start()

    def _read(self) -> None:
        for line in self._proc.stdout:
            message = json.loads(line)
            if "pid" in message:
                self._pids.put(message["pid"])
            else:
                with self._changed:
                    self._codes[message["exited"]] = message["code"]
                    self._changed.notify_all()

    def fork(self, argv: list[str], cwd: Path, env: dict[str, str], log_path: Path) -> int:
        """`python ARGV` in `cwd` with `env`, its output into log_path; returns its pid."""
        request = {"argv": argv, "cwd": str(cwd), "env": env, "log": str(log_path)}
        with self._lock:
            self._proc.stdin.write((json.dumps(request) + "\n").encode())
            self._proc.stdin.flush()
            return self._pids.get(timeout=60)

    def code(self, pid: int, timeout: float | None) -> int | None:
        """The exit code of forked `pid`, waiting up to `timeout` (None: not at all)."""
        with self._changed:
            if timeout:
                self._changed.wait_for(lambda: pid in self._codes, timeout)
            return self._codes.get(pid)

    def stop(self) -> None:
        self._proc.stdin.close()
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout=30)


class _Forked:
    """What CliProcess's callers use of a Popen (pid, poll, wait, send_signal), for a fork."""

    def __init__(self, zygote: Zygote, pid: int) -> None:
        self._zygote, self.pid = zygote, pid

    def poll(self) -> int | None:
        return self._zygote.code(self.pid, None)

    def wait(self, timeout: float | None = None) -> int:
        code = self._zygote.code(self.pid, timeout or 3600)
        if code is None:
            raise subprocess.TimeoutExpired(f"forked process {self.pid}", timeout or 3600)
        return code

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)


class ForkedProcess(CliProcess):
    """A command forked from the zygote: to a test the same as a CliProcess (its own session, its
    output in log_path, its signals and exit code), without the imports."""

    def __init__(self, zygote: Zygote, argv: list[str], cwd: Path, env: dict[str, str], log_path: Path) -> None:
        self.log_path = log_path
        log_path.touch()
        self._log = open(log_path, "a")  # the fork writes the file; this handle only closes
        self.proc = _Forked(zygote, zygote.fork(argv, cwd, env, log_path))


_ZYGOTE: list[Zygote] = []
FORKED_RANK = str(REPO / "tests/helpers/forked_rank.py")


def zygote() -> Zygote:
    if not _ZYGOTE:
        _ZYGOTE.append(Zygote(Path(os.environ.get(SHARED_DIR, tempfile.gettempdir()))))
    return _ZYGOTE[0]


def forked_argv(launcher: list[str], args: tuple[str, ...]) -> list[str] | None:
    """`python ARGV` for the zygote to fork in place of `[*launcher, *args]`, or None where the
    command starts as a process of its own: Ray's drivers (Ray is never imported in the zygote),
    other launchers, or with RAYLANE_TESTS_FORK=0. Under torchrun, the launcher is forked and
    each rank is tests/helpers/forked_rank.py, which has the zygote fork the rank's own process."""
    if os.environ.get("RAYLANE_TESTS_FORK", "1") == "0" or not args:
        return None
    if launcher == RAYLANE:
        one_process = (args[0] == "train" and "--local" in args) or args[0] in ("check", "export")
        return ["-m", "raylane", *args] if one_process else None
    if launcher != TORCHRUN:
        return None
    for i, arg in enumerate(args):
        if arg == "-m" and i + 1 < len(args) and not args[i + 1].startswith("-"):
            return [*launcher[1:], *args[:i], FORKED_RANK, "-m", *args[i + 1 :]]
        if arg.endswith(".py"):
            return [*launcher[1:], *args[:i], FORKED_RANK, *args[i:]]
    return None


def session_processes(sid: int, prefix: str = "") -> list[int]:
    """Live processes of session `sid` whose command line starts with `prefix`."""
    out = subprocess.run(["ps", "-eo", "pid=,sid=,args="], capture_output=True, text=True).stdout
    rows = [line.split(None, 2) for line in out.splitlines() if line.strip()]
    return [int(r[0]) for r in rows if int(r[1]) == sid and (len(r) > 2 and r[2] or "").startswith(prefix)]


def descendants(pid: int) -> list[int]:
    """Live processes descended from `pid`, children first."""
    out = subprocess.run(["ps", "-eo", "pid=,ppid="], capture_output=True, text=True).stdout
    children: dict[int, list[int]] = {}
    for line in out.splitlines():
        child, parent = map(int, line.split())
        children.setdefault(parent, []).append(child)
    found, queue = [], list(children.get(pid, []))
    while queue:
        child = queue.pop(0)
        found.append(child)
        queue.extend(children.get(child, []))
    return found


class SharedHead:
    """The one Ray head of the whole test session, shared by both pytest-xdist workers: started
    with `raylane up` (token auth, a token of its own) by the first shared_ray test of either
    worker, the other waiting on a file lock meanwhile, and stopped by `raylane down` (by its
    session's process ids) in pytest_unconfigure, once every worker is done. Runs join it through
    RAYLANE_HOME, as a user's runs join theirs: each pays no `ray.init` of an embedded cluster.
    One head rather than one per worker: an idle head alone keeps about 0.15 of a core busy."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.env: dict[str, str] | None = None

    def start(self) -> dict[str, str]:
        if self.env is None:
            self.root.mkdir(parents=True, exist_ok=True)
            with open(self.root / "lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # bounded: the holder's `raylane up` times out
                saved = self.root / "env.json"
                if not saved.exists():
                    saved.write_text(json.dumps(self._up()))
                self.env = json.loads(saved.read_text())
        return self.env

    def _up(self) -> dict[str, str]:
        token = self.root / "auth_token"
        token.write_text(uuid.uuid4().hex)
        token.chmod(0o600)
        env = {"RAYLANE_HOME": str(self.root / "home"), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
        # The venv's bin on PATH, as in a user's activated shell: a job's entrypoint (`raylane
        # train ...`) runs in the head's environment.
        path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
        out = subprocess.run(
            # Logical CPUs for both workers' runs at once (the ASHA sweep alone holds 6): a run
            # short of CPUs would wait, not work.
            # No warm workers (issue 52): a pool for 12 CPUs would import torch 11 times at the
            # session's start and once per run's actor after each run, on 2 cores shared by both
            # workers' tests. tests/e2e/test_warm.py runs a warm head of its own.
            [*RAYLANE, "up", "--num-cpus", "12", "--warm", "0"],
            # Ray's log monitor globs for new worker log files every 0.1 s until there are 1,000
            # of them, then every 0.5 s: at 0.1 s it was the session's busiest process after the
            # tests' own (28 CPU-s in a full run, process accounting), for lines no driver reads
            # (raylane's drivers stream workers' logs only with --verbose). The dashboard agent's
            # node report (psutil over every process, for the dashboard's pages, which no test
            # reads) every 60 s, not 5: 14 CPU-s in a full run.
            env={
                **os.environ,
                **env,
                "PATH": path,
                "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0",
                "REPORTER_UPDATE_INTERVAL_MS": "60000",
            },
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert out.returncode == 0, out.stdout + out.stderr
        return env

    def cluster(self) -> dict:
        """What `raylane up` recorded: `address` (GCS), `dashboard_url` (the jobs API), ..."""
        return json.loads((Path(self.start()["RAYLANE_HOME"]) / "cluster.json").read_text())

    def stop(self) -> None:
        saved = self.root / "env.json"
        if saved.exists():
            env = json.loads(saved.read_text())
            subprocess.run([*RAYLANE, "down"], env={**os.environ, **env}, capture_output=True, timeout=120)


# The folder that the session's processes share (the shared head's): made by the controlling
# pytest process (or the only one), inherited by the xdist workers it starts.
SHARED_DIR = "RAYLANE_TESTS_SHARED_DIR"


def pytest_configure(config):
    if hasattr(config, "workerinput"):
        return  # an xdist worker: the controller made the folder
    config.raylane_shared = Path(tempfile.mkdtemp(prefix="raylane-tests-"))
    os.environ[SHARED_DIR] = str(config.raylane_shared)


def pytest_unconfigure(config):
    for z in _ZYGOTE:
        z.stop()
    shared = getattr(config, "raylane_shared", None)
    if shared is not None:
        SharedHead(shared / "shared-ray").stop()
        shutil.rmtree(shared, ignore_errors=True)


@pytest.fixture(scope="session")
def shared_head():
    return SharedHead(Path(os.environ[SHARED_DIR]) / "shared-ray")


@pytest.fixture
def run_cli(tmp_path, request, shared_head):
    """Starts `raylane` (or another launcher) in a session of its own. In a test marked
    shared_ray, Ray runs join the session's shared head instead of starting an embedded cluster;
    in a test marked untracked, `train` runs turn MLflow off (~4 s less each: the database, the
    run and its end-of-run records), as a test that checks nothing of MLflow needs no run there."""
    started: list[CliProcess] = []
    shared = shared_head.start() if request.node.get_closest_marker("shared_ray") else {}
    untracked = request.node.get_closest_marker("untracked") is not None

    def start(
        *args: str,
        env: dict[str, str] | None = None,
        name: str = "cli",
        launcher: list[str] = RAYLANE,
        cwd: Path | None = None,
        fresh: bool = False,
    ) -> CliProcess:
        if untracked and "train" in args:
            args = (*args, "--set", "mlflow.enabled=false")
        where, environ, log_path = (
            cwd or tmp_path,
            {**(env or cli_env(tmp_path)), **shared},
            tmp_path / f"{name}-{len(started)}.log",
        )
        forked = None if fresh else forked_argv(launcher, args)
        if forked:
            environ["RAYLANE_TESTS_ZYGOTE_SOCKET"] = zygote().socket
            p: CliProcess = ForkedProcess(zygote(), forked, where, environ, log_path)
        else:
            p = CliProcess([*launcher, *args], where, environ, log_path)
        started.append(p)
        return p

    yield start
    for p in started:
        p.kill_group()  # by process-group id: also catches an embedded Ray left by a crash


def wait_for(predicate, timeout_s: float, interval_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise TimeoutError(f"condition not met within {timeout_s}s")


def read_json(path: Path) -> dict:
    """A JSON file; a command's summary (any dict with a `status`) is first checked against the
    documented schema, docs/summary.schema.json, and read back as its raylane type: every
    summary a test reads is validated."""
    data = json.loads(Path(path).read_text())
    if isinstance(data, dict) and "status" in data:
        check_summary(data)
    return data


@functools.cache
def _summary_validator(command: str):
    """The documented schema's part for one command (its `oneOf` would report only that none matched)."""
    import jsonschema

    from raylane.results import SUMMARIES

    schema = json.loads((REPO / "docs" / "summary.schema.json").read_text())
    assert command in SUMMARIES, f"summary of an unknown command {command!r}"
    return jsonschema.Draft202012Validator({"$defs": schema["$defs"], "$ref": f"#/$defs/{SUMMARIES[command].__name__}"})


def check_summary(data: dict) -> None:
    from raylane.results import SUMMARIES

    assert "command" in data, f"summary without a command: {sorted(data)}"
    errors = sorted(_summary_validator(data["command"]).iter_errors(data), key=lambda e: list(e.absolute_path))
    assert not errors, "summary does not match docs/summary.schema.json: " + "; ".join(
        f"{'.'.join(map(str, e.absolute_path)) or '(top)'}: {e.message[:200]}" for e in errors[:5]
    )
    SUMMARIES[data["command"]].model_validate(data)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def s3_endpoint(tmp_path):
    """A real S3-compatible server (moto's) on loopback, with an empty bucket `raylane`; stopped
    by its pid. Yields the environment a client needs to reach it."""
    import urllib.request

    port = free_port()
    server = subprocess.Popen(
        [str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
        stdout=open(tmp_path / "moto.log", "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: _answers(url, urllib.request), timeout_s=60)
        env = {
            "AWS_ENDPOINT_URL": url,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
        }
        urllib.request.urlopen(urllib.request.Request(f"{url}/raylane", method="PUT"), timeout=10).close()
        yield env
    finally:
        server.kill()
        server.wait(timeout=30)


def _answers(url: str, request) -> bool:
    try:
        request.urlopen(url, timeout=2).close()
        return True
    except OSError:
        return False


class MlflowServer:
    """A real `mlflow server` on loopback (sqlite, artifacts served through it), started and
    stopped by this test, by process-group id (the server runs uvicorn as its child)."""

    def __init__(self, data: Path) -> None:
        self.data, self.port = data, free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.answered = False  # once: a restart keeps the port its clients know

    def start(self) -> None:
        """Started, and answering. The port free_port found may be taken before the server binds
        it (another test's process, a Ray worker): the server then exits at once, and a first start
        tries another port; a restart (after `stop`) keeps its port, which its clients know, and
        tries again."""
        import urllib.request

        self.data.mkdir(parents=True, exist_ok=True)
        first = not self.answered
        for attempt in range(3):
            env = dict(
                os.environ,
                MLFLOW_PORT=str(self.port),
                MLFLOW_DATA=str(self.data),
                MLFLOW_BIN=str(Path(sys.executable).parent / "mlflow"),
            )
            self.proc = proc = subprocess.Popen(
                [str(REPO / "scripts" / "mlflow-server.sh")],
                env=env,
                start_new_session=True,
                stdout=open(self.data / "server.log", "a"),
                stderr=subprocess.STDOUT,
            )
            up = wait_for(
                lambda p=proc: _answers(f"{self.uri}/health", urllib.request) or p.poll() is not None, timeout_s=90
            )
            if up and proc.poll() is None:
                self.answered = True
                return
            self.stop()
            if first:
                self.port = free_port()
                self.uri = f"http://127.0.0.1:{self.port}"
            time.sleep(1 + attempt)
        raise RuntimeError(f"mlflow server did not start (3 tries): see {self.data / 'server.log'}")

    def stop(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)
        self.proc = None


@pytest.fixture
def mlflow_server(tmp_path):
    """A server of the test's own: for a test that stops it, or that reads the whole server."""
    server = MlflowServer(tmp_path / "mlflow-server")
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def shared_mlflow_server(tmp_path_factory):
    """One server for the session's tests that find their runs by id and leave the server up."""
    server = MlflowServer(tmp_path_factory.mktemp("mlflow-server"))
    server.start()
    yield server
    server.stop()


# The ASHA sweep of test_tune.py, as a user runs it: the shipped digits-sweep (trials of 2 workers,
# 2 at a time, ASHA after the first epoch), 3 epochs, its best model registered. 2 trials, not the
# file's 4: the seeded draws' first learns, its second does not (ASHA stops it when it reaches the
# first epoch's rung after the first), and a trial is ~28 CPU-s of the suite's (its actor,
# controller and ranks). Which trial reaches the rung first is the machine's choice: the checks
# hold either way, and a stopped trial's records are checked in-process
# (test_tune.py::test_the_table_shows_each_trials_last_value_and_finished_for_a_trial_that_ran_its_course).
ASHA_TRIALS = 2
ASHA_SWEEP = [
    "tune",
    "digits-sweep",
    "--set",
    f"sweep.num_samples={ASHA_TRIALS}",
    "--set",
    "train.max_epochs=2",
    "--set",
    "mlflow.log_every_n_steps=5",
    "--register",
    "digits-best",
    "--summary-json",
    "a.json",
]


@dataclass
class FinishedSweep:
    summary: dict
    output: str
    folder: Path  # its working directory: runs/<sweep name>, the summary a.json, the log
    tracking_uri: str


@pytest.fixture(scope="session")
def asha_sweep(tmp_path_factory, shared_head, shared_mlflow_server):
    """ASHA_SWEEP, run once for the session (the first test that asks for it runs it, so it never
    runs for a session whose tests skip or deselect it) on the shared Ray head, recorded on the
    shared MLflow server: test_tune.py checks its records, test_browser.py looks at it in the UI.
    The sweep is stopped (its session's processes, by id) before the fixture hands it over."""
    root = tmp_path_factory.mktemp("asha-sweep")
    env = {**cli_env(root, MLFLOW_TRACKING_URI=shared_mlflow_server.uri), **shared_head.start()}
    sweep = CliProcess([*RAYLANE, *ASHA_SWEEP], root, env, root / "asha.log")
    try:
        code = sweep.wait(500)
        output = sweep.output
    finally:
        sweep.kill_group()
    assert code == 0, output
    return FinishedSweep(read_json(root / "a.json"), output, root, shared_mlflow_server.uri)


# `make test` runs the tests in two pytest-xdist workers (-n 2), each with fixtures of its own
# (the Ray head alone is shared): its own MLflow server, its own copy of a module's fixture. Tests that share work done
# once (a module's fixture, or the session's ASHA sweep) must share a worker, or the work is done
# once per worker: they are scheduled as one unit, listed here and checked at collection. xdist's
# own `--dist loadgroup` cannot group them under pytest 9.2 (it renames items through
# `Item._nodeid`, which pytest no longer reads).
RUN_TOGETHER = {
    "asha_sweep": ("tests/e2e/test_tune.py", "tests/e2e/test_browser.py"),
    # Files with a module-scoped fixture: each file is one unit.
    **{
        f"tests/e2e/{name}.py": (f"tests/e2e/{name}.py",)
        for name in (
            "test_expert_export",
            "test_hf",
            "test_hf_lora",
            "test_package",
            "test_ray_e2e",
            "test_readme",
            "test_records",
        )
    },
}


def _unit_of(path: str) -> str | None:
    return next((unit for unit, files in RUN_TOGETHER.items() if path in files), None)


def pytest_collection_modifyitems(config, items):
    """A test sharing work with others (a session-scoped fixture of its own, or a module-scoped
    one) outside RUN_TOGETHER would have that work done again under xdist: refused at collection,
    naming the test."""
    for item in (i for i in items if isinstance(i, pytest.Function)):
        path = item.nodeid.split("::", 1)[0]
        for name, defs in item._fixtureinfo.name2fixturedefs.items():
            scope, where = defs[-1].scope, defs[-1].baseid
            shared = scope == "module" or (scope == "session" and name in RUN_TOGETHER)
            if shared and _unit_of(path) is None:
                raise pytest.UsageError(
                    f"{item.nodeid} uses the {scope} fixture {name} ({where or 'conftest'}): list its file in conftest.RUN_TOGETHER"
                )


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """xdist's load scheduling (the default of -n), except that each RUN_TOGETHER unit goes to one
    worker whole; the largest units are handed out first (xdist's loadscope reorder)."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class RunTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit_of(nodeid.split("::", 1)[0]) or nodeid

    return RunTogether(config, log)


@pytest.fixture
def no_work(monkeypatch):
    """What starts work (a cluster, a run, a sweep, a job) fails the test if reached: for inputs
    the CLI must answer before anything starts."""

    def started(*args, **kwargs):
        raise AssertionError("got past the checks: something was started")

    monkeypatch.setattr("raylane.clusters.local.resolve_address", started)  # past the checks of a Ray launch
    monkeypatch.setattr("raylane.onray.jobs.job_client", started)
    monkeypatch.setattr("raylane.driver.train", started)
    monkeypatch.setattr("raylane.clusters.local.up", started)


@pytest.fixture
def one_rank():
    """A one-rank gloo group, left when the test ends (tensor, pipeline and expert parallelism's
    in-process tests)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
