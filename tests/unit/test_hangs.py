"""Hangs diagnosed, in-process (raylane.loop.observe.hangs): faulthandler's text parsed into a thread's
frames, where a rank stood and whether it waited in a collective, the one failure line, a rank's
record, its answer to SIGUSR1 and its watchdog's dump in this very process, `raylane stacks` on a
run that is not there or not live, and NCCL's flight recorder set only for NCCL. The launches:
tests/e2e/test_hangs.py (torchrun), tests/e2e/test_preemption.py (Ray)."""

from __future__ import annotations

import os
import socket
import sysconfig
import threading
import time

from raylane.cli import main
from raylane.loop.distributed.groups import node_name
from raylane.loop.observe import hangs

STDLIB = sysconfig.get_paths()["stdlib"]
DUMP = f"""Thread 0x00007f1c54bfc6c0 (most recent call first):
  File "{STDLIB}/threading.py", line 320 in wait
  File "/site/torch/distributed/distributed_c10d.py", line 2800 in all_reduce
  File "/app/raylane/loop/stopping.py", line 80 in poll

Current thread 0x00007f1c55685b80 (most recent call first):
  File "/home/me/pipe.py", line 38 in loss
  File "/app/raylane/loop/protocols/batches.py", line 60 in __call__
"""


def test_a_thread_frames_innermost_first_by_id_or_the_main_one():
    frames = hangs.thread_frames(DUMP, 0x7F1C54BFC6C0)
    assert [f.function for f in frames] == ["wait", "all_reduce", "poll"] and hangs.waiting(frames)
    main_frames = hangs.thread_frames(DUMP, None)  # faulthandler lists the main thread last
    assert str(hangs.where(main_frames)) == "/home/me/pipe.py:38 in loss" and not hangs.waiting(main_frames)
    assert hangs.thread_frames("", 1) == [] and hangs.where([]) is None


def test_where_skips_python_and_torch_for_the_users_or_raylanes_frame():
    frames = hangs.thread_frames(DUMP, 0x7F1C54BFC6C0)
    assert str(hangs.where(frames)) == "/app/raylane/loop/stopping.py:80 in poll"


def test_the_line_names_the_ranks_that_never_came_and_those_that_did_not_answer():
    entry = lambda r, t: hangs.RankEntry(r, 100 + r, "h", t, "/runs/x", "h")  # noqa: E731
    peers = [entry(1, 0x7F1C55685B80), entry(2, 0x7F1C54BFC6C0), entry(3, 1)]
    line = hangs.hang_line(5, peers, {1: DUMP, 2: DUMP}, 3, "/runs/x/stacks")
    assert line == (
        "a collective waited past dist.timeout_s = 5 s: never reached it: rank 1 on h at /home/me/pipe.py:38 in loss; "
        "no stack from rank 3 (not on this host, or gone); every rank's stack in /runs/x/stacks"
    )
    line = hangs.hang_line(2.5, [entry(2, 0x7F1C54BFC6C0)], {2: DUMP}, 2, "/s")
    assert line == (
        "a collective waited past dist.timeout_s = 2.5 s: every rank that answered was in a collective; "
        "1 rank left no record in the run folder; every rank's stack in /s"
    )


def test_only_a_collectives_timeout_is_a_hang():
    gloo = RuntimeError("[../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 5000ms for recv")
    assert hangs.timed_out(gloo)
    try:
        raise ValueError("wrapped") from gloo
    except ValueError as exc:
        assert hangs.timed_out(exc)
    assert not hangs.timed_out(TimeoutError("the user's HTTP request timed out"))


def test_the_flight_recorder_only_on_nccl_and_only_when_sized():
    assert hangs.flight_recorder_env(False, 2000, "/runs/x") == {}
    assert hangs.flight_recorder_env(True, 0, "/runs/x") == {}
    assert hangs.flight_recorder_env(True, 2000, "/runs/x/") == {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": "/runs/x/stacks/nccl_trace_rank_",
    }
    assert "TORCH_FR_DUMP_TEMP_FILE" not in hangs.flight_recorder_env(True, 10, None)


def _parked(event: threading.Event) -> None:
    event.wait(30)  # a "user's" function the rank stands in


