"""Checkpoints. A sharded state (FSDP) is saved with torch.distributed.checkpoint: every rank
writes its own shard, rank 0 the metadata, and it loads at another world size. A replicated state
(DDP, one process), the same on every rank, is written by rank 0 alone as one `state.pt`
(`torch.save`, loaded with `weights_only=True`), with every rank's random generators, which
reach rank 0 in the commit's gather: DCP's planning and metadata cost several times the write
itself for small models (bench B9), and a file per rank is a write per rank on object storage.
Both load into DDP, FSDP or one process, at any world size; replicated checkpoints written by
earlier versions in DCP's format still load.

Each checkpoint is a fresh directory committed by `manifest.json`, written last and atomically by
rank 0. It holds the train state (epoch, step, position in the epoch, the resolved config,
raylane's version), the shape of every model parameter and buffer, and the size and SHA-256 of
every file of every rank (read and checked by raylane.loop.checkpoint.manifest). A directory without a
manifest, or whose files do not match it (truncated, bit-flipped, missing), is never loaded:
the newest valid one is used instead.

A checkpoint is saved in two halves. `raylane.loop.checkpoint.staging.Stager.stage` copies the state into
CPU buffers kept from one save to the next: the only part that must happen between two optimizer
steps. `write` and `PendingSave.commit` (DCP's collectives, the files, the checksums, the
manifest) can then run on a background thread, whose collectives go to the group given to
`collectives_on`."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import io
import json
import os
import random
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from raylane.errors import RaylaneError
from raylane.loop.aliases import aliases, unexplained, without_aliases

# The commit record's reading and checks live in a torch-free module; re-exported here.
from raylane.loop.checkpoint.manifest import (  # noqa: F401
    CHECKPOINT_PREFIX,
    MANIFEST_FILE,
    checkpoint_name,
    committed,
    latest_valid,
    newest_valid,
    prune,
    read_manifest,
    sha256,
    verify,
)
from raylane.loop.frozen import base_of, frozen_names, mismatch, records_of, saved_part

# A single process without a process group is a supported DCP mode, not a mistake.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

STATE_FILE = "state.pt"  # a replicated state's model and optimizer, written by rank 0


def _digest(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        return {"size": path.stat().st_size, "sha256": sha256(f)}


def rng_file(rank: int) -> str:
    return f"rng_{rank}.json"


def rng_state() -> dict[str, Any]:
    """This rank's random generators (torch, numpy, python) as plain JSON: nothing to unpickle."""
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    py_version, py_state, py_gauss = random.getstate()
    return {
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
        "numpy": [np_kind, np_keys.tolist(), np_pos, np_has_gauss, np_gauss],
        "python": [py_version, list(py_state), py_gauss],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["torch"])), dtype=torch.uint8))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    version, py_state, py_gauss = state["python"]
    random.setstate((version, tuple(py_state), py_gauss))


def _own_files(path: Path, rank: int) -> dict[str, dict[str, Any]]:
    """The files this rank wrote into a sharded checkpoint (DCP names data files
    `__<rank>_<n>.distcp`); a replicated state's `state.pt` is written later, by the commit."""
    names = [*path.glob(f"__{rank}_*.distcp"), path / rng_file(rank)]
    if rank == 0:
        names.append(path / ".metadata")
    return {p.name: _digest(p) for p in names if p.is_file()}


def _dcp():
    """torch.distributed.checkpoint, imported at the first save or load rather than with this
    module: it pulls in DTensor, sympy and torch.fx (~1 s of CPU per rank on 2 cores), which
    would otherwise sit between launch and the first step of every run."""
    import torch.distributed.checkpoint as dcp
    import torch.distributed.checkpoint.state_dict  # noqa: F401 - get_state_dict, set_state_dict

    return dcp


def _save_errors() -> tuple[type[BaseException], ...]:
    # DCP's CheckpointException derives from BaseException, not Exception.
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


class CheckpointSaveError(RaylaneError, RuntimeError):
    """A checkpoint could not be written; raised on every rank alike. Nothing was committed, so
    the previous checkpoint is still the latest valid one."""


_collectives = threading.local()


@contextlib.contextmanager
def collectives_on(group: Any) -> Iterator[None]:
    """Run this thread's checkpoint collectives on `group`: a save committed on a background
    thread must never share a process group with the training loop's collectives."""
    previous = getattr(_collectives, "group", None)
    _collectives.group = group
    try:
        yield
    finally:
        _collectives.group = previous


def _group() -> Any:
    return getattr(_collectives, "group", None)


