"""How a healing replica group gets its peer's state (raylane.loop.distributed.ft_transport): served
on one address, not every interface, and loaded with `weights_only=True`, so that a payload with a
pickled object is refused and never run. Real sockets on this machine; the two-group heal through
it is tests/e2e/test_ft_loop.py's."""

from __future__ import annotations

import datetime
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchft", reason="needs raylane[fault-tolerance]")

from raylane.loop.distributed import ft  # noqa: E402
from raylane.loop.distributed.ft_transport import BoundTransport, HealRefused, serving_host  # noqa: E402
from tests.unit.test_ft_steps import _config, _trainer, one_group  # noqa: E402, F401 (the fixture)

SECOND = datetime.timedelta(seconds=5)


class _Planted:
    """An object whose unpickling writes `marker`: what a payload must never get to do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "ran"))


def _serve(payload: bytes) -> ThreadingHTTPServer:
    """An HTTP server on 127.0.0.1 answering every GET with `payload` (as a hostile peer would)."""

    class Answer(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _saved(obj: object) -> bytes:
    import io

    from torch.distributed._serialization import _streaming_save

    buf = io.BytesIO()
    _streaming_save(obj, buf)
    return buf.getvalue()


# Seen failing: with torchft's own loader (HTTPTransport._load_from_address, weights_only=False)
# on the same payload, the marker file is written ("ran").
def test_a_payload_with_a_pickled_object_is_refused_not_run(tmp_path):
    marker = tmp_path / "ran"
    server = _serve(_saved({"user": {"model": {"w": torch.ones(2)}, "x": _Planted(marker)}, "torchft": {"step": 3}}))
    transport = BoundTransport("127.0.0.1", SECOND)
    try:
        address = f"http://127.0.0.1:{server.server_address[1]}/checkpoint/"
        with pytest.raises(HealRefused, match=r"holds more than tensors and plain values; refused, not loaded"):
            transport.recv_checkpoint(0, address, 3, SECOND)
        assert not marker.exists()
        with pytest.raises(HealRefused, match="not an http address"):
            transport.recv_checkpoint(0, f"file://{tmp_path}/", 3, SECOND)
    finally:
        transport.shutdown()
        server.shutdown()
        server.server_close()


def test_the_state_is_served_on_one_address_for_its_step_only_and_not_after_the_commit():
    transport = BoundTransport("127.0.0.1", datetime.timedelta(seconds=1))
    try:
        host, port = transport._server.server_address[:2]
        assert host == "127.0.0.1" and transport.metadata() == f"http://127.0.0.1:{port}/checkpoint/"
        other = _other_address()
        if other is not None:  # torchft's own serves every interface ("", 0): reached here too
            with pytest.raises(ConnectionRefusedError), socket.create_connection((other, port), timeout=2):
                pass
        state = {"model": {"w": torch.arange(4.0)}, "optimizer": {"groups": [{"lr": 0.1, "betas": (0.9, 0.99)}]}}
        transport.send_checkpoint([1], 7, state, SECOND)
        got = transport.recv_checkpoint(0, transport.metadata(), 7, SECOND)
        assert torch.equal(got["model"]["w"], state["model"]["w"]) and got["optimizer"] == state["optimizer"]
        with pytest.raises(Exception, match="409"):  # another step's
            transport.recv_checkpoint(0, transport.metadata(), 6, SECOND)
        transport.disallow_checkpoint()  # the commit: the state may change from now on
        with pytest.raises(Exception, match="409"):
            transport.recv_checkpoint(0, transport.metadata(), 7, SECOND)
    finally:
        transport.shutdown()


def test_the_serving_address_is_loopback_or_this_nodes_on_the_route_to_rank_0():
    assert serving_host("127.0.0.1") == "127.0.0.1" and serving_host("localhost") in ("127.0.0.1", "::1")
    other = _other_address()
    if other is not None:
        assert serving_host(other) == other


# Seen failing with a pathlib.Path planted in the optimizer's part (ReplicaGroups._optimizer_state):
# HealRefused ("Unsupported global: GLOBAL pathlib.PosixPath").
def test_a_replica_groups_recovery_state_loads_as_tensors_and_plain_values(tmp_path, one_group, monkeypatch):  # noqa: F811
    """What a healing group copies (weights, AdamW's state and groups, the Trainer's state, torchft's
    counters), taken from a grouped run of 2 steps, through the transport and back."""
    for key, value in one_group.items():
        monkeypatch.setenv(key, value)
    trainer = _trainer(
        _config(tmp_path, "grouped", train={"max_steps": 2}, fault_tolerance={"enabled": True, "replica_groups": 1})
    )
    assert isinstance(trainer.replicas, ft.ReplicaGroups)
    trainer.train()
    state = trainer.replicas.manager._manager_state_dict()
    transport = BoundTransport("127.0.0.1", SECOND)
    try:
        transport.send_checkpoint([1], 2, state, SECOND)
        got = transport.recv_checkpoint(0, transport.metadata(), 2, SECOND)
    finally:
        transport.shutdown()
    assert set(got["user"]) == {"model", "optimizer", "trainer"} and got["torchft"]["step"] == 2
    assert got["user"]["trainer"]["step"] == 2
    weights = got["user"]["model"]
    assert all(torch.equal(weights[name], p) for name, p in trainer.model.named_parameters())
    assert got["user"]["optimizer"]["state"] and got["user"]["optimizer"]["groups"][0]["lr"] > 0


def test_a_refused_heal_ends_the_run_in_one_line_not_a_retry_every_step():
    from torchft.manager import ExceptionWithTraceback

    class Manager:
        def __init__(self, error: Exception | None) -> None:
            self.error = error

        def errored(self) -> ExceptionWithTraceback | None:
            return ExceptionWithTraceback(self.error) if self.error else None

    class Group:
        group = ft.ReplicaGroup(1, 2, "")

    refusing = Group()
    refusing.manager = Manager(HealRefused("the state a peer served at http://h:1/checkpoint/3/full holds more"))
    with pytest.raises(HealRefused, match=r"^replica group 1: the state a peer served at http://h:1/"):
        ft.ReplicaGroups._refused(refusing)
    for other in (None, TimeoutError("a peer's all-reduce")):  # a peer lost in the step: taken again
        refusing.manager = Manager(other)
        ft.ReplicaGroups._refused(refusing)


def _other_address() -> str | None:
    """An address of this machine other than loopback, if it has one."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("192.0.2.1", 9))  # TEST-NET: no packet is sent
            address = probe.getsockname()[0]
    except OSError:
        return None
    return None if address.startswith("127.") else address
