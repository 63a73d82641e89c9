"""The cluster addresses a command is given, checked before anything starts: the Ray cluster that
`train`, `tune` and `autotune` join (its GCS, `HOST:PORT`) and the jobs API `submit` talks to (the
dashboard, `http://HOST:PORT`, and whether it is on this machine). Each must be well formed, its
host must resolve and something must listen on its port: a TCP connect, milliseconds where the peer is up or refuses, at most
JOIN_TIMEOUT_S where packets vanish. Ray itself waits minutes, and then names the host's own
address rather than the one given. Nothing here imports Ray."""

from __future__ import annotations

import ipaddress
import os
import socket
from urllib.parse import urlsplit

from raylane.config import ConfigError

# How long joining a cluster waits for it to answer: this module's connect, then (cluster.join)
# ray.init's connection to the cluster's GCS.
# RAYLANE_JOIN_TIMEOUT_S: longer for a cluster across a slow link, shorter for tests.
JOIN_TIMEOUT_S = float(os.environ.get("RAYLANE_JOIN_TIMEOUT_S", "10"))


def address_field(address: str | None) -> str:
    """Where a cluster address came from, as the user set it: RAY_ADDRESS or --address."""
    return "RAY_ADDRESS" if address and os.environ.get("RAY_ADDRESS") == address else "--address"


def join_hint(field: str) -> str:
    """What to try when the cluster named by `field` does not answer."""
    if job := os.environ.get("SLURM_JOB_ID"):
        # A head on a Slurm allocation (the batch script's, raylane.clusters.slurm): `raylane up`
        # is not in play there.
        return (
            f"under Slurm (job {job}) the head's srun output says why it did not answer; "
            "RAYLANE_JOIN_TIMEOUT_S gives a slow head longer"
        )
    if field == "RAY_ADDRESS":
        return "check it (`raylane up` prints its head's address) or unset RAY_ADDRESS for a local cluster"
    return f"check the address (`raylane up` prints it) or leave {field} out for a local cluster"


def check_gcs_address(address: str | None) -> None:
    """`address` names a Ray cluster that answers: `HOST:PORT` (or `ray://HOST:PORT`). None,
    "auto" and "local" are Ray's own choices and pass."""
    if address in (None, "", "auto", "local"):
        return
    field = address_field(address)
    shown = f"{field} = {address!r}"
    if address.startswith(("http://", "https://")):
        raise ConfigError(
            f"{shown}: a dashboard URL (the jobs API, for `raylane submit`); a run joins the "
            "cluster's GCS address, HOST:PORT (`raylane up` prints it)"
        )
    host, port = split_host_port(address.removeprefix("ray://"))
    if host is None:
        raise ConfigError(
            f"{shown}: not a Ray address: expected HOST:PORT, the cluster's GCS address (`raylane up` prints it)"
        )
    why = unreachable(host, port)
    if why:
        raise ConfigError(f"{shown}: {why}; {join_hint(field)}")


def jobs_url(address: str, field: str = "--address") -> tuple[str, str, int]:
    """(URL, host, port) of a jobs API address (a Ray dashboard's URL): ConfigError unless it is
    one. Nothing is connected to yet: see `unreachable`."""
    parts = urlsplit(address)
    try:
        port = parts.port
    except ValueError:  # a port that is not a number
        port = -1
    if parts.scheme not in ("http", "https") or not parts.hostname or port == -1:
        raise ConfigError(
            f"{field} = {address!r}: not a jobs API URL: expected http://HOST:PORT, the cluster's "
            "dashboard (`raylane up` prints it; Ray's default port is 8265)"
        )
    return address.rstrip("/"), parts.hostname, port or (443 if parts.scheme == "https" else 80)


def split_host_port(text: str) -> tuple[str | None, int]:
    """(host, port) of `HOST:PORT` (`[v6]:PORT` too); (None, 0) when it is not one."""
    host, sep, port = text.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None, 0
    return host, int(port)


def unreachable(host: str, port: int, what: str = "Ray cluster", timeout_s: float = JOIN_TIMEOUT_S) -> str | None:
    """None when a TCP connection to host:port opens within `timeout_s`; else why not, as a clause
    about `what` should have answered there."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except socket.gaierror as exc:
        return f"cannot resolve host {host!r} ({exc.strerror})"
    except TimeoutError:
        return f"no {what} answers there within {timeout_s:g} s"
    except ConnectionRefusedError:
        return f"no {what} answers there (connection refused: nothing listens on that port)"
    except OSError as exc:
        return f"no {what} answers there ({exc.strerror or type(exc).__name__})"


def listening(host: str, port: int, timeout_s: float = 1.0) -> bool:
    """Whether something accepts a TCP connection on host:port within `timeout_s`: a local head's
    GCS (raylane.clusters.local), a Slurm head's (raylane.onray.slurm). A connect rather than the
    kernel's socket table (psutil.net_connections): the host may be another node, and a listening
    socket bound to another interface would not answer."""
    return unreachable(host, port, timeout_s=timeout_s) is None


def on_this_machine(host: str) -> bool:
    """`host` is this machine: a loopback address, or one of its own (a socket can bind to it).
    socket.gaierror when it does not resolve."""
    infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    for family, _, _, _, sockaddr in infos:
        if ipaddress.ip_address(str(sockaddr[0]).split("%")[0]).is_loopback:  # less an IPv6 scope
            return True
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((sockaddr[0], 0))
                return True
        except OSError:
            continue
    return False


def version_mismatch(
    field: str,
    address: str,
    cluster_ray: str | None,
    here_ray: str,
    cluster_python: str | None = None,
    here_python: str | None = None,
) -> str | None:
    """The one line for a cluster whose Ray differs from this client's (a job, a run's driver and
    its workers must all run the same Ray), or None when they match or the cluster's is unknown."""
    if not cluster_ray or cluster_ray == here_ray:
        return None
    pythons = f" (Python {cluster_python} there, {here_python} here)" if cluster_python and here_python else ""
    return (
        f"{field} = {address!r}: the cluster runs Ray {cluster_ray}, this raylane Ray {here_ray}{pythons}; "
        f"install ray=={cluster_ray} here, or start the cluster with Ray {here_ray}"
    )


def reported_versions(text: str) -> tuple[str, str, str, str] | None:
    """(cluster's Ray, cluster's Python, this process's Ray, its Python) from the error ray.init
    raises on a version mismatch ("Version mismatch: The cluster was started with: Ray: ...");
    None for any other error."""
    import re

    if "Version mismatch" not in text:
        return None
    rays, pythons = re.findall(r"Ray: (\S+)", text), re.findall(r"Python: (\S+)", text)
    if len(rays) < 2 or len(pythons) < 2:
        return None
    return rays[0], pythons[0], rays[1], pythons[1]
