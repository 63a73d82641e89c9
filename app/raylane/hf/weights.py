"""Pretrained weights as transformers loads them, read once per run, not once per rank.

Every rank builds the model on the meta device (`empty_model`: shapes, no memory; buffers real);
raylane parallelizes it (DDP, or FSDP2 per block) and gives it storage (`raylane.loop.distributed.fsdp.
materialize`); then `load_pretrained` runs on every rank: rank 0 alone loads the checkpoint with
transformers' own `from_pretrained` (its key renamings and conversions: experts saved one by one
and fused on load, say), and torch's `set_model_state_dict(..., broadcast_from_rank0=True)` sends
each tensor to the other ranks, straight into their DDP replica or their FSDP2 shard. Peak host
memory is one copy of the weights on rank 0 and one shard elsewhere, where a per-rank
`from_pretrained` holds a whole copy on every rank.

Every tensor of the model is accounted for: loaded from the files, or one that `from_pretrained`
itself starts (a new head, outside the base model: listed in one line), or a LoRA adapter's,
started as peft starts it. A tensor of the base model the files lack is an error, never a random
start: before the run (`check_weights`, from the files' headers: exit 2) and on rank 0 at load,
where every rank then raises it (`WeightsError`, one line)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from raylane.errors import DataError
from raylane.hf.files import AUTO_CLASSES, weight_files

log = logging.getLogger("raylane")

# The tensors an error names, at most; the count says the rest.
_SHOWN = 4
# safetensors' dtype names (a file's header) -> torch's, for the meta tensors of the check.
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class WeightsError(DataError):
    """Pretrained weights that cannot fill the model, found at load: one line, complete as it is,
    raised on every rank alike (a DataError: every launcher shows it as it is)."""

    def __init__(self, text: str) -> None:
        super().__init__(text, why=text)
        self.text = text

    def __str__(self) -> str:
        return self.text

    def __reduce__(self):  # to the driver through Ray, as itself
        return (WeightsError, (self.text,))


def empty_model(path: str | Path, task: str = "causal-lm", **config: Any) -> nn.Module:
    """The model saved in `path` (a save_pretrained folder) for `task`, built on the meta device:
    parameters without storage, buffers real (rotary frequencies are in no state dict). `config`:
    overrides of the saved config (num_labels=3, say)."""
    import transformers
    from accelerate import init_empty_weights

    auto = getattr(transformers, AUTO_CLASSES[task])
    model_config = transformers.AutoConfig.from_pretrained(path, **config)
    with init_empty_weights(include_buffers=False):
        model = auto.from_config(model_config)
    model.tie_weights()  # accelerate's meta parameters come untied: one tensor under both names again
    return model


def check_weights(
    path: str | Path, task: str = "causal-lm", *, key: str = "model.name_or_path", **config: Any
) -> list[str]:
    """Before anything starts: transformers' own load run on the files' names and shapes (meta
    tensors from the safetensors headers: nothing read, no memory), so that a checkpoint that
    cannot fill the model fails here (ValueError, one line naming `key`) rather than on rank 0.
    Returns the names `from_pretrained` would start itself (a new head)."""
    from safetensors import safe_open

    model = empty_model(path, task, **config)
    shapes: dict[str, torch.Tensor] = {}
    for file in weight_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                part = f.get_slice(name)
                dtype = _DTYPES.get(part.get_dtype(), torch.float32)
                shapes[name] = torch.empty(part.get_shape(), dtype=dtype, device="meta")
    where = f"{key} = {str(path)!r}"
    with _transformers_load() as reports:
        try:
            _, info = type(model).from_pretrained(
                None,
                config=model.config,
                state_dict=shapes,
                device_map={"": "meta"},
                dtype=_dtype(model),
                output_loading_info=True,
            )
        except Exception as exc:  # noqa: BLE001 - whatever transformers raises is this one line
            raise ValueError(_failed(where, model, reports, exc)) from None
    inside, outside = _split(model, info["missing_keys"])
    if inside:
        raise ValueError(_missing(where, model, inside))
    return outside


def load_pretrained(model: nn.Module, path: str | Path, *, key: str = "model.name_or_path") -> None:
    """Loads the weights saved in `path` into `model`, on every rank (a collective): rank 0 loads
    them with transformers' `from_pretrained` (the model's class, its config, the dtype of its
    parameters), the other ranks receive their part by broadcast. Call it after raylane has
    parallelized the model (a pipeline's `init_weights`). Weights `from_pretrained` starts itself
    (a new classification head) are listed in one line; a LoRA adapter starts as peft starts it;
    a tensor of the base model the files lack raises WeightsError on every rank, naming `key`.
    In the one-process build of a checkpoint's model (`raylane export`, the run's MLflow model:
    raylane.export.alone) this process reads them alone, even as rank 0 of a group whose peers
    have left (the torchrun driver at a run's end)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from raylane.export import alone

    model = getattr(model, "module", model)  # DDP's wrapper: its module's names
    distributed = dist.is_initialized() and dist.get_world_size() > 1 and not alone()
    rank = dist.get_rank() if distributed else 0
    full: dict[str, torch.Tensor] = {}
    failure: WeightsError | None = None
    tensors = _tensors(model, distributed)
    if rank == 0:
        try:
            full = _full_state(getattr(model, "stages", [model])[0], tensors, path, key)
        except WeightsError as exc:
            failure = exc
        except Exception as exc:  # noqa: BLE001 - any failure to read: one line on every rank, no rank left waiting
            _record("loading the pretrained weights failed:", _traceback(exc))
            failure = WeightsError(f"{key} = {str(path)!r}: the weights cannot be loaded: {_first_line(exc)}")
    if distributed:
        # Every rank learns of rank 0's failure before the broadcast, which would wait for it.
        box = [failure]
        dist.broadcast_object_list(box, src=0)
        failure = box[0]
    if failure is not None:
        raise failure
    if not distributed:
        model.load_state_dict(full)
        return
    # A pipeline stage's rank 0 sends every stage's tensors and keeps its own (not strict: the rest are extra).
    strict = not hasattr(model, "stages")
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=strict)
    set_model_state_dict(model, full, options=options)


