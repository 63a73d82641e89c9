"""What the loop's steps need besides the model: how many steps a run has, the gradient norm
and its clipping, the train metrics of a window of steps, and the rates (tokens/s, MFU) derived
from samples/s. Ray-free."""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from raylane.config import TrainSection
from raylane.loop.data.loader import EpochData, data_change
from raylane.loop.observe.experts import ExpertFigures
from raylane.loop.protocols.batches import StepMetrics, batch_size, take_tallies


def plan_steps(train_data: EpochData, train: TrainSection) -> tuple[int, int]:
    """(optimizer steps in the first epoch, total steps of the run), the same on every rank."""
    per_epoch = math.ceil(train_data.batches_in_epoch(0) / train.grad_accum_steps)
    return per_epoch, last_step(train_data, train, epoch=0, batch_in_epoch=0, step=0)


def last_step(train_data: EpochData, train: TrainSection, *, epoch: int, batch_in_epoch: int, step: int) -> int:
    """The step the run ends at, from a position: `step`, `batch_in_epoch` micro-batches into
    `epoch`. A resume counts from where it is, not from step 0: the steps per epoch change with
    train.batch_size or the world size at an epoch boundary, and the run still ends at its
    train.max_epochs or train.max_steps, whichever comes first (train.epoch_limit: as many
    as max_steps takes when max_epochs is not set)."""
    accum, max_steps, epochs = train.grad_accum_steps, train.max_steps or math.inf, train.epoch_limit
    if epoch >= epochs:
        return step
    total = step + math.ceil(max(train_data.batches_in_epoch(epoch) - batch_in_epoch, 0) / accum)
    if train_data.epochs_alike:
        total += (epochs - epoch - 1) * math.ceil(train_data.batches_in_epoch(epoch) / accum)
    else:  # a stream's epochs differ by the share of files each rank draws
        for later in range(epoch + 1, epochs):
            if total >= max_steps:
                break
            steps = math.ceil(train_data.batches_in_epoch(later) / accum)
            if not steps:  # an epoch with a rank's share empty: the run ends there
                break
            total += steps
    return int(min(max_steps, total))


def resumed_batch(state: dict[str, Any], train: TrainSection, world_size: int, samples_per_step: int) -> int:
    """The micro-batch of its epoch a checkpoint's train `state` resumes at, on `world_size`
    data-parallel ranks taking `samples_per_step` samples a step. Batches per epoch depend on the
    world size: a resharded resume restarts the epoch, unless the epoch's order is global and the
    global batch held (train.global_batch): then it continues at the same sample."""
    same_world = state.get("data_ranks", state.get("world_size")) == world_size
    global_order = (
        state.get("global_order")
        and train.global_batch is not None
        and state.get("samples_per_step") == samples_per_step
    )
    samples = state.get("samples_in_epoch")  # the group's position in the epoch
    if (global_order or same_world) and samples is not None:
        # In samples: the micro-batch may have changed (at any world size with a global
        # order; on the same world each rank's order is the same whatever the batch).
        return int(samples) // (train.batch_size * world_size)
    return int(state["batch_in_epoch"]) if same_world else 0


def partial_epoch(samples_seen: int, epoch_samples: int) -> float:
    """The share of the running epoch trained (`samples_seen` of the group's `epoch_samples`, as
    this launch splits the epoch), over every launch of the run; a resume that restarted the epoch
    (another world size) counts what it trained before too, so it is capped at 1."""
    return round(min(samples_seen / max(epoch_samples, 1), 1.0), 4)


def resumed_position(
    state: dict[str, Any], train: TrainSection, data_ranks: int, samples_per_step: int, data: dict[str, Any] | None
) -> tuple[int, int, str | None]:
    """(the micro-batch of its epoch, the group's samples seen in it) a checkpoint's train `state`
    resumes at (`resumed_batch`), and the line said when it was saved on other data than this
    run's (`data`: its fingerprint): a position in an epoch of other data means nothing, and the
    epoch starts over (docs/training.md, Resume)."""
    batch = resumed_batch(state, train, data_ranks, samples_per_step)
    # A checkpoint from before samples_seen_in_epoch: its position is what it had trained.
    seen = state.get("samples_seen_in_epoch", state.get("samples_in_epoch"))
    seen = int(seen) if seen is not None else 0
    step, epoch = int(state["step"]), int(state["epoch"])
    if line := data_change(state.get("data"), data, step=step, epoch=epoch, mid_epoch=batch > 0 or seen > 0):
        return 0, 0, line
    return batch, seen, None


def step_groups(data: Iterable[Any], accum: int) -> Iterator[list[Any]]:
    """An epoch's batches, grouped by optimizer step (the last group may be shorter)."""
    batches = iter(data)
    while group := list(itertools.islice(batches, accum)):
        yield group


