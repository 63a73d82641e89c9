"""Layer 3, MLflow: the tracking URI a run records to reaches an MLflow server that accepts it.

MLflow 3 answers 403 to a Host header it does not allow (localhost and private IPs only by
default; `--allowed-hosts` compares host:port as sent, port included), and raylane then trains
untracked. How the URI's host is read:

- a cluster-local Service name (`mlflow`, `mlflow.<ns>` for a namespace of the files,
  `mlflow.<ns>.svc`, `mlflow.<ns>.svc.cluster.local`): resolved against the Services of the
  files, in the namespace the name says (a bare name: the pod's own), as the files (or the
  kustomization's `namespace:`) place them; its port must be one the Service has, and the server
  the Service selects must allow the Host. An ExternalName Service leads out of the cluster.
- any other dotted name (`mlflow.ml.acme.internal`, a team's Ingress or an external server):
  external. When an Ingress of the files serves that host, its backend Service and port are
  resolved and the server must allow the host; otherwise only the scheme and the port's syntax
  are checked, since what answers there cannot be seen from the files.
- an IP address: compared with the server's allowed hosts only."""

from __future__ import annotations

import fnmatch
import ipaddress
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from raylane.k8s.model import Obj, env_value, get, same_namespace

Rule = tuple[str, str, str]
# MLflow 3's defaults when no --allowed-hosts is given (mlflow.server.security_utils).
MLFLOW_DEFAULT_HOSTS = ["localhost", "127.0.0.1", "[::1]", "0.0.0.0"]


@dataclass
class MlflowServer:
    obj: Obj
    allowed: list[str]  # the Host headers it accepts (patterns with *)
    labels: dict[str, Any]  # its pods' labels


def mlflow_servers(objects: list[Obj]) -> list[MlflowServer]:
    """Every Deployment (or StatefulSet, Pod) of the set that runs `mlflow server`."""
    out = []
    for obj in objects:
        body = obj.seen
        if obj.kind not in ("Deployment", "StatefulSet", "Pod") or not isinstance(body, dict):
            continue
        pod = body.get("spec") if obj.kind == "Pod" else get(body, "spec", "template", "spec")
        labels = (
            get(body, "metadata", "labels")
            if obj.kind == "Pod"
            else get(body, "spec", "template", "metadata", "labels")
        )
        for c in get(pod, "containers", default=[]) or []:
            words = [str(w) for w in (c.get("command") or []) + (c.get("args") or [])]
            if len(words) >= 2 and words[-1].count(" ") and words[-2] in ("-c", "-ec", "-ce"):
                words = words[:-1] + shlex.split(words[-1])  # sh -c "mlflow server ..."
            if "mlflow" in words and "server" in words[words.index("mlflow") :]:
                out.append(MlflowServer(obj, allowed_hosts(words, c), labels or {}))
    return out


def allowed_hosts(words: list[str], container: dict[str, Any]) -> list[str]:
    for i, word in enumerate(words):
        if word == "--allowed-hosts" and i + 1 < len(words):
            return [h.strip() for h in words[i + 1].split(",")]
        if word.startswith("--allowed-hosts="):
            return [h.strip() for h in word.split("=", 1)[1].split(",")]
    found = env_value(container, "MLFLOW_SERVER_ALLOWED_HOSTS")
    if found and found[1]:
        return [h.strip() for h in found[1].split(",")]
    return MLFLOW_DEFAULT_HOSTS + [f"{h}:*" for h in MLFLOW_DEFAULT_HOSTS] + ["private IP addresses"]


def host_allowed(allowed: list[str], host: str) -> bool:
    """mlflow.server.security_utils.is_allowed_host_header, and its private-IP defaults."""
    if "private IP addresses" in allowed:
        try:
            if ipaddress.ip_address(host.rsplit(":", 1)[0].strip("[]")).is_private:
                return True
        except ValueError:
            pass
    if "*" in allowed:
        return True
    return any(fnmatch.fnmatch(host, a) if "*" in a else host == a for a in allowed)


def is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def service_name(host: str, obj: Obj, objects: list[Obj]) -> tuple[str, str] | None:
    """(Service, namespace) of a cluster-local name (namespace "" where the files leave it
    open), None for an external one."""
    labels = host.split(".")
    namespaces = {o.namespace for o in objects if o.namespace} | {o.name for o in objects if o.kind == "Namespace"}
    if len(labels) == 1:
        return labels[0], obj.namespace
    if len(labels) >= 3 and labels[2] == "svc":
        return labels[0], labels[1]
    if len(labels) == 2 and labels[1] in namespaces:
        return labels[0], labels[1]
    return None


