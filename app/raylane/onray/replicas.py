"""Fault-tolerant replica groups on Ray (issue 62; docs/fault-tolerance.md): the run's world
(`scaling.num_workers`) split into `fault_tolerance.replica_groups` groups, each an ordinary Ray
Train run of its own (its workers, placement group, controller and `failure.max_failures`
budget), so that a group restarts alone while the others step on; all of them meet in one torchft
Lighthouse (the quorum service) in a small actor of the run's.

The shape torchtitan runs (one trainer per replica group), not Ray 2.60's TorchftConfig: Ray's
replica groups are one worker each, and growing them means overriding its private worker group
and controller code (/work/notes/torchft-research.md §4, §6). Here a group's restart is Ray
Train's ordinary one, which raylane already drives.

What a worker learns of its group is three variables, set before its process group starts
(raylane.loop.distributed.ft reads them): `TORCHFT_LIGHTHOUSE`, `RAYLANE_REPLICA_GROUP` (0-based)
and `RAYLANE_REPLICA_GROUPS`. Inside the loop, Ray Train's world is the group's."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

import ray

from raylane.config import BaseConfig
from raylane.errors import TrainingError
from raylane.loop.protocols.events import End, Event, Start, Startup
from raylane.loop.protocols.result import RunResult
from raylane.onray.fit import Fit, Group, event_sink
from raylane.onray.placement import put_env

log = logging.getLogger("raylane")

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"  # torchft's Manager reads it itself
GROUP_ENV = "RAYLANE_REPLICA_GROUP"
GROUPS_ENV = "RAYLANE_REPLICA_GROUPS"
# torchft's Rust side logs every quorum tick and step at INFO (34 lines a few steps, 2 at warn).
QUIET_RUST = {"RUST_LOG": "warn"}
QUORUM_TICK_MS = 100  # torchft's own default, as torchtitan runs it
LIGHTHOUSE_START_S = 120.0  # a new actor's process: seconds on a busy 2-core machine


@ray.remote(num_cpus=0)
class Lighthouse:
    """torchft's LighthouseServer in an actor of the run's (a PyO3 type: ray.remote cannot wrap it
    itself). It lives as long as its handle: the driver kills it on every way out, and Ray with
    the driver's process should that die first."""

    def __init__(self, loopback: bool, min_replicas: int, join_timeout_ms: int, heartbeat_timeout_ms: int) -> None:
        from torchft.coordination import LighthouseServer

        # An embedded cluster's workers are all on this machine: 127.0.0.1, so that nothing else
        # reaches a quorum service without authentication. A joined cluster's workers on other
        # nodes must reach it: the node's own address (the one Ray's processes use), not every
        # interface ([::], Ray's TorchftConfig's choice).
        host = "127.0.0.1" if loopback else ray.util.get_node_ip_address()
        host = f"[{host}]" if ":" in host else host
        self._server = LighthouseServer(
            bind=f"{host}:0",
            min_replicas=min_replicas,
            join_timeout_ms=join_timeout_ms,
            heartbeat_timeout_ms=heartbeat_timeout_ms,
            quorum_tick_ms=QUORUM_TICK_MS,
        )
        # Its own address() names this machine by its hostname, which need not resolve to `host`.
        self._address = f"http://{host}:{urlsplit(self._server.address()).port}"

    def address(self) -> str:
        return self._address


def start_lighthouse(cfg: BaseConfig, loopback: bool) -> Any:
    """The run's Lighthouse actor, on the driver's node: like the event sinks, so that it adds no
    node whose loss ends the run; soft, like them, so that a driver's node that cannot take it does
    not hold the run."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    ft = cfg.fault_tolerance
    here = ray.get_runtime_context().get_node_id()
    return Lighthouse.options(  # type: ignore[attr-defined]
        scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=True),
        runtime_env={"env_vars": QUIET_RUST},  # before torchft's import, which reads it
    ).remote(loopback, ft.min_replicas, round(ft.join_timeout_s * 1000), round(ft.heartbeat_timeout_s * 1000))


class Launching(Protocol):
    """What a launch (raylane.onray.launch.Launch) gives each of its groups."""

    @property
    def cfg(self) -> BaseConfig: ...

    @property
    def folder(self) -> Path | None: ...

    def fit(self, sink: Any, env: Any, group: Group | None = None) -> Fit: ...


# How a launcher relays its groups' events until they end (raylane.onray.launch.pump).
Relay = Callable[
    [threading.Thread, Callable[[], list[Event]], Callable[[], Any], Callable[[Event], None]], RunResult | None
]


@dataclasses.dataclass
class _Replica:
    """One replica group's Ray Train run as the driver follows it."""

    index: int
    fit: Fit
    end: End | None = None  # its rank 0's End, held back: the run sends one, the best group's
    starts: int = 0  # its rank 0's Starts: one per start of its worker group
    said: bool = False  # its loss for good was said