def plain_parameters(params: list[torch.nn.Parameter]) -> bool:
    """Plain tensors of one device and dtype (DDP, one process), not FSDP's DTensors."""
    return len({(p.device, p.dtype) for p in params}) <= 1 and not any(hasattr(p, "full_tensor") for p in params)


def clip_gradients(
    params: list[torch.nn.Parameter],
    max_norm: float | None,
    *,
    plain: bool,
    norm_wanted: bool = True,
    across: Any = None,
    carry: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, bool] | None:
    """(the total 2-norm of the gradients, whether it is finite); None without gradients. Clipped
    to `max_norm` when set and the norm is finite: torch.nn.utils.clip_grad_norm_, bit for bit.
    For `plain` parameters it skips that function's grouping by device and dtype, ~60 us a step:
    4% of a small model's step on one core (bench B1). Without clipping, and when the norm is not
    wanted (a step whose metrics are not logged), `plain` gradients are only checked for
    finiteness, with no norm (None): GradScaler's fused check, one op where the norm takes five.
    `across`: a process group whose ranks hold other parameters (a pipeline's stages): the norm is
    theirs together, and `carry` (a tensor of one number) is summed over them, in place, in the
    same all-reduce."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads and across is None:
        return None
    if plain and not max_norm and not norm_wanted and across is None:
        return None, _all_finite(grads)
    meshes = _by_mesh([p for p in params if p.grad is not None])
    if not grads:
        norm = torch.zeros(())
    elif plain:
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
    else:
        norm = _total_norm(meshes)
    if across is not None:
        norm = _across(norm, across, carry)
    finite = bool(torch.isfinite(norm))  # a host sync: the caller skips the step on False
    if max_norm and finite:
        if plain:
            torch._foreach_mul_(grads, torch.clamp(max_norm / (norm + 1e-6), max=1.0))
        else:
            for group in meshes.values():
                torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm, foreach=True)
    return norm, finite


def _across(norm: torch.Tensor, group: Any, carry: torch.Tensor | None) -> torch.Tensor:
    """The 2-norm over `group`'s ranks' norms, and `carry` summed over them, in one all-reduce; a
    non-finite `carry` (the last stage's loss) makes the norm non-finite on every rank."""
    import torch.distributed as dist

    extra = carry.detach().reshape(1).to(norm.device, torch.float32) if carry is not None else norm.new_zeros(1)
    packed = torch.cat([norm.detach().float().reshape(1) ** 2, extra])
    dist.all_reduce(packed, group=group)
    if carry is not None:
        carry.copy_(packed[1])
    return packed[0].sqrt() + 0 * packed[1]


def _by_mesh(params: list[torch.nn.Parameter]) -> dict[Any, list[torch.nn.Parameter]]:
    """The parameters by the device mesh their gradients lie on (None: plain tensors). FSDP2 x
    TP puts a block's split weights on (dp, tp) and the rest on dp alone, and torch's norm and
    clipping refuse to stack DTensors of two meshes (issue 49's trap a)."""
    groups: dict[Any, list[torch.nn.Parameter]] = {}
    for p in params:
        groups.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    return groups


def _total_norm(meshes: dict[Any, list[torch.nn.Parameter]]) -> torch.Tensor:
    """The 2-norm over every mesh's gradients: each mesh's made whole over its ranks, then combined."""
    norms = []
    for group in meshes.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], foreach=True)
        norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # reduced over ranks
    return norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))


_finite_check_buffers: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _all_finite(grads: list[torch.Tensor]) -> bool:
    """No inf or NaN in `grads` (one device and dtype). The check multiplies them by 1.0 in place,
    which leaves every value as it is."""
    device = grads[0].device
    if device not in _finite_check_buffers:
        _finite_check_buffers[device] = (torch.zeros(1, device=device), torch.ones(1, device=device))
    found, one = _finite_check_buffers[device]
    found.zero_()
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found, one)
    return not found.item()


