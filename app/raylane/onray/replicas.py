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
        groups = Replicas(
            [launch.fit(event_sink(), _env(launch, env, address, i), _group(launch, i)) for i in range(count)]
        )
        on_event(Startup(phases={"fit": time.time()}))
        relay(groups.start(), groups.drain, groups.stop, on_event)
    finally:
        ray.kill(lighthouse, no_restart=True)
    return groups.ended(on_event)


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


class Replicas:
    """The replica groups' Ray Train runs as the driver follows them, their events relayed as the
    run's (`drain`), and the run's end (`ended`)."""

    def __init__(self, fits: list[Fit]) -> None:
        self.fits = fits
        self.ends: list[End | None] = [None] * len(fits)  # each group's rank 0's End, held back
        self.starts = [0] * len(fits)  # each group's rank 0's Starts: one per start of its worker group
        self._said: set[int] = set()  # the groups whose loss for good was said

    def start(self) -> threading.Thread:
        """Every group's fit started; returns a thread that ends when every one has ended."""
        for fit in self.fits:
            fit.start()

        def join() -> None:
            for fit in self.fits:
                fit.thread.join()

        thread = threading.Thread(target=join, name="raylane-replicas", daemon=True)
        thread.start()
        return thread

    def drain(self) -> list[Event]:
        """Every group's events since the last drain (one round trip for all), as `relay` passes them."""
        ended = [not fit.thread.is_alive() for fit in self.fits]  # before the drain: its last events are in it
        return self.relay(ray.get([fit.sink.drain.remote() for fit in self.fits]), ended)

    def relay(self, drained: list[list[Event]], ended: list[bool]) -> list[Event]:
        """What of each group's events (`drained`) the run's listeners get: the first group's first
        Start alone (the driver counts a Start after the first as a restart of the run's worker
        group), no End (`ended` sends the run's); a group's restart, and its loss for good once its
        fit has `ended` with an error, are said in one line each."""
        events: list[Event] = []
        for index, got in enumerate(drained):
            for event in got:
                if isinstance(event, End):
                    self.ends[index] = event
                elif isinstance(event, Start):
                    self.starts[index] += 1
                    if self.starts[index] > 1:
                        log.warning("replica group %d restarted (%d)", index, self.starts[index] - 1)
                    elif sum(self.starts) == 1:
                        events.append(event)
                else:
                    events.append(event)
            if ended[index] and self.fits[index].error is not None and index not in self._said:
                self._said.add(index)
                log.warning("replica group %d lost for good: %s", index, self.fits[index].failure())
        return events

    def stop(self) -> None:
        """Ctrl-C, SIGTERM or a listener's stop: every group checkpoints at its next step and ends."""
        for fit in self.fits:
            fit.request_stop()

    def ended(self, on_event: Callable[[Event], None]) -> RunResult | None:
        """The run's end, once every group's fit has: the End of the best finished group (the most
        steps, then the lowest index) sent to `on_event`, its result returned; None when no End
        came (an autotune search's ends with SearchEnd); TrainingError when no group finished,
        each group's failure (groups that failed alike together)."""
        finished = [(end.result.steps, -i, end) for i, end in enumerate(self.ends) if end is not None]
        if finished:
            best = max(finished, key=lambda f: f[:2])[2]
            on_event(best)
            return best.result
        failed = [(i, fit.failure()) for i, fit in enumerate(self.fits) if fit.error is not None]
        if not failed:
            return None
        if len(self.fits) == 1:
            raise failed[0][1]  # type: ignore[misc]
        alike: dict[str, list[int]] = {}
        for i, failure in failed:
            alike.setdefault(str(failure), []).append(i)
        parts = [f"group{'s' if len(g) > 1 else ''} {', '.join(map(str, g))}: {text}" for text, g in alike.items()]
        raise TrainingError("no replica group finished: " + "; ".join(parts))