# A commit's gather (each rank's generators, files and error, as JSON) fits in this many bytes
# per rank unless a rank wrote many files: one all_gather of fixed-size buffers then, where
# all_gather_object takes two and a pickle each way (~0.3 ms of each rank's CPU per save on
# 2 busy cores, bench B9). A larger payload takes the second, general round.
GATHER_BUFFER_BYTES = 1 << 15


def _gather(obj: Any) -> list[Any]:
    """Every rank's JSON-able `obj`, in rank order, on every rank."""
    group = _group()
    if not (dist.is_initialized() and dist.get_world_size(group) > 1):
        return [obj]
    data = json.dumps(obj).encode()
    fits = len(data) <= GATHER_BUFFER_BYTES
    mine = torch.zeros(GATHER_BUFFER_BYTES + 8, dtype=torch.uint8)
    mine[:8] = torch.tensor([len(data) if fits else -1], dtype=torch.int64).view(torch.uint8)
    if fits:
        mine[8 : 8 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, mine, group=group)
    lengths = [int(part[:8].view(torch.int64)) for part in parts]
    if min(lengths) < 0:  # some rank's did not fit: every rank takes the general round
        gathered: list[Any] = [None] * len(parts)
        dist.all_gather_object(gathered, obj, group=group)
        return gathered
    return [json.loads(part[8 : 8 + n].numpy().tobytes()) for part, n in zip(parts, lengths, strict=True)]


def _describe(exc: BaseException, rank: int) -> str:
    """'rank N: Type: message', naming the rank where it started: DCP re-raises one rank's
    failure on every rank as a CheckpointException that maps ranks to their errors."""
    failures = getattr(exc, "failures", None)
    if failures:
        rank, exc = next(iter(sorted(failures.items())))
        exc = exc[0] if isinstance(exc, tuple) else exc
    return f"rank {rank}: {type(exc).__name__}: {exc}"


class PendingSave:
    """A checkpoint whose shards are written but which is not committed yet. `commit()` is
    collective: every rank calls it, on the same group as the write. A replicated state is
    written at the commit instead: rank 0's `whole` state, with every rank's `rng`."""

    def __init__(
        self,
        path: Path,
        rank: int,
        train_state: dict[str, Any],
        error: str | None = None,
        shapes: dict[str, list[int]] | None = None,
        *,
        whole: dict[str, Any] | None = None,
        rng: str | None = None,
        replicated: bool = False,
        aliases: dict[str, str] | None = None,
        records: dict[str, Any] | None = None,
    ) -> None:
        self.path, self.rank, self.train_state, self.error = path, rank, train_state, error
        self.shapes, self.whole, self.rng, self.replicated = shapes, whole, rng, replicated
        self.aliases, self.records = aliases, records or {}

    @property
    def step(self) -> int:
        return int(self.train_state["step"])

    def commit(self) -> None:
        """Gather every rank's checksums and let rank 0 write the manifest: the commit. Any rank's
        failure raises CheckpointSaveError on all ranks. The last gather, after rank 0's
        manifest, is also what keeps every rank from going on before the commit exists."""
        files: dict[str, Any] = {}
        error = self.error
        try:
            if error is None and not self.replicated:  # a replicated state has no file before the commit
                files = _own_files(self.path, self.rank)
        except OSError as exc:  # reported on every rank below
            error = _describe(exc, self.rank)
        gathered = _gather({"files": files, "error": error, "rng": self.rng})
        _fail_if(self.step, [part["error"] for part in gathered])
        manifest_error = None
        if self.rank == 0:
            try:
                if self.whole is not None:
                    files[STATE_FILE] = _save_durably(
                        self.path / STATE_FILE, {**self.whole, "rng": [part["rng"] for part in gathered]}
                    )
                # The model's other names for tensors saved once (raylane.loop.aliases), for readers.
                named = {"aliases": self.aliases} if self.aliases else {}
                # What the state depends on and does not hold (raylane.loop.frozen): a frozen
                # base, whose weights it leaves out, and the tokenizer of its inputs.
                named.update(self.records)
                _write_manifest(
                    self.path,
                    {
                        "train_state": self.train_state,
                        "shapes": self.shapes,
                        **named,
                        "files": {k: v for part in [*gathered[1:], {"files": files}] for k, v in part["files"].items()},
                    },
                )
            except _save_errors() as exc:
                manifest_error = _describe(exc, 0)
        raise_if_any(self.step, manifest_error, only_rank_zero=True)


def raise_if_any(step: int, error: str | None, *, only_rank_zero: bool = False) -> None:
    """Collective: each rank passes its error or None; if any (or rank 0's, with
    `only_rank_zero`) is set, every rank raises the same CheckpointSaveError."""
    if only_rank_zero:
        _fail_if(step, [_from_rank_zero(error)])
    else:
        _fail_if(step, _gather(error))


