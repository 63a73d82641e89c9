"""What the driver records on the MLflow run besides params (raylane.tracking.runs) and rank 0's metrics:
the host rank 0 runs on, every committed checkpoint, and at the end the checkpoint list, the
final model (an MLflow PyTorch model, registered with `--register`) and PNG plots.

Nothing here may fail or stall a run: during training everything goes through a buffering
background logger; at the end each record is tried on its own and a failure is a warning."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from raylane.config import BaseConfig
from raylane.loop.protocols.events import Checkpoint, End, Event, FirstStep, Start
from raylane.loop.protocols.result import RunResult
from raylane.results import Status
from raylane.tracking.observe import log_profiles, log_rank_times, log_stacks
from raylane.tracking.runs import MetricLogger, RunHandle, mlflow_client

log = logging.getLogger("raylane.tracking")

PLOTTED = {
    "loss": ("train/loss", "eval/loss"),
    "eval_metrics": ("eval/accuracy",),
    "throughput": ("train/samples_per_s",),
}


class RunRecorder:
    def __init__(self, handle: RunHandle, cfg: BaseConfig, *, prewarm: bool = False) -> None:
        """`prewarm`: this process does not train (a Ray driver), so it imports what the
        end-of-run records need while the workers train, instead of after the last step."""
        self.handle, self.cfg = handle, cfg
        self.checkpoints: list[dict[str, Any]] = []
        self._logger = MetricLogger(handle.tracking_uri, handle.run_id)
        self._prewarm = prewarm
        self._prewarming: threading.Thread | None = None
        self._result: RunResult | None = None

    def on_event(self, event: Event) -> None:
        match event:
            case FirstStep() if self._prewarm:
                self._prewarm = False
                # After the first step, so that start-up does not wait for it either.
                self._prewarming = threading.Thread(
                    target=_import_record_modules,
                    args=(self.cfg.mlflow.log_model,),
                    name="raylane-prewarm",
                    daemon=True,
                )
                self._prewarming.start()
            case Start():
                self._logger.set_tags({"raylane.host": event.host, **event.strategy_tags})
            case End(result=RunResult() as result):
                self._result = result
                self._log_run_rates(result)
                if result.stop_reason:  # an early stop (FINISHED), or a stop request
                    self._logger.set_tags({"raylane.stop_reason": result.stop_reason})
            case Checkpoint():
                self.checkpoints.append(
                    {
                        "step": event.step,
                        "location": event.location,
                        "metrics": event.metrics,
                        "time_unix": event.time_unix,
                    }
                )
                self._logger.log({"checkpoint/step": event.step}, event.step)
                self._logger.set_tags(
                    {"raylane.checkpoint.latest": event.location, "raylane.checkpoint.count": len(self.checkpoints)}
                )

    def record_resizes(self, resizes: list[dict[str, Any]]) -> None:
        """An elastic run's resizes: `run/world_size` at each resize's step, and the list as a tag."""
        if not resizes:
            return
        import json

        for resize in resizes:
            self._logger.log({"run/world_size": resize["to"]}, resize["step"])
        self._logger.set_tags({"raylane.resizes": json.dumps(resizes)})

    def _log_run_rates(self, result: RunResult) -> None:
        """The summary's whole-run throughput, named apart from train/*, which covers a window of
        steps each (the progress display's figures)."""
        if rates := {f"run/{k}": v for k, v in result.rates().items()}:
            self._logger.log(rates, result.steps)

    def finish(self, status: Status, checkpoint: str | None, register: str | None) -> dict[str, Any]:
        """Before the run is closed. Returns what was recorded (model URI, registered version)."""
        self._logger.close()
        if self._prewarming is not None:
            self._prewarming.join()  # torch.export is not thread-safe: one model export at a time
        client = mlflow_client(self.handle.tracking_uri)
        out: dict[str, Any] = {}
        attempt(
            "checkpoint list",
            lambda: client.log_dict(self.handle.run_id, {"checkpoints": self.checkpoints}, "checkpoints.json"),
        )
        if checkpoint and self.cfg.mlflow.log_checkpoints == "artifacts":
            attempt("checkpoint artifacts", lambda: _log_checkpoint_files(client, self.handle, checkpoint))
        if status == Status.FINISHED and checkpoint and self.cfg.mlflow.log_model:
            out.update(attempt("model", lambda: log_model(self.handle, checkpoint, register)) or {})
        attempt("plots", lambda: log_plots(client, self.handle))
        r, run_id = self._result, self.handle.run_id
        if r is not None and (rank_times := r.rank_times):
            attempt("per-rank step times", lambda: log_rank_times(client, run_id, rank_times, r.stragglers or []))
        if self.cfg.profile.enabled:
            attempt("profiles", lambda: log_profiles(client, run_id, self.cfg))
        if status == Status.FAILED:  # a hang's stacks are written only as the run fails
            attempt("stacks", lambda: log_stacks(client, run_id, self.cfg))
        return out


def _import_record_modules(model: bool) -> None:
    """Pay the end-of-run records' one-time costs while the workers train: the plots' imports
    (matplotlib) and, when the run logs its `model`, MLflow's PyTorch flavour, DCP and a first
    `save_model` of a two-weight model, which is torch.export's set-up, MLflow's scan of the
    installed packages for the requirements check, and the pyfunc loader that validates the input
    example (~3 s cold on 2 cores: spent for nothing by a run that logs no model)."""
    import tempfile

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot  # noqa: F401

        if not model:
            return
        import mlflow.pyfunc
        import mlflow.pytorch
        import numpy as np
        import torch
        from mlflow.models import infer_signature

        import raylane.export  # noqa: F401 - the checkpoint reader (DCP)

        example = np.zeros((2, 2), dtype=np.float32)  # 2 rows: export specialises a batch of 1
        with tempfile.TemporaryDirectory(prefix="raylane-prewarm-") as tmp:
            mlflow.pytorch.save_model(
                torch.nn.Linear(2, 1),
                f"{tmp}/model",
                input_example=example,
                signature=infer_signature(example, np.zeros((2, 1), dtype=np.float32)),
                pip_requirements=[f"torch=={torch.__version__.split('+')[0]}"],
            )
            mlflow.pyfunc.load_model(f"{tmp}/model").predict(example)
    except Exception as exc:  # noqa: BLE001 - finish() does it for real and reports what fails
        log.debug("prewarming the record modules failed: %s", exc)


def attempt(what: str, action: Callable[[], Any]) -> Any:
    """`action()`, best effort: its failure is one warning naming `what`, and None."""
    try:
        return action()
    except Exception as exc:  # noqa: BLE001 - records are best effort; the run's result stands
        # One line: some errors (torch.distributed.checkpoint's) carry whole tracebacks in their text.
        first = (str(exc).strip().splitlines() or [""])[0]
        log.warning("MLflow: could not record the %s: %s: %s", what, type(exc).__name__, first)
        log.debug("the %s's record failed", what, exc_info=exc)
        return None


def _log_checkpoint_files(client, handle: RunHandle, location: str) -> None:
    from raylane.loop.checkpoint.storage import local_copy

    with local_copy(location) as path:
        client.log_artifacts(handle.run_id, path, f"checkpoints/{Path(location).name}")


def log_model(handle: RunHandle, location: str, register: str | None) -> dict[str, Any]:
    """The checkpoint's consolidated model as an MLflow PyTorch model with a signature and an
    input example. MLflow 3 stores it as a torch.export program (model.pt2), not a pickle."""
    import mlflow
    import mlflow.pytorch
    import torch
    from mlflow.models import infer_signature

    from raylane.export import load_model, servable
    from raylane.loop.checkpoint.storage import local_copy

    with local_copy(location) as path:
        model, example = load_model(path)
        hf = _log_hf_model(handle, path, model, example, register)
    if hf is not None:
        return hf
    model.eval()
    # A dict batch's model takes its inputs by name: the signature names them, in the order the
    # logged model takes them positionally (MLflow's PyTorch flavour has no dict input).
    model, inputs, names = servable(model, example)
    with torch.no_grad():
        output = model(*inputs)
    arrays = [x.numpy() for x in inputs]
    named = names or (None if len(arrays) == 1 else [f"input_{i}" for i in range(len(arrays))])
    signature = infer_signature(dict(zip(named, arrays, strict=True)) if named else arrays[0], output.numpy())
    mlflow.set_tracking_uri(handle.tracking_uri)
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")  # our summary prints the run
    # The context marks the run FINISHED on exit; the driver sets its real status right after.
    with mlflow.start_run(run_id=handle.run_id):
        info = mlflow.pytorch.log_model(
            model,
            name="model",
            signature=signature,
            input_example=arrays[0] if len(arrays) == 1 else tuple(arrays),
            registered_model_name=register,
            # Explicit: inferring requirements imports the model in a subprocess (seconds).
            pip_requirements=[f"torch=={torch.__version__.split('+')[0]}"],
        )
    out = {"model_uri": info.model_uri}
    if register:
        out["registered_model"] = {"name": register, "version": info.registered_model_version}
    return out


def _log_hf_model(
    handle: RunHandle, checkpoint: str, model: Any, example: Any, register: str | None
) -> dict[str, Any] | None:
    """A transformers model (or a LoRA run's, merged) as MLflow's transformers flavour, with the
    run's tokenizer (raylane.hf.export); None for any other model, or one without a task or a
    tokenizer, which the PyTorch flavour logs."""
    import sys

    if "transformers" not in sys.modules:  # a pipeline that built one has imported it
        return None
    import mlflow

    from raylane.config import validate
    from raylane.hf.export import is_transformers, log_mlflow_model, tokenizer_for
    from raylane.loop import checkpoint as ck

    if not is_transformers(model):
        return None
    tokenizer = tokenizer_for(validate(ck.read_manifest(checkpoint)["train_state"]["config"]))
    mlflow.set_tracking_uri(handle.tracking_uri)
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    with mlflow.start_run(run_id=handle.run_id):
        info = log_mlflow_model(model, tokenizer, example, registered_model_name=register)
    if info is None:
        return None
    out = {"model_uri": info.model_uri}
    if register:
        out["registered_model"] = {"name": register, "version": info.registered_model_version}
    return out


def log_plots(client, handle: RunHandle) -> None:
    """Loss and eval curves, and throughput over time, as PNGs beside MLflow's own charts."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for name, keys in PLOTTED.items():
        histories = {k: client.get_metric_history(handle.run_id, k) for k in keys}
        histories = {k: v for k, v in histories.items() if v}
        if not histories:
            continue
        fig, ax = plt.subplots(figsize=(7, 4))
        for key, history in histories.items():
            if name == "throughput":
                t0 = min(m.timestamp for m in history)
                ax.plot([(m.timestamp - t0) / 1000 for m in history], [m.value for m in history], label=key)
                ax.set_xlabel("seconds since the first value")
            else:
                ax.plot([m.step for m in history], [m.value for m in history], marker=".", label=key)
                ax.set_xlabel("step")
        ax.legend()
        ax.grid(alpha=0.3)
        ax.set_title(f"{name.replace('_', ' ')}")
        client.log_figure(handle.run_id, fig, f"plots/{name}.png")
        plt.close(fig)
