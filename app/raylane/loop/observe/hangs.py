"""A hung rank found, not only timed out: every rank's Python stack, on demand and when a wait
runs past `dist.timeout_s`. Ray-free.

Each rank, in the run's folder (local or shared storage):
- records itself in `ranks/rank<R>.json` (pid, host, node, the training thread), removed at its end;
- registers SIGUSR1 with faulthandler: the signal makes it write every thread's stack into
  `ranks/rank<R>.stack`. faulthandler's handler is C, run at the signal, without the GIL: it
  answers whatever the rank does (a user's sleep, a collective, a C loop that holds the GIL),
  under torchrun and in a Ray worker alike (where training runs on a thread that is not the
  process's main one, which Python's own `signal` handlers could not serve);
- arms faulthandler's watchdog (a C thread) per step: a step that lasts `dist.timeout_s` writes
  its stacks into `ranks/rank<R>.watchdog` by itself, which is how a rank on another node, that
  no signal from here reaches, still leaves its stack.

A rank whose collective times out (`diagnose`) signals its peers on this host, waits a few
seconds for their answers (or their watchdogs' dumps), copies every stack into
`stacks/rank<R>-<node>.txt` and fails with one line naming the ranks that never reached the
collective and the file:line where each stood. `live_stacks` is `raylane stacks`."""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import re
import signal
import socket
import sys
import sysconfig
import threading
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raylane.errors import RaylaneError, ranks_text
from raylane.loop.observe.observer import Observer

RANKS, STACKS = "ranks", "stacks"
SIGNAL = signal.SIGUSR1
ANSWER_WAIT_S = 3.0  # a rank that answers at all writes its stacks within milliseconds
POLL_S = 0.05
ECHO_WAIT_S = 1.0  # a peer's failure felt here: how long to look for a hang's diagnosis behind it
MAX_PLACES = 4  # places named in a hang's line; the stacks have the rest
MAX_NODES = 2  # nodes named for the ranks at one place; past them a count
LINE_WAIT_S = ANSWER_WAIT_S + 2.0  # the collector's collection, and its reads
# In `ranks/`: who collects a hang's stacks (the first rank to time out), and its line.
COLLECTOR, LINE = ".hang-collector", ".hang-line"
# A wait in these is a wait on the other ranks: a collective, or DDP's gradient sync in backward.
WAITING = ("/torch/distributed/", "/torch/autograd/", "/torch/_tensor.py", "/torch/nn/parallel/")
_LIBRARY = tuple(p for p in {sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"]} if p)
_THREAD = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-f]+)")
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')


class HangError(RaylaneError, RuntimeError):
    """A collective waited past dist.timeout_s; the message names the ranks that never reached it
    and where each stood, and the folder of every rank's stack."""


def host_name() -> str:
    """This machine's name: which recorded ranks a signal from here reaches (a pid means something
    on its own host only). Not the node's name in the run's records (`node`: groups.node_name),
    which RAYLANE_NODE_NAME sets apart for nodes that share a host, such as two raylets on one
    machine: their ranks are still this host's processes, signalled from here."""
    return socket.gethostname()


