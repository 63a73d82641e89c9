"""What the driver hands each Ray Train worker (`LaunchSpec`) and the shape of the function a worker
group runs (`Worker`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from raylane.config import BaseConfig
from raylane.config.batching import HeldBatch
from raylane.onray.leftovers import ProcessId

if TYPE_CHECKING:
    from raylane.onray.runtime import RayRuntime

# The key of Ray Train's `train_loop_config` under which the workers get their LaunchSpec.
SPEC_KEY = "spec"


@dataclasses.dataclass(frozen=True)
class LaunchSpec:
    """What the driver hands each Ray Train worker (in Ray Train's `train_loop_config`, pickled
    across Ray): the run's config, the function the worker group runs (`worker`, as Ray Train
    takes `train_loop_per_worker`: `train_worker` for a training run, autotune's search for a
    search), and what connects the workers to the driver."""

    config: dict[str, Any]  # the run's config as JSON, validated again on the worker (its pipeline's own class)
    worker: Worker
    sink: Any  # the driver's EventSink actor
    driver: ProcessId  # the process whose end stops the workers (raylane.onray.leftovers)
    run_id: str | None = None  # the MLflow run rank 0 logs metrics to
    run_folder: str | None = None  # the run's folder (raylane.runrecord.run_folder), as the driver found it
    tracking_uri: str = ""
    streams: dict[str, int | None] = dataclasses.field(default_factory=dict)  # Ray Datasets: name -> rows per epoch
    verbose: bool = False  # the workers' own output reaches the driver (raylane.logs)
    world_sizes: list[int] | None = None  # an elastic run's sizes that hold the global batch
    restarts: bool = False  # the group restarts without a node that leaves, rather than the run stopping
    held: HeldBatch | None = None  # the global batch the driver held on the planned world (raylane.api.prepare_train)
    # fault_tolerance: the replica group these workers are (raylane.onray.replicas), None without.
    replica_group: int | None = None


# A worker group's function: (the run's config, the worker's runtime, the launch, its start-up
# phases so far) -> None. Its results reach the driver as rank 0's events (an End).
Worker = Callable[[BaseConfig, "RayRuntime", "LaunchSpec", dict[str, float]], None]


def launch_spec(train_loop_config: dict[str, Any]) -> LaunchSpec:
    """The LaunchSpec inside Ray Train's `train_loop_config` (on the driver, and on a worker)."""
    return train_loop_config[SPEC_KEY]