def check_mlflow(uri: str | None, path: str, obj: Obj, objects: list[Obj]) -> Iterator[Rule]:
    """The tracking URI is http(s) and, where the files show the way, reaches a server that allows it."""
    if uri is None:
        return
    parsed = urlparse(uri)
    said = f"MLFLOW_TRACKING_URI = {uri!r}"
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        yield (
            path,
            "raylane.mlflow-uri",
            (
                f"{said}: not an http(s) server; a file or sqlite store on the head is deleted with the cluster. "
                "Point it at the MLflow server (http://mlflow.<namespace>.svc.cluster.local:5000)"
            ),
        )
        return
    try:
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
    except ValueError:
        yield path, "raylane.mlflow-uri", f"{said}: {parsed.netloc!r} does not end in a port number"
        return
    host, sent = parsed.hostname, parsed.netloc.rpartition("@")[2]
    local = None if is_address(host) else service_name(host, obj, objects)
    target: list[Obj] | str | None = []  # an address, reached directly: only the Host header can be compared
    if local is not None:
        target = service_target(said, local, port, objects)
    elif not is_address(host):
        target = ingress_target(said, host, objects)
    if isinstance(target, str):
        yield path, "raylane.mlflow-service", target
        return
    servers = mlflow_servers(objects)
    if target is None or not servers:
        return  # the way leaves the files: what answers cannot be seen here
    behind = [s for s in servers if any(selects(svc, s) for svc in target)] or servers
    if not any(host_allowed(s.allowed, sent) for s in behind):
        yield (
            path,
            "raylane.mlflow-host",
            (
                f"{said}: Host {sent!r} is not in the MLflow server's allowed hosts ({', '.join(behind[0].allowed)}; "
                f"{behind[0].obj.label}); MLflow 3 answers 403 and the run trains untracked. Add {sent} to its "
                "--allowed-hosts (the port is part of the host)"
            ),
        )


def selects(service: Obj, server: MlflowServer) -> bool:
    wanted = get(service.seen, "spec", "selector", default={}) or {}
    return bool(wanted) and all(server.labels.get(k) == v for k, v in wanted.items())


def service_target(said: str, local: tuple[str, str], port: int, objects: list[Obj]) -> list[Obj] | str | None:
    """The Services a cluster-local name reaches, None when the way leaves the files (no such
    Service and no MLflow server here, an ExternalName Service), or why it is wrong."""
    name, namespace = local
    services = [o for o in objects if o.kind == "Service" and o.name == name]
    if not services:
        return (
            f"{said}: no Service {name!r} in these files, beside the MLflow server" if mlflow_servers(objects) else None
        )
    here = [s for s in services if same_namespace(s.namespace, namespace)]
    if not here:
        return (
            f"{said} names Service {name} in namespace {namespace!r}, but these files put it in "
            f"{services[0].namespace!r}: the run would reach no MLflow and train untracked (name "
            f"{name}.{services[0].namespace}.svc.cluster.local, and allow that host in --allowed-hosts)"
        )
    service = here[0]
    if get(service.seen, "spec", "type") == "ExternalName":
        return None  # DNS leads out of the cluster: what answers there is not in the files
    if port not in [p.get("port") for p in get(service.seen, "spec", "ports", default=[]) or []]:
        return f"{said}: Service {name!r} has no port {port}"
    return [service]


def ingress_target(said: str, host: str, objects: list[Obj]) -> list[Obj] | str | None:
    """An external name: the Service an Ingress of the files routes it to, else None (external)."""
    for ingress in (o for o in objects if o.kind == "Ingress"):
        for rule in get(ingress.seen, "spec", "rules", default=[]) or []:
            pattern = str(get(rule, "host", default="") or "")
            if not pattern or not fnmatch.fnmatch(host, pattern):
                continue
            backend = get(rule, "http", "paths", 0, "backend", "service") or get(
                ingress.seen, "spec", "defaultBackend", "service"
            )
            name, port = get(backend, "name"), get(backend, "port", default={}) or {}
            services = [
                o
                for o in objects
                if o.kind == "Service" and o.name == name and same_namespace(o.namespace, ingress.namespace)
            ]
            ports = (get(services[0].seen, "spec", "ports", default=[]) or []) if services else []
            if not any(p.get("port") == port.get("number") or p.get("name") == port.get("name") for p in ports):
                shown = port.get("number") or port.get("name")
                return f"{said}: {ingress.label} routes {host} to Service {name!r} port {shown}, which these files do not define"
            return services
    return None