def file_part(name: str) -> str:
    """`name` as part of a file's name."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    function: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line} in {self.function}"


def thread_frames(dump: str, thread: int | None) -> list[Frame]:
    """One thread's frames, innermost first, from faulthandler's text (`thread`: its id; None:
    the process's main thread, which faulthandler lists last)."""
    blocks: list[tuple[int, list[Frame]]] = []
    for line in dump.splitlines():
        if m := _THREAD.match(line):
            blocks.append((int(m.group(1), 16), []))
        elif (m := _FRAME.match(line)) and blocks:
            blocks[-1][1].append(Frame(m.group(1), int(m.group(2)), m.group(3)))
    if not blocks:
        return []
    mine = [frames for ident, frames in blocks if ident == thread]
    return mine[-1] if mine else blocks[-1][1]


def waiting(frames: list[Frame]) -> bool:
    """Whether these frames wait on the other ranks (in a collective), or came out of one that
    timed out: a rank in this module's diagnosis, asked while it collects, reached the collective
    (at 8 ranks every rank but the hung one times out at once, and was named as never reaching it)."""
    return any(any(w in f.file for w in WAITING) or (f.file == __file__ and f.function == "diagnose") for f in frames)


def where(frames: list[Frame]) -> Frame | None:
    """Where a thread stood: its innermost frame outside Python's library and torch (the user's
    code, or raylane's), else its innermost."""
    for f in frames:
        if not f.file.startswith(_LIBRARY) and "/torch/" not in f.file:
            return f
    return frames[0] if frames else None


@dataclass(frozen=True)
class RankEntry:
    """A rank as it recorded itself in `ranks/rank<R>.json`."""

    rank: int
    pid: int
    host: str  # host_name(): whether a signal from here reaches it
    thread: int
    folder: str
    node: str  # groups.node_name(): its name in the run's records (the stacks' files)

    @property
    def live_file(self) -> Path:
        return Path(self.folder) / RANKS / f"rank{self.rank}.stack"

    @property
    def watchdog_file(self) -> Path:
        return Path(self.folder) / RANKS / f"rank{self.rank}.watchdog"

    def here(self) -> bool:
        """On this host, and its process alive."""
        if self.host != host_name():
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def read_ranks(folder: str | Path) -> list[RankEntry]:
    """The ranks recorded in the run folder, by rank (a file half written is skipped)."""
    out = []
    for path in sorted(Path(folder, RANKS).glob("rank*.json")):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            d = json.loads(path.read_text())
            host = str(d["host"])
            node = str(d.get("node", host))  # a record of a release before the node's own name
            out.append(RankEntry(int(d["rank"]), int(d["pid"]), host, int(d["thread"]), str(folder), node))
    return sorted(out, key=lambda e: e.rank)


def ask(entries: list[RankEntry]) -> list[RankEntry]:
    """Signal each rank of this host for its stacks (its file emptied first); returns those asked."""
    asked = []
    for e in entries:
        if not e.here():
            continue
        with contextlib.suppress(OSError):
            os.truncate(e.live_file, 0)
            os.kill(e.pid, SIGNAL)
            asked.append(e)
    return asked


def collect(asked: list[RankEntry], others: list[RankEntry], wait_s: float) -> dict[int, str]:
    """rank -> its stacks: the answers of the ranks `asked` and the watchdog dumps of `others`,
    each taken once its size holds for a poll (whole: faulthandler writes as it walks the
    threads), waited for at most `wait_s` in all, whatever the number of ranks."""
    files = {e.rank: e.live_file for e in asked} | {e.rank: e.watchdog_file for e in others if e not in asked}
    got: dict[int, str] = {}
    sizes: dict[int, int] = {}
    deadline = time.monotonic() + wait_s
    while True:
        for rank, path in files.items():
            if rank in got:
                continue
            size = _size(path)
            if size > 0 and sizes.get(rank) == size:
                got[rank] = path.read_text(errors="replace")
            sizes[rank] = size
        if len(got) == len(files) or time.monotonic() > deadline:
            return got
        time.sleep(POLL_S)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def header(e: RankEntry) -> str:
    node = f", node {e.node}" if e.node != e.host else ""
    return f"# rank {e.rank}, pid {e.pid}, host {e.host}{node}, training thread {e.thread:#x}\n"


def stacks_file(folder: Path, e: RankEntry) -> Path:
    return folder / f"rank{e.rank}-{file_part(e.node)}.txt"


class HangWatch(Observer):
    """This rank's side (see the module's doc): `start` once the run folder is known, `beat` at
    each step's start (the loop's observer: `on_step_start`), `close` at the end; `diagnose` a
    timed-out collective's exception."""

    def __init__(self, folder: str, rank: int, world_size: int, bound_s: float) -> None:
        # Here, not at the top: groups imports torch, which `raylane stacks` has no use for.
        from raylane.loop.distributed.groups import node_name

        self.folder, self.rank, self.world_size, self.bound_s = folder, rank, world_size, bound_s
        self.entry = RankEntry(rank, os.getpid(), host_name(), threading.get_ident(), folder, node_name())
        self._files: list[Any] = []
        self._armed_at = float("-inf")
        self._started = 0.0

    def start(self) -> None:
        os.makedirs(Path(self.folder, RANKS), exist_ok=True)
        # Appended to: a reader empties the file before it asks, and the next dump starts at its start.
        live = open(self.entry.live_file, "a")  # noqa: SIM115 - faulthandler writes to its fd until close
        self._watchdog = open(self.entry.watchdog_file, "a")  # noqa: SIM115
        self._files = [live, self._watchdog]
        for f in self._files:
            os.ftruncate(f.fileno(), 0)  # a run resumed: the last launch's dumps
        faulthandler.register(SIGNAL, file=live, all_threads=True, chain=False)
        # A claim to collect a hang's stacks made before this is an earlier launch's (COLLECTOR).
        self._started = time.time() - 1.0  # a file's time, as a shared folder's server may round it
        record = {**self.entry.__dict__, "started_unix": time.time()}
        record.pop("folder")
        tmp = Path(self.folder, RANKS, f".rank{self.rank}.json.tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, Path(self.folder, RANKS, f"rank{self.rank}.json"))

    def on_step_start(self, step: int) -> None:
        self.beat()

    def beat(self) -> None:
        """A step starts: the watchdog dumps this rank's stacks if the next `bound_s` pass without
        another. Re-armed (a thread started) only when a tenth of the bound has passed since the
        last time, so that a step costs a clock read: it then fires 0.9 to 1 bound after the
        last step's start."""
        now = time.monotonic()
        if now - self._armed_at < self.bound_s / 10:
            return
        fd = self._watchdog.fileno()
        if os.fstat(fd).st_size > 0:  # a slow step's dump, now stale
            os.ftruncate(fd, 0)
            os.lseek(fd, 0, os.SEEK_SET)
        faulthandler.dump_traceback_later(self.bound_s, repeat=False, file=self._watchdog, exit=False)
        self._armed_at = now

    def close(self) -> None:
        faulthandler.cancel_dump_traceback_later()
        with contextlib.suppress(Exception):
            faulthandler.unregister(SIGNAL)
        for f in self._files:
            f.close()
        # The run's folder keeps its checkpoints and records only; a rank killed leaves its files.
        for path in (Path(self.folder, RANKS, f"rank{self.rank}.json"), self.entry.live_file, self.entry.watchdog_file):
            with contextlib.suppress(OSError):
                os.remove(path)
        records = Path(self.folder, RANKS)
        with contextlib.suppress(OSError):  # 3.11's glob raises if another rank removed the folder meanwhile
            if not any(records.glob("rank*.json")):  # the last rank out: a hang's claim and line go too
                for name in (COLLECTOR, LINE):  # a line only after a claim: the first missing ends it
                    os.remove(records / name)
        with contextlib.suppress(OSError):
            os.rmdir(records)

    def diagnose(self, exc: BaseException) -> HangError | None:
        """After `exc`, a collective's timeout (else None): this rank's stacks into `stacks/`, and
        the error the rank fails with instead, naming who never came and where it stood. Every
        rank in the collective times out at about the same time: the first to claim the run's
        folder (`COLLECTOR`) collects every rank's stacks and writes the line (`LINE`), which the
        others wait for (bounded) and fail with, so a hang costs the shared folder a file per
        rank, not one per rank per rank."""
        if not timed_out(exc):
            return self._echoed(exc)
        faulthandler.cancel_dump_traceback_later()
        stacks = Path(self.folder, STACKS)
        stacks.mkdir(exist_ok=True)
        with open(stacks_file(stacks, self.entry), "w") as f:
            f.write(header(self.entry) + "# its collective timed out:\n")
            f.write("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)) + "\n# every thread now:\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        records = Path(self.folder, RANKS)
        collector = claim(records / COLLECTOR, self.rank, self._started)
        if collector != self.rank:
            return HangError(self._collected_line(records / LINE, collector, stacks))
        peers = [e for e in read_ranks(self.folder) if e.rank != self.rank]
        asked = ask(peers)
        got = collect(asked, [e for e in peers if e not in asked], ANSWER_WAIT_S)
        for e in peers:
            path = stacks_file(stacks, e)
            if e.rank in got and not _since(path, self._started):  # a rank's own file says more
                path.write_text(header(e) + got[e.rank])
        line = hang_line(self.bound_s, peers, got, self.world_size - 1, str(stacks))
        tmp = records / f"{LINE}.{self.rank}.tmp"
        tmp.write_text(line)
        os.replace(tmp, records / LINE)
        return HangError(line)

    def _echoed(self, exc: BaseException) -> HangError | None:
        """A peer gone (gloo closes a timed-out rank's connections): with a hang's diagnosis claimed
        within ECHO_WAIT_S, its line, not the echo, which Ray tore the group down on alone (16 ranks)."""
        records = Path(self.folder, RANKS)
        deadline = time.monotonic() + ECHO_WAIT_S
        while timed_out(exc, _PEER_GONE) and time.monotonic() < deadline:
            if _since(records / COLLECTOR, self._started):
                with contextlib.suppress(OSError, ValueError):
                    collector = int((records / COLLECTOR).read_text())
                    return HangError(self._collected_line(records / LINE, collector, Path(self.folder, STACKS)))
            time.sleep(POLL_S)
        return None

    def _collected_line(self, path: Path, collector: int, stacks: Path) -> str:
        """The collector's line (at `path`), once it has written it (at most LINE_WAIT_S)."""
        deadline = time.monotonic() + LINE_WAIT_S
        while time.monotonic() < deadline:
            if _since(path, self._started):
                with contextlib.suppress(OSError):
                    return path.read_text()
            time.sleep(POLL_S)
        return (
            f"a collective waited past dist.timeout_s = {self.bound_s:g} s; rank {collector} collects every "
            f"rank's stack in {stacks}"
        )


def claim(path: Path, rank: int, since: float) -> int:
    """The rank that collects this hang's stacks: `rank` when it is the first to create `path`
    (or the one there is an earlier launch's, older than `since`), else the one that did."""
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            if _since(path, since):
                with contextlib.suppress(OSError, ValueError):
                    return int(path.read_text() or -1)
                return -1  # being written: another rank's
            with contextlib.suppress(OSError):
                os.remove(path)
            continue
        with os.fdopen(fd, "w") as f:
            f.write(str(rank))
        return rank
    return rank  # the file could neither be made nor read: this rank collects, as one alone would


def _since(path: Path, since: float) -> bool:
    """Whether `path` was written by this launch (at or after `since`, unix seconds)."""
    try:
        return path.stat().st_mtime >= since
    except OSError:
        return False


# What gloo's and NCCL's timeouts say (a user's own timeout, a socket's, is no collective's).
_TIMEOUTS = re.compile(r"Timed out waiting \d+ ?ms|collective operation timeout", re.I)


_PEER_GONE = re.compile(  # as gloo and NCCL say it (rankfailures' echoes, less the timeouts above)
    r"connection (closed|reset) by peer|broken pipe|pair closure|communicator was aborted|remote process exited", re.I
)


def timed_out(exc: BaseException | None, said: re.Pattern[str] = _TIMEOUTS) -> bool:
    """Whether `exc` (or what it was raised from) is a collective's timeout (gloo's, NCCL's), or
    says what `said` matches."""
    seen = 0
    while exc is not None and seen < 8:
        if said.search(str(exc)):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def hang_line(bound_s: float, peers: list[RankEntry], got: dict[int, str], n_peers: int, folder: str) -> str:
    """The failure's one line: the ranks that never reached the collective and where each stood
    (`peers`: the other ranks recorded, of `n_peers`; `got`: their stacks, by rank). Ranks that
    stood at one place are named together, as ranges, and MAX_PLACES places at most: the line's
    length does not grow with the number of ranks."""
    places: dict[str, list[RankEntry]] = {}
    silent = []
    for e in peers:
        if e.rank not in got:
            silent.append(e.rank)
            continue
        frames = thread_frames(got[e.rank], e.thread)
        if not waiting(frames):
            places.setdefault(str(where(frames) or "an unknown place"), []).append(e)
    unrecorded = n_peers - len(peers)  # ranks that never wrote their record (not started, no shared folder)
    text = f"a collective waited past dist.timeout_s = {bound_s:g} s: "
    if places:
        shown = [
            f"{ranks_text([e.rank for e in stood])} on {nodes_text(stood)} at {place}"
            for place, stood in list(places.items())[:MAX_PLACES]
        ]
        more = len(places) - MAX_PLACES
        text += f"never reached it: {'; '.join(shown)}" + (f"; and {more} more places" if more > 0 else "")
    else:
        text += "every rank that answered was in a collective"
    if silent:
        text += f"; no stack from {ranks_text(silent)} (not on this host, or gone)"
    if unrecorded > 0:
        text += f"; {unrecorded} rank{'s' if unrecorded > 1 else ''} left no record in the run folder"
    return text + f"; every rank's stack in {folder}"


def nodes_text(entries: list[RankEntry]) -> str:
    """The nodes these ranks run on, as their records name them: 'node-3', 'node-3, node-4', or
    past MAX_NODES a count ('node-3, node-4 and 6 more nodes'), so that the line stays bounded."""
    nodes = list(dict.fromkeys(e.node for e in entries))
    more = len(nodes) - MAX_NODES
    return ", ".join(nodes[:MAX_NODES]) + (f" and {more} more node{'s' if more > 1 else ''}" if more > 0 else "")


def flight_recorder_env(use_gpu: bool, entries: int, folder: str | None) -> dict[str, str]:
    """NCCL's flight recorder, for a run on GPUs (NCCL): the last `entries` collectives of each
    rank, dumped on a timeout into the run's `stacks/` (where `folder` is known). {} otherwise."""
    if not use_gpu or entries <= 0:
        return {}
    env = {"TORCH_NCCL_TRACE_BUFFER_SIZE": str(entries), "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    if folder:
        env["TORCH_FR_DUMP_TEMP_FILE"] = f"{folder.rstrip('/')}/{STACKS}/nccl_trace_rank_"
    return env


@contextlib.contextmanager
def watched(folder: str | None, rank: int, world_size: int, bound_s: float) -> Iterator[HangWatch | None]:
    """A HangWatch over the block (None where the run's folder is not on a filesystem here, or
    in one process); a timed-out collective leaves it as a HangError."""
    if folder is None or world_size < 2:
        yield None
        return
    watch = HangWatch(folder, rank, world_size, bound_s)
    try:
        watch.start()
    except OSError as exc:
        print(f"raylane: no stacks on a hang ({exc})", file=sys.stderr, flush=True)
        yield None
        return
    try:
        yield watch
    except Exception as exc:
        hang = watch.diagnose(exc)
        if hang is None:
            raise
        raise hang from exc
    finally:
        watch.close()


def run_folder_of(run: str, storage_path: str) -> Path:
    """RUN as `raylane stacks` takes it: a run's folder, or a run's name under `storage_path`."""
    given = Path(run).expanduser()
    if given.is_dir() and (given / RANKS).is_dir() or os.sep in run:
        return given.resolve()
    return (Path(storage_path).expanduser() / run).resolve()


def live_stacks(folder: Path, wait_s: float = ANSWER_WAIT_S) -> tuple[int, str]:
    """`raylane stacks`: (exit code, text) with the current stacks of every rank of the live run
    in `folder` that runs on this host; a rank elsewhere is named in one line."""
    if not folder.is_dir():
        return 2, f"raylane: stacks: no run at {folder} (a run's name under --storage-path, or its folder)"
    entries = read_ranks(folder)
    here = [e for e in entries if e.here()]
    away = [e for e in entries if e.host != host_name()]
    if not here and not away:
        return 2, f"raylane: stacks: run {folder.name} is not live: no rank of it runs (its folder: {folder})"
    got = collect(ask(here), [], wait_s)
    parts = []
    for e in here:
        if e.rank not in got:
            parts.append(f"== rank {e.rank} (pid {e.pid}, {e.host}): no answer within {wait_s:g} s")
            continue
        frames = thread_frames(got[e.rank], e.thread)
        state = "waiting in a collective" if waiting(frames) else "running"
        parts.append(f"== rank {e.rank} (pid {e.pid}, {e.host}): {state}, at {where(frames)}\n{got[e.rank].rstrip()}")
    if away:
        hosts = sorted({e.host for e in away})
        parts.append(
            f"== rank {', '.join(str(e.rank) for e in away)} on {', '.join(hosts)}: only this host's ranks are "
            f"asked; run `raylane stacks {folder}` there"
        )
    return (0 if got else 2), "\n".join(parts)
