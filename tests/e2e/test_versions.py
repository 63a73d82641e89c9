"""A cluster running another Ray than this client's: `raylane submit` and `--address` exit 2
before anything starts, naming both versions. The jobs API's answer is faked by a real HTTP
server on loopback that reports another Ray (two Ray releases cannot run side by side here); the
GCS join's error is Ray's own, made by Ray's version check from a cluster's faked metadata."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import ray

from raylane.clusters.addresses import reported_versions, version_mismatch

OTHER_RAY = "2.40.0"  # not the installed Ray (either end of the supported range)


class _OldJobsApi(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        body = json.dumps({"version": "4", "ray_version": OTHER_RAY, "ray_commit": "0" * 40}).encode()
        self.send_response(200 if self.path == "/api/version" else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def old_jobs_api():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _OldJobsApi)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_submit_to_a_cluster_on_another_ray_exits_2_naming_both(run_cli, tmp_path, old_jobs_api):
    p = run_cli("submit", "digits", "--address", old_jobs_api, name="submit")
    assert p.wait(60) == 2, p.output
    lines = p.output.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in p.output, p.output
    assert f"the cluster runs Ray {OTHER_RAY}, this raylane Ray {ray.__version__}" in lines[0], lines[0]
    assert f"--address = {old_jobs_api!r}" in lines[0]


def test_joining_a_cluster_on_another_ray_names_both_versions():
    from ray._private.utils import check_version_info  # Ray's own check, as ray.init runs it

    with pytest.raises(RuntimeError) as raised:
        check_version_info({"ray_version": OTHER_RAY, "python_version": "3.10.4"}, "node 10.0.0.7")
    versions = reported_versions(str(raised.value))
    assert versions is not None and versions[0] == OTHER_RAY and versions[2] == ray.__version__
    line = version_mismatch("--address", "10.0.0.7:6379", versions[0], versions[2], versions[1], versions[3])
    assert line == (
        f"--address = '10.0.0.7:6379': the cluster runs Ray {OTHER_RAY}, this raylane Ray "
        f"{ray.__version__} (Python 3.10.4 there, {versions[3]} here); install ray=={OTHER_RAY} here, "
        f"or start the cluster with Ray {ray.__version__}"
    )
    assert reported_versions("Connection refused") is None
    assert version_mismatch("--address", "x:1", ray.__version__, ray.__version__) is None