def _tensors(model: nn.Module, distributed: bool) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{name: (shape, dtype)} of the model's state: every rank's under pipeline parallelism, where a
    rank holds its stages only (raylane.loop.distributed.pipeline_parallel.PipelineModel: `stages`), so that
    rank 0 reads and sends the other stages' tensors too (a collective there)."""
    mine = {name: (tuple(value.shape), value.dtype) for name, value in model.state_dict().items()}
    if not distributed or not hasattr(model, "stages"):
        return mine
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {name: held for part in every for name, held in part.items()}


def _full_state(
    model: nn.Module, tensors: dict[str, tuple[tuple[int, ...], torch.dtype]], path: str | Path, key: str
) -> dict[str, torch.Tensor]:
    """The state dict of `tensors` (the model's, by its own names; `model` holds its transformers
    model): the base's tensors as from_pretrained loads them, a LoRA adapter as peft starts it;
    WeightsError for anything else."""
    prefix, pretrained = _pretrained(model)
    where = f"{key} = {str(path)!r}"
    with _transformers_load() as reports:
        try:
            reference, info = _loading_class(pretrained).from_pretrained(
                str(path), config=pretrained.config, dtype=_dtype(model), output_loading_info=True
            )
        except Exception as exc:  # noqa: BLE001 - whatever transformers raises is this one line
            raise WeightsError(_failed(where, pretrained, reports, exc)) from None
    inside, outside = _split(pretrained, info["missing_keys"])
    if inside:
        raise WeightsError(_missing(where, pretrained, inside))
    loaded = reference.state_dict()
    full, unaccounted = {}, []
    for name, (shape, dtype) in tensors.items():
        own = _file_name(name, prefix)
        if own in loaded:
            full[name] = loaded[own]
        elif (adapter := _adapter_init(name, shape, dtype)) is not None:
            full[name] = adapter  # a DTensor's shape is the whole tensor's
        else:
            unaccounted.append(name)
    if unaccounted:
        raise WeightsError(f"{where}: {_names(unaccounted)} of the model: not in what from_pretrained loads")
    if outside:
        log.warning(
            "%s: %s not in the weights: initialized as from_pretrained does (outside the base model)",
            where,
            ", ".join(outside),
        )
    return full


def _pretrained(model: nn.Module) -> tuple[str, Any]:
    """(its path in `model`, the transformers model): `model` itself, or the base under a
    peft wrapper (`base_model.model`)."""
    from transformers import PreTrainedModel

    for name, module in model.named_modules():
        if isinstance(module, PreTrainedModel):
            return name, module
    raise WeightsError(f"{type(model).__name__} holds no transformers model: load_pretrained cannot fill it")


