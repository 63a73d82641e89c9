"""Batches of any shape, and the three forms of a training step (docs/pipelines.md):

- an `(input, target)` pair: a 2-item tuple or list whose first item is a tensor.
  `output = model(input)`; the loss is `loss_fn(output, target)`, or the model's own without one.
- any other batch: a dict (or any Mapping, a tokenizer's BatchEncoding) is passed as
  `model(**batch)`; a tuple or list of another length, or whose first item is no tensor, as
  `model(*batch)`; anything else (a tensor) as `model(batch)`. The loss is `loss_fn(output, batch)`
  when the pipeline gives one, else the model's own: `output.loss`, `output["loss"]`, or the
  output itself when it is a one-number tensor.
- the pipeline's `step(model, batch)`: returns the loss, or `(loss, {metric: value})`.

`Forward` classifies the form once, at the first batch, and checks what the user's code returns
there (keys the model's forward does not take, an output with no loss, a `step` that returns
something else: one `BatchFormError` line each). Later batches go to a function specialised for
the form, with no checks and no walk of the batch beyond `to_device`'s. Ray-free."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from typing import Any, cast

import torch

from raylane.errors import RaylaneError

# Names raylane logs itself in a window's training metrics and progress: a step's metric may not
# take one of them.
RESERVED_METRICS = frozenset(
    {
        "loss",
        "lr",
        "grad_norm",
        "samples_per_s",
        "tokens_per_s",
        "real_tokens_per_s",
        "padding_share",
        "mfu",
        "epoch",
        "step",
        "window",
        "event",
        "total_steps",
        "steps_per_epoch",
        "max_epochs",
        "world_size",
        "resumed_from_step",
        "resumed_from",
        "skipped_checkpoints",
        "strategy",
        "strategy_reason",
        "strategy_tags",
    }
)
STEP_ROLE = "step(model, batch)"


class BatchFormError(RaylaneError, ValueError):
    """A batch, a model output or a `step` return the loop cannot use: one line saying what was
    expected and what came. raylane.loop.usercode prefixes the pipeline's name."""


# A batch's per-row tallies for the loop, not the model's inputs: `{"tally:<name>": counts per
# row}` (the examples each row holds from each source of a mixture, raylane.hf.mixture). They ride
# with the rows to the rank, where the loop takes them out of the batch before its forward and logs
# each name's share of the window's tallies (train/source_share/<name>): on the host, no collective.
TALLY = "tally:"


def take_tallies(batch: Any) -> dict[str, int]:
    """The tallies of a dict batch, taken out of it (a micro-batch's, before its forward)."""
    if not isinstance(batch, dict) or not any(isinstance(k, str) and k.startswith(TALLY) for k in batch):
        return {}
    keys = [k for k in batch if isinstance(k, str) and k.startswith(TALLY)]
    return {k.removeprefix(TALLY): int(batch.pop(k).sum()) for k in keys}


def to_device(batch: Any, device: torch.device) -> Any:
    """`batch` with every tensor in it on `device`, at any nesting of tuples, lists, dicts and
    Mappings (kept as their own type where it can be rebuilt from a dict, else a dict),
    namedtuples and dataclasses. From pinned memory to a GPU the copies do not block."""
    non_blocking = device.type == "cuda"  # a copy from memory that is not pinned blocks anyway
    return _moved(batch, device, non_blocking)


def _moved(x: Any, device: torch.device, non_blocking: bool) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(device, non_blocking=non_blocking)
    if isinstance(x, (list, tuple)):
        items = [_moved(v, device, non_blocking) for v in x]
        if isinstance(x, list):
            return items
        return type(x)(*items) if hasattr(x, "_fields") else tuple(items)  # a namedtuple by its fields
    if isinstance(x, Mapping):
        moved = {k: _moved(v, device, non_blocking) for k, v in x.items()}
        if type(x) is dict:
            return moved
        try:
            return type(x)(moved)  # BatchEncoding, OrderedDict, UserDict
        except Exception:  # noqa: BLE001 - a Mapping that cannot be built from a dict: a dict serves
            return moved
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return dataclasses.replace(
            x, **{f.name: _moved(getattr(x, f.name), device, non_blocking) for f in dataclasses.fields(x) if f.init}
        )
    return x