def _from_rank_zero(message: str | None) -> str | None:
    """Rank 0's `message`, on every rank: one small broadcast when it is None (the usual case)
    rather than an object broadcast's two and its pickles."""
    group = _group()
    if not (dist.is_initialized() and dist.get_world_size(group) > 1):
        return message
    flag = torch.tensor([message is not None], dtype=torch.uint8)
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast(flag, src=src, group=group)
    if not flag.item():
        return None
    box = [message]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def _fail_if(step: int, errors: list[str | None]) -> None:
    errors = [e for e in errors if e]
    if errors:
        detail = "; ".join(dict.fromkeys(errors))  # one line per distinct failure
        raise CheckpointSaveError(f"checkpoint at step {step} was not saved ({detail})")


def _write_manifest(path: Path, manifest: dict[str, Any]) -> None:
    tmp = path / (MANIFEST_FILE + ".tmp")
    # One line: json's C encoder does not indent, and its Python one cost ~0.5 ms per save on 2
    # busy cores (bench B9). `python -m json.tool manifest.json` shows it indented.
    _write_durably(tmp, json.dumps(manifest, sort_keys=True))
    os.replace(tmp, path / MANIFEST_FILE)  # the commit: appears whole or not at all
    _fsync_dir(path)  # the rename itself, and the checkpoint's own entry in its parent
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(path: Path, text: str) -> None:
    # DCP fsyncs its own files; a manifest may only name files that would survive a crash.
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


