"""How a healing replica group gets its peer's state (raylane.loop.distributed.ft): torchft's
`CheckpointTransport`, raylane's own. Each rank serves its state over HTTP to the same rank of a
group that heals from it, and a healing rank fetches it from there.

Why not torchft's `HTTPTransport` (0.2.0, the Manager's default): it serves on every interface
(`("", 0)`, hard-coded in its constructor) and loads what it fetches with
`torch.load(weights_only=False)`, so whatever answers at a peer's address runs code in the
healing rank. A subclass cannot change either soundly: the bind is in the constructor, before
which nothing can be hooked, and replacing its server afterwards leaves a window in which a
connection to every interface is accepted and later served. So this implements the transport's
small public interface (`torchft.checkpointing.CheckpointTransport`) itself: the server binds
this node's address on the group's network (127.0.0.1 when the groups meet on loopback), and the
state loads with `weights_only=True` (tensors and plain Python values only; a payload with any
other object is refused, never run).

Left as torchft builds it (its Python Manager hard-codes the bind, no argument changes it): group
rank 0's ManagerServer (gRPC, Rust) listens on every interface (`[::]:TORCHFT_MANAGER_PORT`, a
free port by default) without authentication; it answers quorum and commit calls, tells a caller
where this rank's state is served, and has a `kill` call that ends the process."""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import logging
import pickle
import socket
import threading
import urllib.request
import warnings
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch
from torch.distributed._serialization import _streaming_load, _streaming_save
from torch.utils._pytree import tree_flatten, tree_unflatten
from torchft.checkpointing import CheckpointTransport

log = logging.getLogger(__name__)  # the library log: a peer's request is no line of raylane's
# torch's streaming load warns once that a fetched tensor shares the read bytes; the heal copies
# each one into the rank's own (raylane.loop.distributed.ft), so nothing writes through them.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)


class HealRefused(RuntimeError):
    """A peer's state that is more than tensors and plain values: not loaded."""


def serving_host(master_addr: str) -> str:
    """The address this rank serves its state on: 127.0.0.1 (::1) when its group's rank 0 is
    reached on loopback (`master_addr`, MASTER_ADDR: every group on this machine), else this
    node's own address on the route to it, which the other groups reach (a rank on another node
    than its group's rank 0 gets its own node's)."""
    family, _, _, _, (address, *_) = socket.getaddrinfo(master_addr, None, proto=socket.IPPROTO_TCP)[0]
    if ipaddress.ip_address(address).is_loopback:
        return str(address)
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((address, 9))  # a datagram socket's connect sends nothing: it picks the route
        return str(probe.getsockname()[0])


class _Server(ThreadingHTTPServer):
    daemon_threads = True


class _Server6(_Server):
    address_family = socket.AF_INET6


class BoundTransport(CheckpointTransport[dict[str, Any]]):
    """The state served on `host` only (a free port), between a step's quorum and its commit,
    and fetched with `weights_only=True`. `timeout`: how long a request waits for the state and
    a commit for the requests being served."""

    def __init__(self, host: str, timeout: datetime.timedelta) -> None:
        self._timeout_s = timeout.total_seconds()
        self._ready = threading.Condition()
        self._step: int | None = None  # the step served; None: none now
        self._state: dict[str, Any] | None = None
        self._readers = 0
        self._server = (_Server6 if ":" in host else _Server)((host, 0), _handler(self))
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.1}, name="raylane-heal-server", daemon=True
        )
        self._thread.start()

    def metadata(self) -> str:
        host, port = (str(part) for part in self._server.server_address[:2])
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{port}/checkpoint/"

    def send_checkpoint(
        self, dst_ranks: list[int], step: int, state_dict: dict[str, Any], timeout: datetime.timedelta
    ) -> None:
        values, spec = tree_flatten(state_dict)
        values = [v.cpu() if torch.is_tensor(v) else v for v in values]
        with self._ready:
            self._state, self._step = tree_unflatten(values, spec), step
            self._ready.notify_all()

    def disallow_checkpoint(self) -> None:
        """Called at every commit: once it returns the state may change, so nothing is read."""
        with self._ready:
            self._step = None
            if not self._ready.wait_for(lambda: self._readers == 0, timeout=self._timeout_s):
                raise TimeoutError(f"a peer still reading this rank's state after {self._timeout_s:g} s")
            self._state = None

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: datetime.timedelta) -> dict[str, Any]:
        url = f"{metadata}{step}/full"
        if not url.startswith("http://"):  # urllib would open file: and ftp: addresses too
            raise HealRefused(f"a peer's state at {url!r}: not an http address; refused")
        with urllib.request.urlopen(url, timeout=timeout.total_seconds()) as f:
            try:
                return _streaming_load(f, weights_only=True)  # type: ignore[return-value]
            except pickle.UnpicklingError as e:
                raise HealRefused(
                    f"the state a peer served at {url} holds more than tensors and plain values; refused, not "
                    f"loaded (torch.load weights_only=True: {str(e).splitlines()[0]})"
                ) from None

    def shutdown(self, wait: bool = True) -> None:
        self._server.shutdown()  # within its poll interval
        self._server.server_close()

    @contextlib.contextmanager
    def serving(self, step: int) -> Iterator[dict[str, Any] | None]:
        """The state of `step` while a request sends it (None: not served, or another step's),
        held from the commit's `disallow_checkpoint` until it is sent. Waits for the state up to
        the timeout: a peer may ask before this rank's quorum thread has offered it."""
        with self._ready:
            self._ready.wait_for(lambda: self._step is not None, timeout=self._timeout_s)
            if self._step != step:
                yield None
                return
            self._readers += 1
            state = self._state
        try:
            yield state
        finally:
            with self._ready:
                self._readers -= 1
                self._ready.notify_all()


def _handler(transport: BoundTransport) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        timeout = transport._timeout_s  # each socket operation's: no request holds a thread for ever

        def do_GET(self) -> None:
            parts = self.path.split("/")
            if len(parts) != 4 or parts[1] != "checkpoint" or parts[3] != "full" or not parts[2].isdigit():
                self.send_error(404, "expected /checkpoint/<step>/full")
                return
            try:
                with transport.serving(int(parts[2])) as state:
                    if state is None:
                        self.send_error(409, f"step {parts[2]} is not served now")
                        return
                    self.send_response(200)
                    self.send_header("Content-type", "application/octet-stream")
                    self.end_headers()
                    _streaming_save(state, self.wfile)
            except OSError as e:  # the peer went away mid-transfer: its heal fails, it asks again
                log.info("sending this rank's state to %s failed: %s", self.client_address, e)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
            log.debug(format, *args)

    return Handler
