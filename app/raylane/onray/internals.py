"""Every name raylane takes from Ray's internals, in one place, with why and the Ray releases it
was checked on. Ray promises nothing for these; tests/unit/test_ray_internals.py resolves each (and
fails naming it), so that a Ray upgrade that moves one fails in the suite, not in a user's run,
and no other module of raylane may name `_internal` or `_private` (the same test reads them).

The public API comes first wherever Ray offers one (ScalingConfig, FailureConfig, RunConfig,
DataConfig, TorchConfig, TorchTrainer, ray.train.get_context). Nothing here is imported until a
name is used: `raylane.onray.output` and the cluster helpers use the worker module's names without
importing Ray Train."""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # for type checkers and IDEs; at run time, __getattr__ below
    pass

# The Ray releases every name below was checked on (tests/unit/test_ray_internals.py on each).
CHECKED_ON = ("2.59.0", "2.60.0")

# The name raylane's code uses -> (module, attribute or None for the module itself, why).
NAMES: dict[str, tuple[str, str | None, str]] = {
    "TorchBackend": (
        "ray.train.torch.config",
        "_TorchBackend",
        "subclassed: each worker installs raylane's signal handlers once its process group is up",
    ),
    "ControllerCallback": (
        "ray.train.v2._internal.execution.callback",
        "ControllerCallback",
        "the driver hears when the Train controller is up (start-up phases)",
    ),
    "get_train_context": (
        "ray.train.v2._internal.execution.context",
        "get_train_context",
        "Ray's drain notice, read on each worker without get_preemption_info()'s barrier",
    ),
    "train_context_module": (
        "ray.train.v2._internal.execution.context",
        None,
        "its logger (named after its file) is quietened on the workers",
    ),
    "ray_state": (
        "ray._private.state",
        "state",
        "Ray's published cluster config (node groups): whether an autoscaler may add nodes for a placement",
    ),
    "internal_kv_get": (
        "ray.experimental.internal_kv",
        "_internal_kv_get",
        "the autoscaler's status (`__autoscaling_status`): its node types say whether it may add nodes",
    ),
    "DatasetsCallback": (
        "ray.train.v2._internal.callbacks.datasets",
        "DatasetsCallback",
        "left out of a run that streams no Ray Data (its manager actor costs ~3 s of CPU)",
    ),
    "PlacementGroupCleanerCallback": (
        "ray.train.v2._internal.callbacks.placement_group_callback",
        "PlacementGroupCleanerCallback",
        "left out of a driver's run (a detached actor: ~2 s of CPU, ~600 MB)",
    ),
    "DefaultFailurePolicy": (
        "ray.train.v2._internal.execution.failure_handling",
        "DefaultFailurePolicy",
        "subclassed: a node's notice (handover) is not counted as a failure",
    ),
    "FailureDecision": (
        "ray.train.v2._internal.execution.failure_handling",
        "FailureDecision",
        "the failure policy's answers (RETRY for a handover, RAISE for bad input)",
    ),
    "ElasticScalingPolicy": (
        "ray.train.v2._internal.execution.scaling_policy",
        "ElasticScalingPolicy",
        "subclassed: sizes that split the global batch, a handover before growing",
    ),
    "FixedScalingPolicy": (
        "ray.train.v2._internal.execution.scaling_policy",
        "FixedScalingPolicy",
        "subclassed: no autoscaler requests on an embedded cluster",
    ),
    "NoopDecision": (
        "ray.train.v2._internal.execution.scaling_policy.scaling_policy",
        "NoopDecision",
        "the elastic policy waits for a handover",
    ),
    "TrainController": (
        "ray.train.v2._internal.execution.controller",
        "TrainController",
        "subclassed (warm workers): its worker group gives the ranks no env_vars the controller already has",
    ),
    "WorkerGroup": (
        "ray.train.v2._internal.execution.worker_group",
        "WorkerGroup",
        "subclassed (warm workers): the ranks' runtime_env less what they inherit",
    ),
    "train_env_vars": (
        "ray.train.v2._internal.constants",
        "get_env_vars_to_propagate",
        "the variables Ray Train hands its controller, compared with the cluster's environment",
    ),
    "WARN_ASYNC_GET_VAR": (
        "ray._common.constants",
        "RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR",
        "the variable Ray Train always sets on its controller (raylane up's head sets it alike)",
    ),
    "WARN_ASYNC_GET_DEFAULT": (
        "ray.train.v2._internal.constants",
        "DEFAULT_RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_VALUE",
        "its value there unless the driver sets one",
    ),
    "NODE_ID_KEY": (
        "ray._raylet",
        "RAY_NODE_ID_KEY",
        "the label that keeps the Train controller on the driver's node, as Ray Train places it",
    ),
    "AuthInterceptor": (
        "ray._private.authentication.grpc_authentication_client_interceptor",
        "SyncAuthenticationMetadataClientInterceptor",
        "the cluster's token on the raylet's PrestartWorkers call (the warm pool's refill)",
    ),
    "node_manager_pb2": (
        "ray.core.generated.node_manager_pb2",
        None,
        "PrestartWorkersRequest: the raylet's only way to start job-less workers after its start",
    ),
    "node_manager_grpc": ("ray.core.generated.node_manager_pb2_grpc", None, "the raylet's gRPC stub"),
    "GcsClient": (
        "ray._raylet",
        "GcsClient",
        "the Slurm wait counts the nodes that joined without becoming a driver (ray.init needs this host's raylet up)",
    ),
    "ray_common_pb2": ("ray.core.generated.common_pb2", None, "the Language enum (PYTHON) of that request"),
    "ray_worker": (
        "ray._private.worker",
        None,
        "_global_node (the GCS answered; its monitor process at shutdown; its session folder) and print_to_stdstream "
        "(what raylets push to the driver, routed to raylane's log)",
    ),
}