class _Hashing:
    """A file's write(), hashing what goes through it: a digest without reading the file back
    and without holding it whole in memory."""

    def __init__(self, f: io.BufferedWriter) -> None:
        self.f, self.digest, self.size = f, hashlib.sha256(), 0

    def write(self, data: bytes) -> int:
        self.digest.update(data)
        self.size += len(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def _save_durably(path: Path, state: dict[str, Any]) -> dict[str, Any]:
    """torch.save `state` to `path`, fsynced; returns its size and SHA-256."""
    with open(path, "wb") as f:
        hashing = _Hashing(f)
        torch.save(state, hashing)
        f.flush()
        os.fsync(f.fileno())
    return {"size": hashing.size, "sha256": hashing.digest.hexdigest()}


def live_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The state DCP saves and loads: the model's and the optimizer's, keyed by parameter name,
    each tensor once (under its canonical name: raylane.loop.aliases), and without the frozen
    base of a model trained on one (raylane.loop.frozen)."""
    model_sd, optim_sd = _dcp().state_dict.get_state_dict(model, optimizer)
    return {"model": saved_part(model, without_aliases(model_sd, aliases(model))), "optim": optim_sd}


def replicated(model: torch.nn.Module) -> bool:
    """Every rank holds the whole state (DDP, one process), not a shard of it (FSDP's DTensors).
    It depends on the model alone, so every rank reaches the same answer."""
    return not any(hasattr(p, "_local_tensor") for p in model.parameters())


def write(
    path: str | os.PathLike,
    state: dict[str, Any],
    train_state: dict[str, Any],
    *,
    rank: int,
    rng: dict[str, Any],
    error: str | None = None,
    replicated: bool = False,
    aliases: dict[str, str] | None = None,
    records: dict[str, Any] | None = None,
) -> PendingSave:
    """Collective (on the group of `collectives_on`): write this rank's shard of `state` and its
    random generators into `path`. A rank that failed before (`error`: staging) still takes
    part in DCP's collectives, with nothing to write. Errors are kept for `commit()`, so that
    every rank learns of them together.

    A `replicated` state is written by `commit()`: rank 0 alone writes it, as one `state.pt`
    holding every rank's generators too. Every rank would write an identical copy, and DCP's
    planning (about a dozen collectives and their pickles) and metadata cost more than the write
    itself for small models (bench B9). `aliases`: the model's other names for tensors the state
    holds once (recorded in the manifest); `records`: raylane.loop.frozen.records_of (idem)."""
    path = Path(path)
    shapes = model_shapes(state.get("model") or {}) if rank == 0 and error is None else None
    if replicated:
        whole = state if rank == 0 and error is None else None
        # As one JSON string: torch.save pickles a list of ~1,250 ints per rank in Python, ~1 ms.
        return PendingSave(
            path,
            rank,
            train_state,
            error=error,
            shapes=shapes,
            whole=whole,
            rng=json.dumps(rng),
            replicated=True,
            aliases=aliases,
            records=records,
        )
    try:
        _dcp().save({} if error else state, checkpoint_id=str(path), process_group=_group())
        if error is None:
            _write_durably(path / rng_file(rank), json.dumps(rng))
    except _save_errors() as exc:  # reported on every rank by commit()
        error = error or _describe(exc, rank)
    return PendingSave(path, rank, train_state, error=error, shapes=shapes, aliases=aliases, records=records)


def model_shapes(model_state: dict[str, Any]) -> dict[str, list[int]]:
    """Name -> full shape (a shard's global one) of every tensor of a model state dict."""
    return {k: list(v.shape) for k, v in model_state.items() if isinstance(v, torch.Tensor)}


class CheckpointLoadError(RaylaneError, RuntimeError):
    """A committed checkpoint that this model and optimizer cannot load; raised on every rank."""


def check_shapes(
    path: str | os.PathLike,
    recorded: dict[str, list[int]] | None,
    model_state: dict[str, Any],
    names: dict[str, str] | None = None,
) -> None:
    """The model about to load `path` has the parameters its manifest recorded (when it did):
    one line naming the first that differs, rather than DCP's error from every rank. Canonical
    names are compared: `names` (alias -> canonical) leaves out the aliases an earlier version
    recorded too."""
    if not recorded:
        return
    names = names or {}
    recorded = {k: v for k, v in recorded.items() if k not in names}
    live = {k: v for k, v in model_shapes(model_state).items() if k not in names}
    for name in sorted(set(recorded) | set(live)):
        if recorded.get(name) != live.get(name):
            was = "absent" if name not in recorded else f"shape {recorded[name]}"
            now = "absent" if name not in live else f"shape {live[name]}"
            raise CheckpointLoadError(
                f"checkpoint {path} does not fit this run's model: {name} is {was} there and {now} here "
                "(the config changed the model); start a fresh run with another run.name"
            )


def begin_save(
    path: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    train_state: dict[str, Any],
    *,
    rank: int,
) -> PendingSave:
    """Collective: every rank calls it with its own `path` (the same one on shared storage).
    Writes the live state on this thread; `commit()` next."""
    error, state = None, {}
    try:
        state = live_state(model, optimizer)
    except _save_errors() as exc:
        error = _describe(exc, rank)
    return write(
        path,
        state,
        train_state,
        rank=rank,
        rng=rng_state(),
        error=error,
        replicated=replicated(model),
        aliases=aliases(model),
        records=records_of(model),
    )


def save(
    path: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    train_state: dict[str, Any],
    *,
    rank: int,
) -> None:
    """Synchronous save and commit (collective)."""
    begin_save(path, model, optimizer, train_state, rank=rank).commit()


def load(
    path: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    rank: int | None = None,
    hooks: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Collective. Loads in place (resharding if the world size changed); returns the train state.
    With `rank`, also restores that rank's random generators when the world size is unchanged.
    `hooks`: the hooks' states by key as they are now (raylane.loop.hooks), which a sharded
    checkpoint loads into in place; the train state's "hook_states" holds what was saved of them.

    A sharded checkpoint's DCP `.metadata` is a pickle: only load checkpoints this project wrote
    (trusted storage). A replicated one's `state.pt` is read with `weights_only=True`."""
    if not (Path(path) / MANIFEST_FILE).exists():
        raise FileNotFoundError(f"{path} is not a committed checkpoint (no {MANIFEST_FILE})")
    dcp = _dcp()
    names = aliases(model)
    model_sd, optim_sd = dcp.state_dict.get_state_dict(model, optimizer)
    model_sd = saved_part(model, without_aliases(model_sd, names))
    manifest = read_manifest(path)
    if problem := mismatch(path, manifest, model):
        raise CheckpointLoadError(problem)
    check_shapes(path, manifest.get("shapes"), model_sd, names)
    # Not strict: the aliases are loaded through their canonical tensor; what else is missing is
    # checked below.
    options, rngs = dcp.state_dict.StateDictOptions(strict=False), None
    groups = group_layout(optim_sd, names)  # before a DCP load replaces them with the checkpoint's
    saved_hooks = set((manifest.get("train_state") or {}).get("hooks") or ())
    if (Path(path) / STATE_FILE).exists():
        state = torch.load(Path(path) / STATE_FILE, map_location="cpu", weights_only=True)
        rngs = state.pop("rng", None)
        state["model"] = without_aliases(state["model"], names)  # an earlier version saved them too
        # Whole tensors into a sharded model (a DDP run resumed under FSDP): each rank keeps its shard.
        if not replicated(model):
            options = dcp.state_dict.StateDictOptions(full_state_dict=True, strict=False)
            if state.get("hooks") and hooks:  # the hooks' own tensors, sharded as the hooks hold them now
                state["hooks"] = _sharded_like(hooks, state["hooks"])
    else:
        state = {"model": model_sd, "optim": optim_sd}
        if wanted := {k: v for k, v in (hooks or {}).items() if k in saved_hooks}:
            state["hooks"] = wanted
        from torch.distributed.checkpoint.api import CheckpointException

        _check_groups(path, groups, _saved_group_count(path))
        try:
            dcp.load(state, checkpoint_id=str(path))
        except CheckpointException as exc:  # a BaseException, which the launchers' handlers would miss
            raise CheckpointLoadError(f"checkpoint {path} cannot be loaded ({_describe(exc, rank or 0)})") from None
    _check_groups(path, groups, group_layout(state["optim"], names))
    if options.full_state_dict and not state["optim"].get("state"):
        # Whole tensors into a sharded model, and an optimizer with no state (SGD without
        # momentum): torch's full-state-dict load needs a state tensor to find the device, so
        # the model is loaded alone and the groups' settings copied.
        loaded = dcp.state_dict.set_model_state_dict(model, state["model"], options=options)
        for group, saved in zip(optimizer.param_groups, state["optim"].get("param_groups") or (), strict=False):
            group.update({k: v for k, v in saved.items() if k != "params"})
    else:
        loaded = dcp.state_dict.set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options
        )
    # A frozen base is not in the checkpoint: its weights are the ones the pipeline loaded.
    frozen = frozen_names(model) if base_of(model) is not None else set()
    missing = [k for k in unexplained(loaded.missing_keys, names) if k not in frozen]
    unexpected = sorted(loaded.unexpected_keys)
    if missing or unexpected:
        name, where = (missing[0], "there") if missing else (unexpected[0], "here")
        raise CheckpointLoadError(
            f"checkpoint {path} does not fit this run's model: {name} is absent {where} "
            "(the config changed the model); start a fresh run with another run.name"
        )
    train_state = manifest["train_state"]
    if state.get("hooks"):
        train_state = {**train_state, "hook_states": state["hooks"]}
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    if rank is None or train_state.get("world_size") != world_size:
        return train_state
    rng = Path(path) / rng_file(rank)
    if rngs is not None and rank < len(rngs):
        set_rng_state(json.loads(rngs[rank]))
    elif rng.exists():
        set_rng_state(json.loads(rng.read_text()))
    return train_state


def group_layout(optim_state: dict[str, Any], names: dict[str, str]) -> list[tuple[str, ...]]:
    """An optimizer state's parameter groups, as the canonical names of their parameters."""
    return sorted(tuple(sorted({names.get(p, p) for p in g["params"]})) for g in optim_state.get("param_groups", ()))


def _saved_group_count(path: str | os.PathLike) -> int:
    """The parameter groups of a sharded checkpoint's optimizer, from DCP's metadata (its keys
    are `optim.param_groups.<index>.<key>`)."""
    keys = _dcp().FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return len({k.split(".")[2] for k in keys if k.startswith("optim.param_groups.")})


def _check_groups(path: str | os.PathLike, here: list[tuple[str, ...]], there: list[tuple[str, ...]] | int) -> None:
    """The checkpoint's optimizer groups its parameters as this run's does (`there`: the groups,
    or only their count): torch would load another grouping without a word and fail at the next
    step, or train with the wrong group's settings."""
    if there == (len(here) if isinstance(there, int) else here):
        return
    count = there if isinstance(there, int) else len(there)
    raise CheckpointLoadError(
        f"checkpoint {path} does not fit this run's optimizer: it groups the parameters differently ({count} "
        f"parameter group{'s' if count != 1 else ''} there, {len(here)} here: optim.weight_decay or "
        "optim.decay_norm_and_bias changed, or the pipeline's optimizer); keep them to resume it, or start a "
        "fresh run with another run.name"
    )


def _sharded_like(template: Any, full: Any) -> Any:
    """`full` (whole tensors, from a replicated checkpoint) with each tensor that `template`
    holds as a DTensor distributed the same way: a hook's state saved under DDP, resumed under
    FSDP (each rank keeps its shard)."""
    if isinstance(full, dict) and isinstance(template, dict):
        return {k: _sharded_like(template.get(k), v) for k, v in full.items()}
    if isinstance(full, (list, tuple)) and isinstance(template, (list, tuple)) and len(full) == len(template):
        return type(full)(_sharded_like(t, v) for t, v in zip(template, full, strict=True))
    if isinstance(full, torch.Tensor) and hasattr(template, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(full.to(template.device), template.device_mesh, template.placements)
    return full
