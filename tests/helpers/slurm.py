"""A one-node Slurm cluster of a test's own, from Debian's slurm-wlm (22.05) run as root without
systemd: munged with its own key and socket, slurmctld and slurmd with their own ports, every
file in one temporary folder named by SLURM_CONF for each Slurm command. Started by the test,
stopped by the pids the daemons wrote; nothing under /etc is read or written. What worked here
first is in ../shared/reference/slurm-notes.md."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
# A head slow to start, on purpose: the head's `ray start` starts its raylet (its node registers
# with the GCS) this long after the GCS and the dashboard are up, as on a loaded node where the
# dashboard's imports took 25-60 s. The GCS answers meanwhile. A sitecustomize in the job's
# PYTHONPATH: every Python process imports it, only a head's `ray start` acts on it.
SLOW_HEAD = """
import importlib.abc, importlib.util, os, sys, time

try:
    _argv = open("/proc/self/cmdline", "rb").read().split(b"\\0")
except OSError:
    _argv = []


class _LateRaylet(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "ray._private.node":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            start = module.Node.start_ray_processes

            def late(node):
                time.sleep(float(os.environ.get("RAYLANE_TESTS_HEAD_DELAY_S", "0")))
                return start(node)

            module.Node.start_ray_processes = late

        spec.loader.exec_module = exec_module
        return spec


if len(_argv) > 2 and _argv[1].endswith(b"/ray") and _argv[2] == b"start" and b"--head" in _argv:
    sys.meta_path.insert(0, _LateRaylet())
"""
START_TIMEOUT_S = 60.0
STOP_GRACE_S = 10.0


def missing() -> str | None:
    """Why no cluster can start here (a skip's reason), None when it can."""
    if os.geteuid() != 0:
        return "Slurm's test cluster runs its daemons as root (SlurmUser=root); this is not root"
    absent = [d for d in (*DAEMONS, "sbatch", "sinfo") if not shutil.which(d)]
    if absent:
        return f"Slurm is not installed ({', '.join(absent)} not found: `make slurm` installs Debian's slurm-wlm)"
    return None


def slow_head(folder: Path, delay_s: float) -> dict[str, str]:
    """The environment that makes a Ray head started in it (a worker node's `ray start` is left
    alone) register its node `delay_s` late (SLOW_HEAD)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(SLOW_HEAD)
    path = os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "RAYLANE_TESTS_HEAD_DELAY_S": str(delay_s)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SlurmCluster:
    """One node, this host, in partition `debug`. `env` is what every Slurm command (sbatch,
    squeue, scancel) needs; a job's processes inherit SLURM_CONF from sbatch, which is how
    `stop` finds what a job left."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.host = socket.gethostname().split(".")[0]
        self.conf = root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.pids: dict[str, int] = {}

    def start(self) -> None:
        self.root.chmod(0o711)  # munged: a socket's folder must be searchable by all
        (self.root / "state").mkdir(parents=True)
        (self.root / "spool").mkdir()
        key = self.root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.socket = self.root / "munge.socket"
        self._daemon(
            "munged",
            ["munged", f"--key-file={key}", f"--socket={self.socket}", f"--pid-file={self.root / 'munged.pid'}"]
            + [f"--log-file={self.root / 'munged.log'}", f"--seed-file={self.root / 'munged.seed'}"],
        )
        self.conf.write_text(self._conf())
        self._daemon("slurmctld", ["slurmctld", "-c", "-f", str(self.conf)])
        self._daemon("slurmd", ["slurmd", "-f", str(self.conf)])
        deadline = time.monotonic() + START_TIMEOUT_S
        while self.node_state() != "idle":
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Slurm node is not idle within {START_TIMEOUT_S:g} s: {self.logs()}")
            time.sleep(0.2)

    def _conf(self) -> str:
        r = self.root
        return "\n".join(
            [
                "ClusterName=raylanetest",
                f"SlurmctldHost={self.host}",
                "SlurmUser=root",
                "SlurmdUser=root",
                f"SlurmctldPort={_free_port()}",
                f"SlurmdPort={_free_port()}",
                "AuthType=auth/munge",
                f"AuthInfo=socket={self.socket}",
                "CredType=cred/munge",
                f"StateSaveLocation={r / 'state'}",
                f"SlurmdSpoolDir={r / 'spool'}",
                f"SlurmctldPidFile={r / 'slurmctld.pid'}",
                f"SlurmdPidFile={r / 'slurmd.pid'}",
                f"SlurmctldLogFile={r / 'slurmctld.log'}",
                f"SlurmdLogFile={r / 'slurmd.log'}",
                "ProctrackType=proctrack/linuxproc",
                "TaskPlugin=task/none",
                "JobAcctGatherType=jobacct_gather/none",
                "SelectType=select/cons_tres",
                "SelectTypeParameters=CR_Core",
                "ReturnToService=2",
                "MpiDefault=none",
                # Slurm's defaults, written out: a cancelled job's processes get SIGTERM, then
                # SIGKILL KillWait seconds later; what the sbatch script's stop must fit in.
                "KillWait=30",
                f"NodeName={self.host} CPUs={os.cpu_count() or 1} RealMemory=4000 State=UNKNOWN",
                f"PartitionName=debug Nodes={self.host} Default=YES MaxTime=INFINITE State=UP",
                "",
            ]
        )

    def _daemon(self, name: str, argv: list[str]) -> None:
        """Each daemonizes and writes its pid file: read back, bounded, before the next starts."""
        out = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            raise RuntimeError(f"{name} did not start: {out.stderr.strip() or out.stdout.strip()} {self.logs()}")
        pid_file = self.root / f"{name}.pid"
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (pid_file.exists() and pid_file.read_text().strip()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} wrote no pid file within {START_TIMEOUT_S:g} s: {self.logs()}")
            time.sleep(0.1)
        self.pids[name] = int(pid_file.read_text().split()[0])

    def run(self, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(list(argv), env=self.env, capture_output=True, text=True, timeout=timeout)

    def node_state(self) -> str:
        return self.run("sinfo", "-h", "-N", "-o", "%T").stdout.strip()

    def sbatch(self, *argv: str, cwd: Path, env: dict[str, str] | None = None) -> int:
        """Submits; returns the job id."""
        out = subprocess.run(
            ["sbatch", "--parsable", *argv],
            cwd=cwd,
            env={**self.env, **(env or {})},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        return int(out.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, ExitCode, ...): slurmctld keeps a finished job
        for MinJobAge (300 s by default), long enough for a test to read its end."""
        out = self.run("scontrol", "-o", "show", "job", str(job_id)).stdout
        return dict(field.split("=", 1) for field in out.split() if "=" in field)

    def wait_job(self, job_id: int, timeout_s: float) -> dict[str, str]:
        """Until the job has ended (any state but PENDING, RUNNING, CONFIGURING, COMPLETING)."""
        deadline = time.monotonic() + timeout_s
        while True:
            job = self.job(job_id)
            if job.get("JobState") not in (None, "PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
                return job
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {job.get('JobState')} after {timeout_s:g} s")
            time.sleep(0.5)

    def logs(self) -> str:
        tails = []
        for name in ("munged", "slurmctld", "slurmd"):
            log = self.root / f"{name}.log"
            if log.exists():
                tails.append(f"--- {name}.log\n" + "\n".join(log.read_text(errors="replace").splitlines()[-10:]))
        return "\n".join(tails)

    def stop(self) -> None:
        """Cancels what still runs, ends what a job left (its processes carry this SLURM_CONF),
        then the daemons, each by pid: SIGTERM, and SIGKILL after a grace period."""
        if "slurmctld" in self.pids:
            self.run("scancel", "--partition=debug", timeout=30)
        _end(self.job_processes)
        for name in reversed(DAEMONS):
            if name in self.pids:
                _end(lambda pid=self.pids[name]: [pid] if _alive(pid) else [])

    def job_processes(self) -> list[int]:
        """Live processes of this cluster's jobs: their environment has a job id and names this
        cluster's SLURM_CONF (sbatch hands it on; the daemons have no job id)."""
        wanted = f"SLURM_CONF={self.conf}".encode()
        found = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    environ = (entry / "environ").read_bytes().split(b"\0")
                except OSError:
                    continue
                if wanted in environ and any(v.startswith(b"SLURM_JOB_ID=") for v in environ):
                    found.append(int(entry.name))
        return found


def session_alive(sid: int) -> list[int]:
    """The live processes of session `sid` (a node's `ray start` and all it started)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] != "Z":
                found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _end(pids_of) -> None:
    for signum in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids_of():
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + STOP_GRACE_S
        while pids_of() and time.monotonic() < deadline:
            time.sleep(0.1)
