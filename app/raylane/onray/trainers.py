"""Ray Train's TorchTrainer as raylane launches it: the worker's backend that turns SIGTERM into a
graceful stop, and three trainers, one per way a run meets Ray (a sweep's trial, a `raylane train`
driver, an embedded cluster), each leaving out what that way does not need."""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Mapping
from typing import Any

import ray
from ray.train import FailureConfig
from ray.train.torch import TorchConfig, TorchTrainer

from raylane.loop import preemption
from raylane.loop.observe.startup import process_start_unix
from raylane.loop.protocols.events import Startup
from raylane.onray import warm
from raylane.onray.elastic import HandoverFailurePolicy, HeldBatchElasticPolicy, NoAutoscalerScalingPolicy
from raylane.onray.internals import ControllerCallback, TorchBackend, TrainController, WorkerGroup
from raylane.onray.spec import launch_spec

_process_group_unix: float | None = None


def training_starts(restarts: bool) -> None:
    # Runs on each worker actor's main thread, the only one that may set signal handlers (the
    # training function runs on another). Ray's own handler (exit) stays the fallback.
    import signal

    global _process_group_unix
    _process_group_unix = time.time()  # the backend's on_start (init_process_group) came first
    # A Ray worker gets SIGTERM from its node going away (a spot reclaim's shutdown), which a run
    # that restarts its group treats as that node's notice; the driver's own stop reaches it
    # through the event sink instead. Set here, not in RayRuntime: the notice may come before.
    preemption.signals_mean_node_leaving(restarts)
    preemption.install((signal.SIGTERM,), early=True)


class RaylaneTorchBackend(TorchBackend):
    def on_start(self, worker_group, backend_config) -> None:
        if backend_config.env is not None:  # before the process group: NCCL_*, GLOO_* are read there
            from raylane.onray.placement import set_env

            worker_group.execute(set_env, backend_config.env)  # Ray resolves the reference on each worker
        super().on_start(worker_group, backend_config)

    def on_training_start(self, worker_group, backend_config) -> None:
        super().on_training_start(worker_group, backend_config)
        worker_group.execute(training_starts, backend_config.restarts)


@dataclasses.dataclass
class RaylaneTorchConfig(TorchConfig):
    """TorchConfig whose workers turn SIGTERM into a graceful stop (see raylane.loop.preemption).
    `restarts`: the group restarts without a leaving node (see `LaunchSpec.restarts`). `env`: the
    run's `env:` variables, as a reference into Ray's object store (raylane.onray.placement.put_env:
    Ray records this config in its Train state), or None."""

    restarts: bool = False
    env: Any = None

    @property
    def backend_cls(self):
        return RaylaneTorchBackend


class TrialTorchTrainer(TorchTrainer):
    """TorchTrainer without Ray Data's dataset manager unless the run streams Ray Data: map-style
    pipelines feed their own DataLoaders, yet Ray Train starts that manager as an actor (a
    process importing Ray, ~3 s of CPU on 2 cores) on the way to the first step even when the
    trainer is given no datasets."""

    def _initialize_and_run_controller(self, **controller_init_kwargs):
        failures = self.run_config.failure_config or FailureConfig()
        controller_init_kwargs["failure_policy"] = HandoverFailurePolicy(failures)
        spec = launch_spec(self.train_loop_config)
        if self.scaling_config.elasticity_enabled and spec.world_sizes:
            controller_init_kwargs["scaling_policy"] = HeldBatchElasticPolicy(
                self.scaling_config, spec.world_sizes, spec.sink
            )
        return self._run_controller(**controller_init_kwargs)

    def _run_controller(self, **controller_init_kwargs):
        """Ray Train's own controller launch (DataParallelTrainer._initialize_and_run_controller,
        Ray 2.59-2.60; tests/unit/test_warm.py holds it to Ray's), but the controller carries only
        the variables the cluster's processes lack: none on a `raylane up` head, so it may start
        on a warm worker (raylane.onray.warm). Elsewhere it carries what Ray's would."""
        from raylane.onray.internals import NODE_ID_KEY, WARN_ASYNC_GET_DEFAULT, WARN_ASYNC_GET_VAR, train_env_vars

        wanted = train_env_vars()
        wanted.setdefault(WARN_ASYNC_GET_VAR, WARN_ASYNC_GET_DEFAULT)
        env_vars = warm.carried(wanted, warm.cluster_env())
        controller = ray.remote(
            num_cpus=0,
            label_selector={NODE_ID_KEY: ray.get_runtime_context().get_node_id()},  # the driver's node
            **({"runtime_env": {"env_vars": env_vars}} if env_vars else {}),
        )(WarmTrainController).remote(run_env=getattr(self.backend_config, "env", None), **controller_init_kwargs)
        if threading.current_thread() is threading.main_thread():  # Tune runs trials on other threads
            self._register_sigint_handler(controller)
        ray.get(controller.run.remote())
        return ray.get(controller.get_result.remote())

    def _create_default_callbacks(self):
        from raylane.onray.internals import DatasetsCallback

        callbacks = [*super()._create_default_callbacks(), ControllerStarted(launch_spec(self.train_loop_config).sink)]
        return callbacks if self.datasets else [cb for cb in callbacks if not isinstance(cb, DatasetsCallback)]


