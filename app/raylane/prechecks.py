"""What can be checked before any work starts, beyond what one config field says about itself:
the files a command will write, the metric a sweep or checkpoint retention ranks by, the
machine the workers land on, and what an earlier launch of the same run left on disk (its
newest checkpoint's manifest and its record, raylane.runrecord). The layout (strategy.tp, pp,
dp_replicate on the ranks) is raylane.layout_checks'.

The commands call these after the config validates and before Ray, torch's workers or MLflow
start, so that a mistake costs seconds, not a run whose results are then lost (a summary that
cannot be written after an hour of training). Each failure is one ConfigError naming the field
and the value; nothing here imports torch or Ray."""

from __future__ import annotations

import json
import os
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

from raylane import paths, pipelines_ref
from raylane.config import BaseConfig, ConfigError, check_metric, flatten
from raylane.config.batching import effective_global_batch
from raylane.config.workerenv import resolve as resolve_env
from raylane.errors import RaylaneError
from raylane.loop.checkpoint.manifest import CHECKPOINT_PREFIX, MANIFEST_FILE, newest_valid, read_manifest, verify
from raylane.runrecord import Finished, already_finished, fresh_name, newest_manifest

_UNSET = "(not set)"


def check_run(
    cfg: BaseConfig,
    *,
    folder: Path | None = None,
    summary_json: str | None = None,
    local_storage: bool = True,
    driver_env: bool = True,
) -> None:
    """A run's config and outputs. `folder`: the run's own folder (raylane.runrecord.run_folder,
    found once by the launch), whose checkpoints take precedence over `checkpoint.init_from`.
    `local_storage`: `run.storage_path` is on this machine (not under `raylane submit` to a remote
    cluster, whose job resolves it there). `driver_env`: this process's environment is the
    driver's, where each `${NAME}` value of `env:` is read (not under `raylane submit`: the job's
    driver reads them where it runs)."""
    if summary_json:
        writable_file("--summary-json", summary_json)
    if cfg.checkpoint.keep_best:  # best_metric ranks checkpoints only then
        check_metric("checkpoint.best_metric", cfg.checkpoint.best_metric, cfg)
    if cfg.train.early_stopping is not None:
        check_metric("train.early_stopping.metric", cfg.train.early_stopping.metric, cfg)
    if local_storage and driver_env:
        resolve_env(cfg.env)  # each `${NAME}` is set here, where the driver reads it
    if local_storage:
        check_storage("run.storage_path", cfg.run.storage_path)
        check_inputs(cfg)
        check_init_from(cfg, folder)


def check_inputs(cfg: BaseConfig) -> None:
    """Every input path of the config (raylane.paths) names a file, a folder or a glob's match;
    checkpoint.init_from has a check of its own (a run's own checkpoint takes precedence)."""
    for key, path in paths.missing_inputs(cfg):
        if key != "checkpoint.init_from":
            raise ConfigError(f"{key} = {path!r}: no such file or folder")


def check_storage(field: str, path: str) -> None:
    """Storage proven by writing there, not by permission bits, which say yes on a read-only or
    virtual filesystem and for root: a probe file, written and removed, in the folder (made if
    missing); on object storage, a probe object, within PROBE_TIMEOUT_S."""
    if paths.is_uri(path):
        _bounded(lambda: _probe_remote(path), f"{field} = {path!r}")
        return
    writable_dir(field, path)
    target = Path(path).expanduser().absolute()
    try:
        # Made and kept (the run writes there): removing it again raced other launches checking
        # the same path at once, every torchrun rank among them.
        target.mkdir(parents=True, exist_ok=True)
        probe = target / f".raylane-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"{field} = {path!r}: cannot write there ({exc.strerror or exc})") from None


# How long a check may wait on a network peer (object storage) before it gives up.
PROBE_TIMEOUT_S = 10.0


def _probe_remote(path: str) -> None:
    fs, root = paths.quick_filesystem(path)
    probe = f"{root.rstrip('/')}/.raylane-probe-{uuid.uuid4().hex}"
    with fs.open_output_stream(probe) as f:
        f.write(b"")
    fs.delete_file(probe)


class NoAnswer(RaylaneError):
    """`within`: the call did not return in time (it goes on, on a daemon thread)."""