@dataclass
class Throughput:
    """What turns samples per second into tokens per second and MFU (None: not reported), and,
    for a pipeline whose rows hold padding (`real_tokens`: batch -> its tokens that are data), the
    share of the tokens that are data: `real_tokens_per_s` and `padding_share`. The counts are
    this rank's, over this launch, taken from each micro-batch on the host before its forward (no
    device sync, no collective: ranks draw rows alike, so rank 0's share stands for the group)."""

    tokens_per_sample: int | None = None
    flops_per_token: float | None = None
    peak_flops_per_device: float | None = None
    real_tokens: Callable[[Any], Any] | None = None
    data_tokens: int = 0  # counted tokens that are data ...
    slot_tokens: int = 0  # ... of this many (rows x tokens_per_sample)
    tallies: dict[str, int] = field(default_factory=dict)  # the batches' own (batches.TALLY), summed

    def count(self, batches: Iterable[Any]) -> None:
        """A step's micro-batches counted, their tallies taken out of them (before the forward)."""
        for batch in batches:
            for name, n in take_tallies(batch).items():
                self.tallies[name] = self.tallies.get(name, 0) + n
        if self.real_tokens is None or not self.tokens_per_sample:
            return
        for batch in batches:
            data = self.real_tokens(batch)
            if data is not None:  # None: rows of this kind hold no padding
                self.data_tokens += int(data)
                self.slot_tokens += batch_size(batch) * self.tokens_per_sample

    def counted(self) -> tuple[int, int]:
        return self.data_tokens, self.slot_tokens

    def share(self, since: tuple[int, int] = (0, 0)) -> float | None:
        """The tokens that were data, of those counted since `since` (a `counted()`); None: none counted."""
        slots = self.slot_tokens - since[1]
        return (self.data_tokens - since[0]) / slots if slots > 0 else None

    def tally_shares(self, since: dict[str, int]) -> dict[str, float]:
        """Each tally's share of those counted since `since` (an earlier copy of `tallies`)."""
        got = {name: n - since.get(name, 0) for name, n in self.tallies.items()}
        total = sum(got.values())
        return {f"source_share/{name}": n / total for name, n in got.items()} if total > 0 else {}

    def rates(self, samples_per_s: float, world_size: int, share: float | None = None) -> dict[str, float]:
        """`share`: the tokens that were data over the same span (None: not counted)."""
        if not self.tokens_per_sample:
            return {}
        out = {"tokens_per_s": samples_per_s * self.tokens_per_sample}
        if share is not None:
            out |= {"real_tokens_per_s": out["tokens_per_s"] * share, "padding_share": 1.0 - share}
        if self.flops_per_token and self.peak_flops_per_device:
            out["mfu"] = self.flops_per_token * out["tokens_per_s"] / (self.peak_flops_per_device * world_size)
        return out


class MetricsWindow:
    """The train metrics of the steps since the last logged ones (a window of
    `mlflow.log_every_n_steps`): the loss summed on the device (no host sync per step), a step's
    own metrics averaged, the last gradient norm measured, and the window's steps and time; for a
    `model` with expert-parallel modules, their tokens per expert (raylane.loop.observe.experts)."""

    def __init__(self, device: torch.device, model: torch.nn.Module | None = None) -> None:
        self.loss_sum = torch.zeros((), device=device)
        self.step_metrics = StepMetrics(device)
        self.experts = ExpertFigures.of(model)
        self.tokens_mark = (0, 0)  # Throughput.counted() at the last window's end
        self.tally_mark: dict[str, int] = {}  # Throughput.tallies then
        self.reset()

    def reset(self) -> None:
        self.loss_sum.zero_()
        self.loss_count = 0
        self.step_metrics.reset()
        if self.experts is not None:
            self.experts.reset()
        self.grad_norm: torch.Tensor | None = None
        self.start = time.perf_counter()
        self.steps = 0

    def add(self, loss: torch.Tensor | None) -> None:
        """A step taken; `loss` None: its update was skipped (a non-finite loss)."""
        self.steps += 1
        if loss is not None:
            self.loss_sum += loss
            self.loss_count += 1

    def metrics(
        self, samples_per_step: int, lr: float, throughput: Throughput, world_size: int, until: float | None = None
    ) -> dict[str, float]:
        """The window's figures, its time up to `until` (default: now)."""
        seconds = max((until or time.perf_counter()) - self.start, 1e-9)
        samples_per_s = self.steps * samples_per_step / seconds
        share, self.tokens_mark = throughput.share(self.tokens_mark), throughput.counted()
        shares, self.tally_mark = throughput.tally_shares(self.tally_mark), dict(throughput.tallies)
        return {
            "loss": float(self.loss_sum) / max(self.loss_count, 1),
            "lr": lr,
            # the window's last measured norm (a window cut short by a stop may have none)
            **({"grad_norm": float(self.grad_norm)} if self.grad_norm is not None else {}),
            "samples_per_s": samples_per_s,
            **throughput.rates(samples_per_s, world_size, share),
            **shares,
            **self.step_metrics.means(),
            **(self.experts.window(seconds) if self.experts is not None else {}),
        }

    def run_experts(self) -> dict[str, Any] | None:
        """The run's expert figures over every rank (a collective: every rank calls it), or None."""
        return self.experts.summary() if self.experts is not None else None
