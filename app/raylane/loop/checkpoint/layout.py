"""The layout a checkpoint was saved at, as its manifest records it (the train state's "layout"),
and the line a resume at another layout says. A checkpoint loads at any layout (parameters and
the optimizer's state are keyed by name: raylane.loop.checkpoint.state); what depends on the
layout is said here: the data position is kept by data-parallel rank (raylane.loop.steps), and
random generators are restored only at the same layout (raylane.loop.checkpoint.loading).

Torch-free: the driver's checks read manifests."""

from __future__ import annotations

from typing import Any


def layout_of(strategy: Any, world_size: int) -> dict[str, Any]:
    """How `strategy` (raylane.loop.distributed.fsdp.Strategy) lays a model out on `world_size` ranks: its
    label (`fsdp×tp2`), how the data-parallel ranks hold the model (`name`), the tensor- and
    pipeline-parallel sizes, the data-parallel size and the world size."""
    tp, pp, cp = (int(getattr(strategy, dim, 1) or 1) for dim in ("tp", "pp", "cp"))
    return {
        "strategy": strategy.label,
        "name": strategy.name,
        "tp": tp,
        "pp": pp,
        "dp": max(world_size // (tp * pp * cp), 1),  # the ranks that read different samples
        "world_size": world_size,
    }


def _ranks(n: int) -> str:
    return f"{n} rank{'s' if n != 1 else ''}"


def described(layout: dict[str, Any]) -> str:
    """`fsdp×tp2 on 4`, or `one process`."""
    if layout["world_size"] == 1 and layout.get("tp", 1) == 1 and layout.get("pp", 1) == 1:
        return "one process"
    return f"{layout['strategy']} on {layout['world_size']}"


def saved_layout(train_state: dict[str, Any]) -> dict[str, Any] | None:
    """A checkpoint's layout: recorded, or for one from before the record, its world size alone
    (strategy None); None when it records neither."""
    if isinstance(train_state.get("layout"), dict):
        return train_state["layout"]
    world = train_state.get("world_size")
    return {"strategy": None, "world_size": int(world)} if isinstance(world, int) else None


def change_line(train_state: dict[str, Any], now: dict[str, Any]) -> str | None:
    """`resuming a fsdp×tp2 checkpoint of 4 ranks as ddp on 2`: what a resume of a checkpoint (its
    `train_state`) at layout `now` says, or None when the layout is the one that saved it."""
    was = saved_layout(train_state)
    if was is None or (was.get("strategy"), was["world_size"]) == (now["strategy"], now["world_size"]):
        return None
    if was.get("strategy") is None and was["world_size"] == now["world_size"]:
        return None  # a checkpoint from before the layout record, at the same world size: nothing to say
    if was.get("strategy") is None:
        what = "checkpoint"
    else:
        what = "one-process checkpoint" if described(was) == "one process" else f"{was['strategy']} checkpoint"
    return f"resuming a {what} of {_ranks(was['world_size'])} as {described(now)}"