def test_a_rank_answers_the_signal_and_its_watchdog_with_every_thread(tmp_path):
    release = threading.Event()
    other = threading.Thread(target=_parked, args=(release,), daemon=True)
    other.start()
    watch = hangs.HangWatch(str(tmp_path), 0, 2, bound_s=0.3)
    watch.start()
    try:
        [entry] = hangs.read_ranks(tmp_path)
        assert (entry.rank, entry.pid, entry.thread) == (0, os.getpid(), threading.get_ident()) and entry.here()
        entry.live_file.write_text("stale\n")  # the reader empties it before it asks
        got = hangs.collect(hangs.ask([entry]), [], 3.0)
        assert "stale" not in got[0] and "in _parked" in got[0]
        frames = hangs.thread_frames(got[0], entry.thread)
        assert "test_a_rank_answers_the_signal_and_its_watchdog_with_every_thread" in [f.function for f in frames]
        watch.beat()  # no step for the bound: the watchdog writes by itself
        time.sleep(0.6)
        assert "in _parked" in entry.watchdog_file.read_text()
        watch._armed_at = float("-inf")  # a later step: the stale dump goes
        watch.beat()
        assert entry.watchdog_file.read_text() == ""
    finally:
        watch.close()
        release.set()
    assert list(tmp_path.iterdir()) == []  # its record and files go with it


def test_diagnose_writes_its_own_stack_and_names_a_peer_that_left_no_stack(tmp_path):
    watch = hangs.HangWatch(str(tmp_path), 0, 2, bound_s=1)
    watch.start()
    try:
        assert watch.diagnose(ValueError("no collective")) is None
        peer = tmp_path / "ranks" / "rank1.json"
        peer.write_text('{"rank": 1, "pid": 999999999, "host": "elsewhere", "thread": 1}')
        hangs.ANSWER_WAIT_S, wait = 0.2, hangs.ANSWER_WAIT_S
        try:
            error = watch.diagnose(RuntimeError("Timed out waiting 1000ms for recv operation to complete"))
        finally:
            hangs.ANSWER_WAIT_S = wait
    finally:
        watch.close()
    stacks = tmp_path / "stacks"
    assert str(error) == (
        "a collective waited past dist.timeout_s = 1 s: every rank that answered was in a collective; "
        f"no stack from rank 1 (not on this host, or gone); every rank's stack in {stacks}"
    )
    [own] = stacks.iterdir()
    assert own.name == f"rank0-{hangs.file_part(node_name())}.txt" and "Timed out waiting 1000ms" in own.read_text()


def test_a_node_named_apart_from_its_host_is_named_so_in_its_stacks_and_still_asked_here(tmp_path, monkeypatch):
    """RAYLANE_NODE_NAME (nodes that share a host: two raylets, or torchrun's --nnodes on one
    machine): a rank's stacks file and its header carry the node's name, as its health and step
    times do; whether `raylane stacks` can signal it goes by the host, where its pid means
    something. Failed on the old code, which named the file by the host (rank0-<host>.txt); and
    with the record's host taken from node_name(), the rank is not asked (no stacks, exit 2)."""
    monkeypatch.setenv("RAYLANE_NODE_NAME", "node/b")
    watch = hangs.HangWatch(str(tmp_path), 0, 2, bound_s=5)
    watch.start()
    try:
        [entry] = hangs.read_ranks(tmp_path)
        assert (entry.host, entry.node) == (socket.gethostname(), "node/b") and entry.here()
        code, text = hangs.live_stacks(tmp_path, wait_s=3.0)
        assert code == 0 and text.startswith(f"== rank 0 (pid {os.getpid()}, {socket.gethostname()}): running"), text
        hangs.ANSWER_WAIT_S, wait = 0.2, hangs.ANSWER_WAIT_S
        try:
            assert watch.diagnose(RuntimeError("Timed out waiting 1000ms for recv")) is not None
        finally:
            hangs.ANSWER_WAIT_S = wait
    finally:
        watch.close()
    [own] = (tmp_path / "stacks").iterdir()
    assert own.name == "rank0-node_b.txt"
    assert own.read_text().startswith(f"# rank 0, pid {os.getpid()}, host {socket.gethostname()}, node node/b,")


def test_stacks_says_in_one_line_when_the_run_is_not_there_or_not_live(tmp_path, capsys):
    assert main(["stacks", "nope", "--storage-path", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        f"raylane: stacks: no run at {tmp_path / 'nope'} (a run's name under --storage-path, or its folder)\n"
    )
    (tmp_path / "done" / "ranks").mkdir(parents=True)
    (tmp_path / "done" / "ranks" / "rank0.json").write_text(
        f'{{"rank": 0, "pid": 999999999, "host": "{hangs.host_name()}", "thread": 1}}'
    )
    assert main(["stacks", str(tmp_path / "done")]) == 2
    err = capsys.readouterr().err
    assert err == f"raylane: stacks: run done is not live: no rank of it runs (its folder: {tmp_path / 'done'})\n"