class ControllerStarted(ControllerCallback):
    """Tells the driver when Ray Train's controller is up: a start-up phase (raylane.loop.observe.startup)."""

    def __init__(self, sink: Any) -> None:
        self._sink = sink

    def after_controller_start(self, train_run_context) -> None:
        started = process_start_unix()  # before the run: a warm worker
        processes = {"controller": started} if started is not None else {}
        self._sink.put.remote(Startup(phases={"controller": time.time()}, processes=processes))


class WarmWorkerGroup(WorkerGroup):
    """Ray Train's worker group, whose ranks' runtime_env leaves out the variables they inherit
    from the controller (its runtime_env and its node's environment): empty on a `raylane up`
    head, so that the ranks may start on warm workers."""

    @staticmethod
    def _get_worker_runtime_env(custom_runtime_env):
        return warm.without_inherited(WorkerGroup._get_worker_runtime_env(custom_runtime_env), os.environ)


class WarmTrainController(TrainController):
    """Ray Train's controller, with the run's `env:` variables set before it starts: it opens the
    run's storage (an `s3://` storage_path whose endpoint and keys the config hands on by name),
    and on a joined cluster its process has only the cluster's environment. Passed as the ranks'
    are, through the object store, not its runtime_env: Ray shows a runtime_env to anyone who
    can read the cluster's state, and a runtime_env keeps it off the warm workers."""

    worker_group_cls = WarmWorkerGroup

    def __init__(self, *, run_env: Mapping[str, str] | None = None, **kwargs: Any) -> None:
        from raylane.onray.placement import set_env

        set_env(run_env)  # Ray resolved the reference: an argument of the actor's own
        super().__init__(**kwargs)


class DriverTorchTrainer(TrialTorchTrainer):
    """The run of a `raylane train` driver, without the detached placement-group cleaner actor
    (a process importing Ray Train: ~2 s of CPU and ~600 MB per run). The cleaner removes the
    run's placement group when its controller dies while the job goes on, as when Tune kills a
    trial. Here the driver is the job: the controller dies with it or ends it, and Ray removes a
    job's placement groups when the job ends."""

    def _create_default_callbacks(self):
        from raylane.onray.internals import PlacementGroupCleanerCallback

        return [cb for cb in super()._create_default_callbacks() if not isinstance(cb, PlacementGroupCleanerCallback)]


class EmbeddedTorchTrainer(DriverTorchTrainer):
    """On an embedded cluster, also without autoscaler requests (see NoAutoscalerScalingPolicy)."""

    def _initialize_and_run_controller(self, **controller_init_kwargs):
        if not self.scaling_config.elasticity_enabled:  # an elastic run keeps Ray's own policy, requests and all
            controller_init_kwargs["scaling_policy"] = NoAutoscalerScalingPolicy(self.scaling_config)
        return super()._initialize_and_run_controller(**controller_init_kwargs)


def process_group_unix() -> float | None:
    """When this worker's process group was up (the backend's on_start), for the start-up phases."""
    return _process_group_unix