# Private methods and attributes of public or internal classes that raylane overrides or reads:
# (module, dotted attribute, why). Resolved by the test like NAMES.
MEMBERS: tuple[tuple[str, str, str], ...] = (
    (
        "ray.train.torch",
        "TorchTrainer._initialize_and_run_controller",
        "overridden: raylane's failure and scaling policies go to the controller",
    ),
    ("ray.train.torch", "TorchTrainer._create_default_callbacks", "overridden: callbacks added and left out"),
    (
        "ray.train.torch",
        "TorchTrainer._register_sigint_handler",
        "called as Ray Train does, by raylane's own controller launch (warm workers)",
    ),
    (
        "ray.train.v2._internal.execution.worker_group",
        "WorkerGroup._get_worker_runtime_env",
        "overridden (warm workers): without the env_vars the ranks inherit from the controller",
    ),
    (
        "ray.train.v2._internal.execution.controller",
        "TrainController.worker_group_cls",
        "set (warm workers): the controller's worker group class",
    ),
    ("ray.train", "DataConfig._resolve_execution_options", "the eval split's execution options"),
    (
        "ray.train.v2._internal.execution.scaling_policy",
        "ElasticScalingPolicy._count_possible_workers",
        "overridden: only sizes that split the global batch",
    ),
    (
        "ray.train.v2._internal.execution.scaling_policy",
        "ElasticScalingPolicy._get_reserved_resources",
        "the workers that fit, when a handover times out",
    ),
    (
        "ray.train.v2._internal.execution.scaling_policy",
        "ElasticScalingPolicy._get_resize_decision",
        "the resize after a handover",
    ),
    (
        "ray.train.v2._internal.execution.scaling_policy",
        "FixedScalingPolicy._maybe_send_resource_request",
        "overridden: no autoscaler request on an embedded cluster",
    ),
    (
        "ray.train.v2._internal.execution.scaling_policy",
        "FixedScalingPolicy._cancel_resource_request",
        "overridden with it",
    ),
    ("ray._private.worker", "_global_node", "set once ray.init's GCS has answered"),
    (
        "ray._private.node",
        "Node.get_session_dir_path",
        "an embedded cluster's session folder: the next launch stops what of it a killed driver left",
    ),
    ("ray._private.worker", "print_to_stdstream", "replaced: the raylets' lines go to raylane's log"),
)

# Instance attributes set by a method (module, class.method, attribute, why): the test reads the
# method's source for the assignment.
SET_BY: tuple[tuple[str, str, str, str], ...] = (
    (
        "ray.dashboard.modules.dashboard_sdk",
        "SubmissionClient._check_connection_and_version_with_url",
        "_server_ray_version",
        "the cluster's Ray, compared with this client's before `raylane submit` submits",
    ),
)


def __getattr__(name: str) -> Any:
    if name not in NAMES:
        raise AttributeError(f"module 'raylane.onray.internals' has no attribute {name!r}")
    module, attribute, _ = NAMES[name]
    found = import_module(module)
    return found if attribute is None else getattr(found, attribute)


def resolve(module: str, dotted: str | None) -> Any:
    """The object at `module` + `dotted` attributes (for the test)."""
    found = import_module(module)
    for part in dotted.split(".") if dotted else []:
        found = getattr(found, part)
    return found