def form_of(batch: Any, step: Callable | None) -> str:
    """'step', 'pair' (input, target), 'mapping' (model(**batch)), 'args' (model(*batch)) or
    'one' (model(batch))."""
    if step is not None:
        return "step"
    if isinstance(batch, (tuple, list)) and not hasattr(batch, "_fields"):
        return "pair" if len(batch) == 2 and isinstance(batch[0], torch.Tensor) else "args"
    if isinstance(batch, Mapping):
        return "mapping"
    return "one"


def call_model(model: Any, batch: Any, form: str) -> Any:
    """The model's output for a batch of `form` (not 'step')."""
    if form == "pair":
        return model(batch[0])
    if form == "mapping":
        return model(**batch)
    if form == "args":
        return model(*batch)
    return model(batch)


def own_metrics(output: Any) -> dict[str, Any] | None:
    """The model's own auxiliary loss where its output carries one, as the step metric `aux_loss`
    (transformers' mixture-of-experts outputs' load-balancing loss, with output_router_logits on:
    the loss already holds it times router_aux_loss_coef); None otherwise, at once for a tensor."""
    if isinstance(output, torch.Tensor):
        return None
    aux = getattr(output, "aux_loss", None)
    if aux is None and isinstance(output, Mapping):
        aux = output.get("aux_loss")
    return {"aux_loss": aux.detach()} if isinstance(aux, torch.Tensor) and aux.numel() == 1 else None


def own_loss(output: Any) -> Any:
    """The model's own loss in its output: `.loss`, `["loss"]`, or a one-number tensor; None."""
    if isinstance(output, torch.Tensor):
        return output if output.numel() == 1 else None
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    return loss


def forward_loss(
    model: Any, batch: Any, loss_fn: Callable | None = None, step: Callable | None = None
) -> tuple[Any, Any, dict[str, Any]]:
    """(loss, output, metrics) of one batch already on the model's device, in whichever of the
    three forms it comes; output is None for a `step`. Unspecialised: for the loop's side uses
    (evaluation, the memory estimate, autotune's probe); training goes through `Forward`."""
    form = form_of(batch, step)
    if form == "step":
        loss, metrics = split_step(step(model, batch))
        return loss, None, metrics
    output = call_model(model, batch, form)
    if loss_fn is not None:
        return loss_fn(output, batch[1] if form == "pair" else batch), output, {}
    return own_loss(output), output, {}


def split_step(out: Any) -> tuple[Any, dict[str, Any]]:
    if isinstance(out, (tuple, list)) and len(out) == 2 and isinstance(out[1], dict):
        return out[0], out[1]
    return out, {}


def batch_size(batch: Any) -> int:
    """Samples in a batch: the first dimension of its first tensor (0 when it holds none)."""
    if isinstance(batch, torch.Tensor):
        return len(batch) if batch.dim() else 1
    items = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (tuple, list)) else ()
    for item in items:
        if (n := batch_size(item)) or isinstance(item, torch.Tensor):
            return n
    return 0