def within(call: Any, timeout_s: float, name: str) -> Any:
    """`call()`'s result, run on a thread of its own for at most `timeout_s`: its exception is
    raised here, its silence is NoAnswer. The thread is a daemon: a peer that never answers
    never holds up the process's exit."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append((True, call()))
        except BaseException as exc:  # noqa: BLE001 - raised again on the waiting thread
            outcome.append((False, exc))

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not outcome:
        raise NoAnswer
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


def _bounded(probe: Any, what: str) -> None:
    """`probe()` within PROBE_TIMEOUT_S; its failure or silence is one ConfigError starting with `what`."""
    try:
        within(probe, PROBE_TIMEOUT_S, "raylane-probe")
    except NoAnswer:
        raise ConfigError(
            f"{what}: no answer within {PROBE_TIMEOUT_S:.0f} s (is the endpoint reachable? "
            f"AWS_ENDPOINT_URL = {os.environ.get('AWS_ENDPOINT_URL', '(not set)')!r})"
        ) from None
    except Exception as exc:  # noqa: BLE001 - one line
        raise ConfigError(f"{what}: cannot write a probe there ({paths.one_line(exc)})") from None


def check_init_from(cfg: BaseConfig, folder: Path | None) -> None:
    """`checkpoint.init_from`, a local checkpoint: committed, its files the sizes its manifest
    records (the checksums are the worker's, at load: seconds for a large model), and loadable
    with this config. Skipped for object storage, and when the run resumes a checkpoint of its
    own (in its `folder`), which takes precedence over init_from."""
    path, field = cfg.checkpoint.init_from, "checkpoint.init_from"
    if not path or "://" in path:
        return
    if folder is not None and folder.is_dir() and newest_manifest(folder) is not None:
        return
    where = Path(path).expanduser()
    if not where.is_dir():
        raise ConfigError(f"{field} = {path!r}: no such folder (expected runs/<name>/checkpoint_<step>)")
    try:
        manifest = read_manifest(where)
    except (OSError, ValueError):
        manifest = None
    if not isinstance(manifest, dict):
        raise ConfigError(f"{field} = {path!r}: not a committed checkpoint (no readable {MANIFEST_FILE})")
    if problem := verify(str(where), checksums=False):
        raise ConfigError(f"{field} = {path!r}: not a valid checkpoint ({problem})")
    recorded = (manifest.get("train_state") or {}).get("config")
    if isinstance(recorded, dict) and (key := first_unloadable(flatten(recorded), cfg.flat())) is not None:
        raise ConfigError(
            f"{key} = {_shown(cfg.flat(), key)}: {field} = {path!r} was saved with {key} = "
            f"{_shown(_as_saved(flatten(recorded)), key)}, which this config cannot load"
        )


def writable_file(field: str, path: str | Path) -> None:
    """A file can be written at `path`: its folder exists and is writable, and it is no folder."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise ConfigError(f"{field} = {str(path)!r}: is a directory; name a file")
    folder = p.parent
    if not folder.is_dir():
        raise ConfigError(f"{field} = {str(path)!r}: folder {str(folder)!r} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(f"{field} = {str(path)!r}: folder {str(folder)!r} is not writable")


def writable_dir(field: str, path: str | Path, value: str | None = None) -> None:
    """`path` is a writable folder, or one can be made there: its nearest existing ancestor is a
    writable folder. `value`: what the user typed, when `path` is derived from it."""
    shown = repr(value if value is not None else str(path))
    p = Path(path).expanduser().absolute()
    existing = next(a for a in (p, *p.parents) if a.exists())
    if not existing.is_dir():
        raise ConfigError(f"{field} = {shown}: {str(existing)!r} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{field} = {shown}: folder {str(existing)!r} is not writable")


def newest_in_run(path: str) -> str:
    """`path` itself, or for a run's folder (runs/<name>, which holds checkpoint_<step> folders
    and no manifest of its own) its newest valid checkpoint, named in one line."""
    folder = Path(path)
    if not folder.is_dir() or (folder / MANIFEST_FILE).exists() or not any(folder.glob(CHECKPOINT_PREFIX + "*")):
        return path
    newest, _ = newest_valid(str(folder.resolve()))
    if newest is None:
        raise ConfigError(
            f"checkpoint = {path!r}: a run folder with no valid checkpoint (every checkpoint_<step> "
            "in it is incomplete or damaged)"
        )
    print(f"raylane: exporting {newest}, the run's newest checkpoint", file=sys.stderr, flush=True)
    return newest


def check_export(checkpoint: str, out: str) -> None:
    """`raylane export`'s arguments. A missing folder of `--out` is fine: export makes it (the
    user named where the file goes), after the checkpoint has loaded."""
    if not Path(checkpoint).is_dir():
        raise ConfigError(
            f"checkpoint = {checkpoint!r}: no such folder (expected a run folder, runs/<name>, or one of its checkpoints, runs/<name>/checkpoint_<step>)"
        )
    try:
        base = read_manifest(checkpoint).get("base")
    except (OSError, ValueError):
        base = None  # the export says what is wrong with it
    if base:
        raise ConfigError(
            f"checkpoint = {checkpoint!r}: holds a LoRA adapter on the base {base.get('path')!r}, "
            "not a whole model; export it with --format hf (merged into its base) or --format hf "
            "--adapter-only"
        )
    target = Path(out).expanduser()
    if target.is_dir():
        raise ConfigError(f"--out = {out!r}: is a directory; name the file, e.g. {str(target / 'model.safetensors')!r}")
    writable_dir("--out", target.parent, out)


def check_export_hf(checkpoint: str, out: str, adapter_only: bool) -> None:
    """`raylane export --format hf`'s arguments: `--out` a folder that is new or empty (nothing
    written is overwritten), transformers and peft installed, and with `--adapter-only` a
    checkpoint that holds an adapter (a model trained on a frozen base)."""
    if not Path(checkpoint).is_dir():
        raise ConfigError(
            f"checkpoint = {checkpoint!r}: no such folder (expected a run folder, runs/<name>, or one of its checkpoints, runs/<name>/checkpoint_<step>)"
        )
    target = Path(out).expanduser()
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ConfigError(
            f"--out = {out!r}: {'is a file' if not target.is_dir() else 'is not empty'}; "
            "name a new or empty folder for the save_pretrained files"
        )
    writable_dir("--out", target, out)
    import importlib.util

    if missing := [m for m in ("transformers", "peft") if importlib.util.find_spec(m) is None]:
        raise ConfigError(f"--format hf: {missing[0]} is not installed; pip install 'raylane[hf]'")
    if adapter_only:
        try:
            manifest = read_manifest(checkpoint)
        except (OSError, ValueError):
            return  # the export says what is wrong with it
        if not manifest.get("base"):
            raise ConfigError(
                f"--adapter-only: checkpoint {checkpoint!r} holds a whole model (fine-tuned in full, "
                "not with lora:); export it without --adapter-only"
            )


def check_token_path() -> None:
    """RAY_AUTH_TOKEN_PATH, when set, names a readable file holding a token: Ray otherwise fails
    in the head's start-up, with a traceback in its log."""
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    if path is None:
        return
    try:
        token = Path(path).expanduser().read_text().strip()
    except OSError as exc:
        raise ConfigError(f"RAY_AUTH_TOKEN_PATH = {path!r}: cannot read it ({exc.strerror})") from None
    if not token:
        raise ConfigError(
            f"RAY_AUTH_TOKEN_PATH = {path!r}: the file is empty; it must hold the cluster's "
            "token (`ray get-auth-token --generate` writes one to ~/.ray/auth_token)"
        )


def oversubscription(cfg: BaseConfig, address: str | None) -> str | None:
    """A warning when a fresh embedded cluster (`address` None, as resolved by
    raylane.clusters.local.resolve_address) gets more worker CPUs than this machine has:
    Ray starts it with as many logical CPUs as asked, so the workers then share cores."""
    cores = os.cpu_count() or 1
    wanted = cfg.scaling.num_workers * cfg.scaling.cpus_per_worker
    if address is not None or wanted <= cores:
        return None
    return (
        f"warning: scaling.num_workers = {cfg.scaling.num_workers} x scaling.cpus_per_worker = "
        f"{cfg.scaling.cpus_per_worker:g} oversubscribes this machine's {cores} cores: "
        f"the workers will share them (slower, not wrong)"
    )


# -- an earlier launch of the same run (its folder and record: raylane.runrecord) --------------


def check_resume(cfg: BaseConfig, folder: Path | None) -> Finished | None:
    """A launch that continues an existing run (in its `folder`, raylane.runrecord.run_folder):
    its newest checkpoint must be loadable with this config (else ConfigError naming the first
    key that prevents it); returns Finished when the run already trained as far as this config
    asks, so that nothing is trained or logged again."""
    if folder is None or not folder.is_dir():
        return None
    newest = newest_manifest(folder)
    if newest is not None:
        path, manifest = newest
        state = manifest.get("train_state") or {}
        recorded = state.get("config")
        if isinstance(recorded, dict):
            _check_tokenizer(cfg, manifest.get("tokenizer"), path)
            recorded = _check_base(cfg, manifest.get("base"), recorded, path)
            _check_loadable(cfg, flatten(recorded), path)
            _check_position(cfg, state, flatten(recorded), path)
    return already_finished(cfg, folder)


def _check_base(cfg: BaseConfig, base: Any, recorded: dict[str, Any], checkpoint: Path) -> dict[str, Any]:
    """A checkpoint of a model trained on a frozen base (LoRA: raylane.loop.checkpoint.frozen) resumes only
    on that base: the config key that names it must name files of the same fingerprint. Returns
    the recorded config with that key as it is now when the base only moved (same fingerprint)."""
    if not isinstance(base, dict) or not base.get("key") or not base.get("fingerprint"):
        return recorded
    from raylane.loop.checkpoint.frozen import describe, fingerprint, tokenizer_changed, tokenizer_fingerprint

    key, flat = base["key"], cfg.flat()
    if key not in flat:
        return recorded
    now = fingerprint(str(flat[key]))
    if now is None:
        return recorded
    tokenizer = tokenizer_fingerprint(str(flat[key]))
    retokenized = tokenizer_changed(base, tokenizer)  # a base recorded before tokenizers were: no
    if now != base["fingerprint"] or retokenized:
        this = {"path": flat[key], "fingerprint": now, "tokenizer": tokenizer}
        raise ConfigError(
            f"{key} = {_shown(flat, key)}: run {cfg.run.name!r} has a checkpoint ({str(checkpoint)!r}) "
            f"trained on base {describe(base, retokenized)}; this base is {describe(this, retokenized)}. "
            f"Resume it on the base it was trained on, or start a fresh run with --set run.name={fresh_name(cfg)}"
        )
    section, _, field = key.partition(".")
    if isinstance(recorded.get(section), dict) and field in recorded[section]:
        recorded = {**recorded, section: {**recorded[section], field: flat[key]}}
    return recorded


def _check_tokenizer(cfg: BaseConfig, tokenizer: Any, checkpoint: Path) -> None:
    """A checkpoint that records the tokenizer its inputs were made with (the hf pipeline's,
    raylane.loop.checkpoint.frozen.set_tokenizer) resumes only with the same tokenizer files under its config
    key: one retrained in place keeps its path, and every token id would mean another token."""
    if not isinstance(tokenizer, dict) or not tokenizer.get("key") or not tokenizer.get("fingerprint"):
        return
    from raylane.loop.checkpoint.frozen import describe, tokenizer_fingerprint

    key, flat = tokenizer["key"], cfg.flat()
    now = tokenizer_fingerprint(str(flat[key])) if flat.get(key) else None
    if now is None or now == tokenizer["fingerprint"]:
        return  # no tokenizer there: the config's own checks say so
    raise ConfigError(
        f"{key} = {_shown(flat, key)}: run {cfg.run.name!r} has a checkpoint ({str(checkpoint)!r}) trained "
        f"with the tokenizer {describe(tokenizer)}; this tokenizer is {describe({'path': flat[key], 'fingerprint': now})}, "
        f"so every token id would mean another token. Resume it with the tokenizer it was trained with, or start "
        f"a fresh run with --set run.name={fresh_name(cfg)}"
    )


def check_global_order(cfg: BaseConfig, pipeline: pipelines_ref.Resolved) -> None:
    """A held global batch (train.global_batch, or an elastic run's) needs map-style data: a
    streaming source's epochs (`pipeline.streams`) are shared out by file, not by sample."""
    if effective_global_batch(cfg) is None:
        return
    if pipeline.streams:
        field = "train.global_batch" if cfg.train.global_batch else "scaling.num_workers"
        value = cfg.train.global_batch if cfg.train.global_batch else [cfg.scaling.min_workers, cfg.scaling.num_workers]
        raise ConfigError(
            f"{field} = {value!r}: the {pipeline.label} pipeline streams its data "
            "(sources), whose epochs are shared out by file, not by sample: a held global batch "
            "and elastic runs need a map-style dataset"
        )


def _check_position(cfg: BaseConfig, state: dict[str, Any], old: dict[str, Any], checkpoint: Path) -> None:
    """A checkpoint part-way through an epoch continues at its sample only with the same
    train.global_batch (the same order and the same samples per step)."""
    if not state.get("batch_in_epoch"):
        return  # at an epoch boundary: nothing to continue
    was, now = old.get("train.global_batch"), effective_global_batch(cfg)
    if was != now:
        raise ConfigError(
            f"train.global_batch = {now!r}: run {cfg.run.name!r} has a checkpoint part-way through "
            f"an epoch saved with train.global_batch = {was!r} ({str(checkpoint)!r}); keep "
            f"train.global_batch={json.dumps(was)} to continue it at the same sample, or start a fresh "
            f"run with --set run.name={fresh_name(cfg)}"
        )


def _optimizer_state(flat: dict[str, Any]) -> tuple[Any, ...]:
    """What shapes the optimizer's saved state: DCP cannot load a state that lacks an entry the
    new optimizer has (SGD has no `step`, Adam no `momentum`; SGD keeps a momentum buffer only
    with momentum; a schedule adds `initial_lr`), and its parameter groups (raylane.loop.optim:
    two with weight decay unless decay_norm_and_bias, which a config from before the key lacks:
    it had one group)."""
    name = flat.get("optim.name")
    return (
        "sgd" if name == "sgd" else "adam",
        name == "sgd" and bool(flat.get("optim.momentum")),
        flat.get("optim.schedule") != "constant" or bool(flat.get("optim.warmup_steps")),
        bool(flat.get("optim.weight_decay")) and flat.get("optim.decay_norm_and_bias", True) is False,
    )


def _as_saved(flat: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's flat config, with what a key added since meant then: before
    optim.decay_norm_and_bias, every parameter was decayed; before model.tie_embeddings, gpt's
    head was tied."""
    if flat.get("pipeline") == "gpt":  # before model.tie_embeddings, gpt's head was tied
        flat = {"model.tie_embeddings": True, **flat}
    return {"optim.decay_norm_and_bias": True, **flat} if "optim.weight_decay" in flat else flat


def first_unloadable(old: dict[str, Any], new: dict[str, Any]) -> str | None:
    """The first key whose change keeps a checkpoint saved under `old` (flat config) from
    loading under `new`: the pipeline, any model key (even dropout renames the layers after it),
    then the optimizer's state. Anything else (epochs, steps, workers, MLflow, checkpoint
    cadence, learning rate) may change on resume."""
    old = _as_saved(old)
    # lora.* shapes the adapter (raylane.hf.lora) as model.* shapes the model.
    model = dict.fromkeys(k for k in [*old, *new] if k.startswith(("model.", "lora.")))
    for key in ("pipeline", *model):
        if old.get(key, _UNSET) != new.get(key, _UNSET):
            return key
    was, now = _optimizer_state(old), _optimizer_state(new)
    if was[0] != now[0]:
        return "optim.name"
    if now[1] and not was[1]:
        return "optim.momentum"
    if now[2] and not was[2]:
        return "optim.schedule" if old.get("optim.schedule") != new.get("optim.schedule") else "optim.warmup_steps"
    if now[3] != was[3]:
        return (
            "optim.weight_decay"
            if bool(old.get("optim.weight_decay")) != bool(new.get("optim.weight_decay"))
            else "optim.decay_norm_and_bias"
        )
    return None


def _check_loadable(cfg: BaseConfig, old: dict[str, Any], checkpoint: Path) -> None:
    new, old = cfg.flat(), _as_saved(old)
    key = first_unloadable(old, new)
    if key is None:
        return
    was = old.get(key)
    keep = f"keep {key}={was if isinstance(was, str) else json.dumps(was)}" if key in old else f"drop {key}"
    raise ConfigError(
        f"{key} = {_shown(new, key)}: run {cfg.run.name!r} has a checkpoint saved with {key} = "
        f"{_shown(old, key)} ({str(checkpoint)!r}) that this config cannot load; {keep} to resume "
        f"it, or start a fresh run with --set run.name={fresh_name(cfg)}"
    )


def _shown(flat: dict[str, Any], key: str) -> str:
    return repr(flat[key]) if key in flat else _UNSET
