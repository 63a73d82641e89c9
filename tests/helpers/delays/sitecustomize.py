"""Test-only: delays injected into a process at chosen places, to make a race happen on purpose.
Put this folder on PYTHONPATH (Python imports `sitecustomize` at start-up) and say where in
RAYLANE_TEST_DELAYS, entries separated by ';':

    call:raylane.tracking.health:stop_watch=3@rank=0   sleep 3 s before each call of that function
                                                        (on torchrun's rank 0 only, here)
    import:click=2@thread=raylane-start                sleep 2 s as module `click` starts executing,
                                                        when a thread whose name starts so imports it
    raise:mlflow.tracking@thread=raylane-start          that module's first import in such a thread
                                                        fails as a concurrent import can make it fail
                                                        (another thread's import caught half-way)

Only a process started fresh runs this (the suite's fork server's forks do not: run_cli(...,
fresh=True)); nothing of raylane reads the variable."""

from __future__ import annotations

import importlib.abc
import os
import sys
import threading
import time

ENV = "RAYLANE_TEST_DELAYS"


def _entries() -> tuple[dict[str, list[tuple[str, float, str | None]]], dict[str, tuple[float, str]], dict[str, str]]:
    calls: dict[str, list[tuple[str, float, str | None]]] = {}
    imports: dict[str, tuple[float, str]] = {}
    raises: dict[str, str] = {}
    for entry in filter(None, (e.strip() for e in os.environ.get(ENV, "").split(";"))):
        kind, rest = entry.split(":", 1)
        where, _, options = rest.partition("@")
        option = dict(o.split("=", 1) for o in options.split(",") if o)
        if kind == "raise":
            raises[where] = option.get("thread", "")
            continue
        target, seconds = where.rsplit("=", 1)
        if kind == "call":
            module, attr = target.split(":")
            calls.setdefault(module, []).append((attr, float(seconds), option.get("rank")))
        else:
            imports[target] = (float(seconds), option.get("thread", ""))
    return calls, imports, raises


CALLS, IMPORTS, RAISES = _entries()


def _delayed(function, seconds: float, rank: str | None):
    def delayed(*args, **kwargs):
        if rank is None or os.environ.get("RANK", "0") == rank:
            time.sleep(seconds)
        return function(*args, **kwargs)

    return delayed


class _Delays(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in CALLS and name not in IMPORTS and name not in RAISES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                break
        else:
            return None
        run = spec.loader.exec_module

        def exec_module(module):
            seconds, thread = IMPORTS.get(name, (0.0, ""))
            if seconds and threading.current_thread().name.startswith(thread):
                time.sleep(seconds)
            if name in RAISES and threading.current_thread().name.startswith(RAISES[name]):
                del RAISES[name]  # once: Python drops the half-imported module, and it imports again
                raise ImportError(
                    f"cannot import name 'MlflowClient' from partially initialized module {name!r} "
                    "(most likely due to a circular import)"
                )
            run(module)
            for attr, pause, rank in CALLS.get(name, []):
                setattr(module, attr, _delayed(getattr(module, attr), pause, rank))

        spec.loader.exec_module = exec_module
        return spec


if CALLS or IMPORTS or RAISES:
    sys.meta_path.insert(0, _Delays())