class Forward:
    """The training step's forward and loss: `run(model, batch)` -> (loss, metrics or None),
    with the batch moved to `device`. The first call classifies the batch, checks what comes, and
    puts a function specialised for the form in `run`'s place; `loss_fn` and `step` are read at
    every call (raylane.loop.usercode wraps them for their first call). `split_logits`: under loss
    parallelism, the loss of the vocabulary-split logits (loss_fn's or a step's) is a replicated
    DTensor, whose local value (the whole loss, differentiable) is what the step's sums and logs
    take."""

    def __init__(
        self, loss_fn: Callable | None, step: Callable | None, device: torch.device, split_logits: bool = False
    ) -> None:
        self.loss_fn, self.step, self.device = loss_fn, step, device
        self.split_logits = split_logits
        self.form: str | None = None
        self.run: Callable[[Any, Any], tuple[Any, dict[str, Any] | None]] = self._first

    def _first(self, model: Any, batch: Any) -> tuple[Any, dict[str, Any] | None]:
        self.form = form = form_of(batch, self.step)
        metrics: dict[str, Any] | None
        if form == "mapping":
            check_keys(model, batch)
        batch = to_device(batch, self.device)
        if form == "step":
            from raylane.pipelines_ref import returned_at

            loss, metrics = check_step(self.step(model, batch), returned_at(self.step))
            loss = self._local(loss)
        else:
            output = call_model(model, batch, form)
            if self.loss_fn is not None:
                loss, metrics = self._loss(output, batch[1] if form == "pair" else batch), own_metrics(output)
            else:
                loss, metrics = checked_own_loss(output, model), own_metrics(output)
        self.run = self._specialised(form, plain=form == "pair" and isinstance(batch[1], torch.Tensor))
        return loss, metrics

    def _specialised(self, form: str, plain: bool) -> Callable[[Any, Any], tuple[Any, dict[str, Any] | None]]:
        device, non_blocking = self.device, self.device.type == "cuda"
        if plain:  # a pair of tensors costs what it cost before: two .to() and two calls

            def pair(model: Any, batch: Any) -> tuple[Any, dict[str, Any] | None]:
                source, target = batch
                output = model(source.to(device, non_blocking=non_blocking))
                if self.loss_fn is not None:
                    return self._loss(output, target.to(device, non_blocking=non_blocking)), own_metrics(output)
                return own_loss(output), own_metrics(output)

            return pair
        if form == "step":

            def stepped(model: Any, batch: Any) -> tuple[Any, dict[str, Any]]:
                loss, metrics = split_step(self.step(model, _moved(batch, device, non_blocking)))
                return self._local(loss), metrics

            return stepped

        def other(model: Any, batch: Any) -> tuple[Any, dict[str, Any] | None]:
            batch = _moved(batch, device, non_blocking)
            output = call_model(model, batch, form)
            if self.loss_fn is not None:
                return self._loss(output, batch[1] if form == "pair" else batch), own_metrics(output)
            return own_loss(output), own_metrics(output)

        return other

    def _loss(self, output: Any, target: Any) -> Any:
        loss_fn = cast(Callable, self.loss_fn)  # called only where there is one
        return self._local(loss_fn(output, target))

    def _local(self, loss: Any) -> Any:
        return loss.to_local() if self.split_logits and hasattr(loss, "to_local") else loss


