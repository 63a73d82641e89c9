"""A fork server for the suite's Python processes (tests/conftest.py: `Zygote`, `run_cli`).

Every `raylane` process a test starts (a `--local` run, a torchrun launcher and each of its
ranks, a helper script under torchrun) paid ~2-4 s of CPU for its imports (torch, torch's
checkpointing, MLflow and its SQL store, matplotlib, transformers) before its first line of work:
about 200 such processes in make test, a third of the suite's CPU on 2 cores (process accounting
of a whole run). This process imports them once; each command is a fork of it that becomes the
process the test would have started: its own session, working folder, environment, argv and
standard streams, running the module or script as `python` would, ending with its exit code.
Nothing of Ray and no thread is started here before a fork. `RAYLANE_TESTS_FORK=0` starts every
command as a process of its own instead.

Two ways in:
- stdin: one JSON request a line ({"argv", "cwd", "env", "log"}: argv as after `python`, the
  output into the file `log`); the replies on the original stdout, {"pid"} for each request in
  order and {"exited", "code"} when its command ends (as subprocess.Popen gives a code: a
  signal's negative number).
- a unix socket (SOCK_SEQPACKET, its path in RAYLANE_TESTS_ZYGOTE_SOCKET): one request
  ({"argv", "cwd", "env"}) with the caller's stdin, stdout and stderr attached, answered with
  {"pid"} and, at the end, {"code"}. tests/helpers/forked_rank.py, which torchrun starts in a
  rank's place, is the caller: it relays signals to the fork and exits as it did. A caller that
  dies first (killed by torchrun or a test) takes its fork with it."""

from __future__ import annotations

import atexit
import json
import os
import random
import runpy
import select
import signal
import socket
import sys
import threading
import traceback

PRELOAD = (
    "raylane.cli",
    "raylane.driver",
    "raylane.loop.run",
    "raylane.tracking.records",
    "raylane.tracking.runs",
    "torch",
    "torch.distributed",
    "torch.distributed.run",
    "torch.distributed.checkpoint.state_dict",
    "torch._dynamo",
    "mlflow",
    "mlflow.tracking",
    "mlflow.store.tracking.sqlalchemy_store",
    "matplotlib.pyplot",
    "transformers",
    "peft",
)
SOCKET_ENV = "RAYLANE_TESTS_ZYGOTE_SOCKET"


def _become(request: dict, stdio: list[int], keep_closed: list[int], base_path: list[str]) -> None:
    """In the fork: become the requested process, then run it; never returns."""
    code = 1
    try:
        for fd in keep_closed:
            os.close(fd)
        os.setsid()  # a session of its own, as Popen(start_new_session=True) and torchrun give
        for target, fd in enumerate(stdio):
            os.dup2(fd, target)
        for fd in set(stdio) - {0, 1, 2}:
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        # A fresh interpreter's generators are seeded from the OS; a fork copies the parent's.
        random.seed()
        import numpy as np
        import torch

        np.random.seed()
        torch.seed()
        code = _run(request["argv"], request["cwd"], base_path)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - as the interpreter would: the traceback, then exit 1
        traceback.print_exc()
    try:
        threading._shutdown()  # what the interpreter does at exit: wait for non-daemon threads
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _run(argv: list[str], cwd: str, base_path: list[str]) -> int:
    """`python ARGV` (its options: -u only, the zygote's streams are unbuffered already)."""
    argv = [a for a in argv if a != "-u"]
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if argv[0] == "-m":
        sys.path[:] = [cwd, *extra, *base_path]
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        script = os.path.join(cwd, argv[0])
        sys.path[:] = [os.path.dirname(script), *extra, *base_path]
        sys.argv = [script, *argv[1:]]
        runpy.run_path(script, run_name="__main__")
    return 0


def _send(fd: int, message: dict) -> None:
    os.write(fd, (json.dumps(message) + "\n").encode())


class Zygote:
    def __init__(self) -> None:
        self.replies = os.dup(1)
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # a stray print must not break the protocol
        self.base_path = list(sys.path[1:])
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(os.environ[SOCKET_ENV])
        self.listener.listen(64)
        self.callers: dict[int, socket.socket] = {}  # fork's pid -> its caller's connection
        self.connections: set[socket.socket] = set()
        self.children: set[int] = set()

    def _fork(self, request: dict, stdio: list[int]) -> int:
        open_here = [self.replies, self.listener.fileno(), *(c.fileno() for c in self.connections)]
        pid = os.fork()
        if pid == 0:
            _become(request, stdio, [fd for fd in open_here if fd not in stdio], self.base_path)
        self.children.add(pid)
        return pid

    def _from_stdin(self, line: bytes) -> None:
        request = json.loads(line)
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        pid = self._fork(request, [null, log, log])
        os.close(log)
        os.close(null)
        _send(self.replies, {"pid": pid})

    def _from_caller(self, conn: socket.socket) -> None:
        try:
            message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        except OSError:
            message, fds = b"", []
        if not message:  # the caller is gone: so goes its fork
            self.connections.discard(conn)
            for pid, caller in list(self.callers.items()):
                if caller is conn:
                    del self.callers[pid]
                    try:
                        os.killpg(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            conn.close()
            return
        pid = self._fork(json.loads(message), fds)
        for fd in fds:
            os.close(fd)
        self.callers[pid] = conn
        conn.send(json.dumps({"pid": pid}).encode())

    def _reap(self) -> None:
        while self.children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                return
            self.children.discard(pid)
            code = os.waitstatus_to_exitcode(status)
            caller = self.callers.pop(pid, None)
            if caller is None:
                _send(self.replies, {"exited": pid, "code": code})
                continue
            try:
                caller.send(json.dumps({"code": code}).encode())
            except OSError:
                pass
            self.connections.discard(caller)
            caller.close()

    def serve(self) -> None:
        _send(self.replies, {"ready": os.getpid()})
        pending = b""
        while True:
            watched = [0, self.listener, *self.connections]
            ready, _, _ = select.select(watched, [], [], 0.1 if self.children else 1.0)
            for source in ready:
                if source == 0:
                    chunk = os.read(0, 65536)
                    if not chunk:
                        return  # the test session is over
                    pending += chunk
                    while b"\n" in pending:
                        line, pending = pending.split(b"\n", 1)
                        self._from_stdin(line)
                elif source is self.listener:
                    conn, _ = self.listener.accept()
                    self.connections.add(conn)
                else:
                    self._from_caller(source)
            self._reap()


def main() -> None:
    for name in PRELOAD:
        __import__(name)
    import matplotlib

    matplotlib.use("Agg")  # what raylane's plots ask for; no display here
    assert threading.active_count() == 1, [t.name for t in threading.enumerate()]  # a fork copies no thread
    Zygote().serve()


if __name__ == "__main__":
    main()