def launch_replicas(
    launch: Launching, on_event: Callable[[Event], None], relay: Relay, env: Any = None, *, loopback: bool
) -> RunResult | None:
    """Run `launch` as `fault_tolerance.replica_groups` Ray Train runs, `{run}-g{i}`, sharing one
    Lighthouse (`loopback`: bound to 127.0.0.1, on an embedded cluster). Every group's events go
    to `on_event` as they come (the loop sends steps and metrics from one group only); the run
    ends when every group's run has ended, with the End of the best finished group (the most
    steps, then the lowest index). A group lost for good (its `failure.max_failures` spent) is
    said in one line while the others go on; TrainingError when no group finished. `relay`: the
    launcher's (raylane.onray.launch.pump, handed in: this module is below it); `env`: as
    launch_on_ray's."""
    lighthouse = start_lighthouse(launch.cfg, loopback)
    try:
        address = _address(lighthouse)
        count = launch.cfg.fault_tolerance.replica_groups
        replicas = [
            _Replica(i, launch.fit(event_sink(), _env(launch, env, address, i), _group(launch, i)))
            for i in range(count)
        ]
        on_event(Startup(phases={"fit": time.time()}))
        for replica in replicas:
            replica.fit.start()
        relay(_every_fit(replicas), lambda: _drain(replicas), lambda: _stop(replicas), on_event)
    finally:
        ray.kill(lighthouse, no_restart=True)
    return _ended(replicas, on_event)


def _address(lighthouse: Any) -> str:
    try:
        return ray.get(lighthouse.address.remote(), timeout=LIGHTHOUSE_START_S)
    except ray.exceptions.GetTimeoutError:
        raise TrainingError(f"torchft's lighthouse did not start within {LIGHTHOUSE_START_S:.0f} s") from None


def _group(launch: Launching, index: int) -> Group:
    """Replica group `index`'s Ray run: `{run}-g{index}`, stored inside the run's folder (where
    its ranks keep the run's checkpoints: raylane.onray.runtime), `group_size` workers."""
    cfg = launch.cfg
    name = cfg.run.name or "run"
    where = str(launch.folder) if launch.folder else f"{cfg.run.storage_path.rstrip('/')}/{name}"
    size = cfg.fault_tolerance.group_size(cfg.scaling.num_workers)
    return Group(f"{name}-g{index}", where, size, replica_group=index)


def _env(launch: Launching, env: Any, lighthouse: str, index: int) -> Any:
    """Group `index`'s workers' variables, in Ray's object store: the run's (`env:`, or `env`, a
    sweep's driver's already resolved) and the group's, which win."""
    cfg = launch.cfg
    group = {LIGHTHOUSE_ENV: lighthouse, GROUP_ENV: str(index), GROUPS_ENV: str(cfg.fault_tolerance.replica_groups)}
    quiet = {} if "RUST_LOG" in cfg.env else QUIET_RUST  # the config's own RUST_LOG wins
    if env is not None:
        return ray.put({**ray.get(env), **quiet, **group})
    return put_env(cfg, launch.folder, {**quiet, **group})


def _every_fit(replicas: list[_Replica]) -> threading.Thread:
    """A thread that ends when every group's fit has ended (what `pump` waits on)."""

    def join() -> None:
        for replica in replicas:
            replica.fit.thread.join()

    thread = threading.Thread(target=join, name="raylane-replicas", daemon=True)
    thread.start()
    return thread


def _drain(replicas: list[_Replica]) -> list[Event]:
    """Every group's events since the last drain (one round trip for all), as the run's: the first
    group's first Start alone (the driver counts a Start after the first as a restart of the run's
    worker group), a group's restart and its loss for good said here in one line (as soon as its
    fit has ended), and no End (`_ended` sends the run's)."""
    ended = [not r.fit.thread.is_alive() for r in replicas]  # before the drain: its last events are in it
    drained = ray.get([r.fit.sink.drain.remote() for r in replicas])
    events: list[Event] = []
    for replica, got, done in zip(replicas, drained, ended, strict=True):
        for event in got:
            if isinstance(event, End):
                replica.end = event
            elif isinstance(event, Start):
                replica.starts += 1
                if replica.starts > 1:
                    log.warning("replica group %d restarted (%d)", replica.index, replica.starts - 1)
                elif not any(r.starts for r in replicas if r is not replica):
                    events.append(event)
            else:
                events.append(event)
        if done and replica.fit.error is not None and not replica.said:
            replica.said = True
            log.warning("replica group %d lost for good: %s", replica.index, replica.fit.failure())
    return events


def _stop(replicas: list[_Replica]) -> None:
    """Ctrl-C, SIGTERM or a listener's stop: every group checkpoints at its next step and ends."""
    for replica in replicas:
        replica.fit.request_stop()


def _ended(replicas: list[_Replica], on_event: Callable[[Event], None]) -> RunResult | None:
    finished = [r for r in replicas if r.end is not None]
    if finished:
        best = min(finished, key=lambda r: (-r.end.result.steps, r.index))  # type: ignore[union-attr]
        assert best.end is not None
        on_event(best.end)
        return best.end.result
    failed = [r for r in replicas if r.fit.error is not None]
    if not failed:
        return None  # no End came (an autotune search's ends with SearchEnd)
    if len(failed) == 1 and len(replicas) == 1:
        raise failed[0].fit.failure()  # type: ignore[misc]
    alike: dict[str, list[int]] = {}
    for r in failed:
        alike.setdefault(str(r.fit.failure()), []).append(r.index)
    parts = [f"group{'s' if len(i) > 1 else ''} {', '.join(map(str, i))}: {text}" for text, i in alike.items()]
    raise TrainingError("no replica group finished: " + "; ".join(parts))