class StepMetrics:
    """A `step`'s own metrics over a logging window: summed as they come (on the device, no host
    sync per step, like the loss) and averaged over the micro-batches that gave them."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.sums: dict[str, Any] = {}
        self.count = 0

    def add(self, metrics: dict[str, Any]) -> None:
        for name, value in metrics.items():
            value = value.detach().float().reshape(()) if isinstance(value, torch.Tensor) else float(value)
            self.sums[name] = self.sums[name] + value if name in self.sums else value
        self.count += 1

    def means(self) -> dict[str, float]:
        return {name: float(total) / max(self.count, 1) for name, total in self.sums.items()}

    def reset(self) -> None:
        self.sums, self.count = {}, 0


# -- the first batch's checks ------------------------------------------------------------------


def _unwrapped(model: Any) -> Any:
    model = getattr(model, "module", model)  # DDP
    return getattr(model, "_orig_mod", model)  # torch.compile's wrapper


def check_keys(model: Any, batch: Mapping) -> None:
    """Before the first forward: every key of a dict batch is a parameter of the model's forward,
    and every parameter it requires is a key (unless forward takes **kwargs)."""
    try:
        params = inspect.signature(_unwrapped(model).forward).parameters
    except (TypeError, ValueError):  # a builtin forward: nothing to read
        return
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    named = {n: p for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    keys = [str(k) for k in batch]
    unknown = [k for k in keys if k not in named]
    missing = [n for n, p in named.items() if p.default is p.empty and n not in batch]
    if not unknown and not missing:
        return
    what = f"takes no {_listed(unknown)}" if unknown else f"requires {_listed(missing)}, not in the batch"
    raise BatchFormError(
        f"the batch is a dict, passed as model(**batch), and the model's forward {what}: the batch's keys are "
        f"[{', '.join(keys)}], forward's parameters ({', '.join(named)}) (at {_defined_at(model)})"
    )


def _listed(names: list[str]) -> str:
    return ", ".join(repr(n) for n in names)


def _defined_at(model: Any) -> str:
    forward = getattr(type(_unwrapped(model)), "forward", None)
    code = getattr(forward, "__code__", None)
    return f"{code.co_filename}:{code.co_firstlineno}" if code else type(_unwrapped(model)).__name__


def describe(value: Any) -> str:
    """What a value is, for a message: its type, a tensor's shape, a dict's keys."""
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, Mapping):
        return f"{type(value).__name__} with keys [{', '.join(str(k) for k in value)}]"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    return type(value).__name__


def checked_own_loss(output: Any, model: Any) -> Any:
    loss = own_loss(output)
    if loss is None:
        raise BatchFormError(
            f"the model's output is {describe(output)}, with no loss, and the pipeline gives no loss_fn: expected "
            "output.loss, output['loss'] or a one-number tensor, or give loss_fn(output, batch) "
            f"(the model's forward at {_defined_at(model)})"
        )
    if (problem := loss_problem(loss)) is not None:
        raise BatchFormError(f"the model's own loss is {problem} (the model's forward at {_defined_at(model)})")
    return loss


def loss_problem(loss: Any) -> str | None:
    """What is wrong with a loss for backward, or None."""
    if not isinstance(loss, torch.Tensor):
        return f"{type(loss).__name__}: it must return the batch's loss as a tensor (not .item())"
    if loss.numel() != 1:
        return f"a tensor of shape {tuple(loss.shape)}: it must return one number, the batch's loss"
    if torch.is_grad_enabled() and not loss.requires_grad:
        return "a tensor that does not require grad: it must be computed from the model's output (not detached)"
    return None


def check_step(out: Any, at: str) -> tuple[Any, dict[str, Any]]:
    """step's first return: a tensor, or (tensor, {name: tensor or number}) with names of its own;
    `at`: where step returns, for the message."""
    loss, metrics = split_step(out)
    paired = isinstance(out, (tuple, list)) and len(out) == 2 and isinstance(out[1], dict)
    if not isinstance(loss, torch.Tensor) or (isinstance(out, (tuple, list)) and not paired):
        raise BatchFormError(
            f"{STEP_ROLE} returned {describe(out)}: expected the loss (a one-number tensor) "
            f"or (loss, {{metric: value}}) (at {at})"
        )
    if (problem := loss_problem(loss)) is not None:
        raise BatchFormError(f"{STEP_ROLE} returned a loss that is {problem} (at {at})")
    wrong = [
        k
        for k, v in metrics.items()
        if not isinstance(v, (torch.Tensor, int, float)) or (isinstance(v, torch.Tensor) and v.numel() != 1)
    ]
    if wrong:
        raise BatchFormError(
            f"{STEP_ROLE} returned metric {_listed(wrong)} as {describe(metrics[wrong[0]])}: "
            f"expected a number or a one-number tensor (at {at})"
        )
    taken = sorted(set(map(str, metrics)) & RESERVED_METRICS)
    if taken:
        raise BatchFormError(
            f"{STEP_ROLE} returned metric {_listed(taken)}, a name raylane logs itself: rename it (at {at})"
        )
    return loss, metrics
