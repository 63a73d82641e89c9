"""The one call raylane makes to a raylet: PrestartWorkers, which starts job-less Python workers
for a `raylane up` head's warm pool (raylane.onray.warmpool). Ray has no public API for it; the
gRPC stub, its messages and Ray's token interceptor are Ray's internals, named in
raylane.onray.internals (and checked on each Ray release there)."""

from __future__ import annotations

import os

KEEP_ALIVE_S = 24 * 3600  # a prestarted worker is not trimmed as idle for this long
PRESTART_TIMEOUT_S = 10.0  # one gRPC call to this machine's raylet
PRESTART_MAX = 10  # the raylet starts at most this many per call (restart_workers_api_max_num_workers)


def prestart(raylet: str, num: int) -> None:
    """The PrestartWorkers call of the raylet at `raylet` (host:port): `num` job-less Python workers
    with an empty runtime_env, kept from the idle killer for KEEP_ALIVE_S; they start in the
    background. Token auth: the head has it on, so the call carries the cluster's token (Ray's own
    interceptor; RAY_AUTH_MODE is read at Ray's import)."""
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    import grpc

    from raylane.onray.internals import AuthInterceptor, node_manager_grpc, node_manager_pb2, ray_common_pb2

    with grpc.intercept_channel(grpc.insecure_channel(raylet), AuthInterceptor()) as channel:
        request = node_manager_pb2.PrestartWorkersRequest(
            language=ray_common_pb2.PYTHON, num_workers=num, keep_alive_duration_secs=KEEP_ALIVE_S
        )
        node_manager_grpc.NodeManagerServiceStub(channel).PrestartWorkers(request, timeout=PRESTART_TIMEOUT_S)