def _loading_class(pretrained: Any) -> Any:
    """The model's own class: FSDP2 gives a sharded module a class of its own (FSDP<Name>),
    which transformers would take for custom code (its conversions are keyed by class name)."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(pretrained).__mro__ if not issubclass(c, FSDPModule))


def _dtype(model: nn.Module) -> torch.dtype:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def _split(pretrained: Any, missing: Iterable[str]) -> tuple[list[str], list[str]]:
    """(inside the base model, outside it) of the names the files lack: what is outside (a new
    head) from_pretrained starts itself; what is inside would be a pretrained tensor at random."""
    prefix = getattr(pretrained, "base_model_prefix", "")
    has_base = bool(prefix) and isinstance(getattr(pretrained, prefix, None), nn.Module)
    inside = sorted(n for n in missing if not has_base or n.startswith(prefix + "."))
    return inside, sorted(n for n in missing if n not in inside)


def _file_name(name: str, prefix: str) -> str:
    """The from_pretrained name of the tensor `name` of the model whose transformers model is at
    `prefix`: peft's wrapper adds `base_model.model.` before it, `.base_layer` inside an adapted
    layer, and `.original_module` or `.modules_to_save.<adapter>` inside a copied module (a
    classifier's head), all of which start from the base's tensor."""
    name = name.removeprefix(prefix + ".") if prefix else name
    name = name.replace(".base_layer.", ".").replace(".original_module.", ".")
    head, found, rest = name.partition(".modules_to_save.")
    return f"{head}.{rest.partition('.')[2]}" if found else name


def _adapter_init(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    """A LoRA adapter's tensor as peft initializes it: lora_A as nn.Linear (Kaiming uniform),
    lora_B zeros, so that the adapted model starts as its base. None for any other name."""
    if ".lora_B." in name:
        return torch.zeros(shape, dtype=dtype)
    if ".lora_A." in name:
        weight = torch.empty(shape, dtype=dtype)
        nn.init.kaiming_uniform_(weight, a=5**0.5)
        return weight
    return None


@contextlib.contextmanager
def _transformers_load() -> Iterator[list[Any]]:
    """transformers quiet while it loads (its progress bar and load report would reach the
    terminal; raylane says what matters in one line), and the report's loading info kept (the
    list yielded): when the load raises, it names the tensors its message leaves out."""
    from transformers import modeling_utils
    from transformers.utils import logging as hf_logging

    reports: list[Any] = []
    real = getattr(modeling_utils, "log_state_dict_report", None)

    def report(*args: Any, **kwargs: Any) -> Any:
        reports.append(kwargs.get("loading_info", args[3] if len(args) > 3 else None))
        return real(*args, **kwargs)  # type: ignore[misc]

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    if real is not None:
        modeling_utils.log_state_dict_report = report
    try:
        yield reports
    finally:
        if real is not None:
            modeling_utils.log_state_dict_report = real
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def _failed(where: str, pretrained: Any, reports: list[Any], exc: BaseException) -> str:
    """One line for a load transformers refused: the tensors it could not build from the files
    (a conversion that failed, a shape that differs), else its own message's first line."""
    info = reports[-1] if reports else None
    _record(f"transformers could not load the weights ({where}):", _traceback(exc))
    cls = _loading_class(pretrained).__name__
    if info is not None and getattr(info, "conversion_errors", None):
        for name, text in info.conversion_errors.items():
            _record(f"transformers' conversion of {name} failed:", str(text))
        return (
            f"{where}: transformers cannot build {_names(sorted(info.conversion_errors))} of {cls} from the "
            "weights (tensors missing from the files or of other shapes; the details in the library log)"
        )
    if info is not None and getattr(info, "mismatched_keys", None):
        shapes = [
            f"{name} is {list(saved)} in the files, {list(wanted)} in the model"
            for name, saved, wanted in sorted(info.mismatched_keys)
        ]
        more = f" (and {len(shapes) - _SHOWN} more)" if len(shapes) > _SHOWN else ""
        return f"{where}: not a checkpoint of this {cls}: " + "; ".join(shapes[:_SHOWN]) + more
    return f"{where}: transformers cannot load the weights into {cls}: {_first_line(exc)}"


def _missing(where: str, pretrained: Any, names: list[str]) -> str:
    return (
        f"{where}: the weights lack {_names(names)} of {_loading_class(pretrained).__name__}'s base model "
        "(from_pretrained would start them at random): not a checkpoint of this model"
    )


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:_SHOWN])
    count = f"{len(names)} tensors, " if len(names) > 1 else ""
    return count + shown + (f" (and {len(names) - _SHOWN} more)" if len(names) > _SHOWN else "")


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines() or [""]
    return f"{type(exc).__name__}: {lines[0]}" + (" (the rest in the library log)" if len(lines) > 1 else "")


def _record(what: str, text: str) -> None:
    """A whole traceback, which the terminal shows as one line, into the library log: under
    raylane.logs.TRACEBACK_LOGGER (not imported: raylane.logs reaches Ray, which a rank under
    torchrun never imports)."""
    logging.getLogger("traceback").info("%s\n%s", what, text.rstrip())


def _traceback(exc: BaseException) -> str:
    import traceback

    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
