"""Attention heads a tensor-parallel plan splits: each rank of a group takes heads / tp of them,
so tp must divide every head count of a module whose projection (q, k or v) a rule splits by
columns. Found generically, for a user's own model and a transformers one alike: the module's
own attributes (HEAD_COUNTS, nanoGPT's, Llama's reference code's, transformers' names), or for a
transformers attention, which holds its `config` and `head_dim` and views by `-1` heads, that
config's `num_attention_heads` and `num_key_value_heads`. A plan that splits no attention's
projection (the MLPs alone) is held to no head count. The checks before launch
(raylane.loop.plan_view) refuse with `heads_problem`'s line; `tp: auto` tries only the degrees it
allows (raylane.loop.distributed.auto.weigh)."""

from __future__ import annotations

from typing import Any

from torch import nn

HEAD_COUNTS = (
    "n_heads",
    "n_head",
    "num_heads",
    "num_attention_heads",
    "num_key_value_heads",
    "n_kv_heads",
    "n_kv_head",
    "num_kv_heads",
)


def heads_problem(model: nn.Module, rules: dict[str, Any], tp: int) -> str | None:
    """One line naming strategy.tp, the module, its attribute and the rule, for the first head
    count `tp` does not divide; None when it divides them all. `rules`: {pattern: ParallelStyle}
    (raylane.loop.distributed.tensor_parallel.plan_for's)."""
    from fnmatch import fnmatch

    from torch.distributed.tensor.parallel import ColwiseParallel

    modules = dict(model.named_modules())
    for pattern, style in rules.items():
        if not isinstance(style, ColwiseParallel):
            continue
        atoms = pattern.split(".")
        for name in modules:
            parts = name.split(".")
            if len(parts) != len(atoms) or not all(map(fnmatch, parts, atoms)):
                continue
            owner = name.rpartition(".")[0]
            for where, heads in head_counts(modules[owner]):
                if heads % tp:
                    return (
                        f"strategy.tp = {tp}: does not divide {owner or type(model).__name__}.{where} = {heads}, the "
                        f"heads each rank takes a share of (Pipeline.tp_plan[{pattern!r}] splits {name} by columns)"
                    )
    return None


def head_counts(module: nn.Module) -> list[tuple[str, int]]:
    """(attribute, heads) of a module: its own HEAD_COUNTS, else a transformers attention's config's."""
    own = [(a, v) for a in HEAD_COUNTS if (v := _count(module.__dict__.get(a)))]
    config = module.__dict__.get("config")
    if own or config is None or not _count(module.__dict__.get("head_dim")):
        return own
    keys = ("num_attention_heads", "num_key_value_heads")
    return [(f"config.{a}", v) for a in keys if (v := _count(getattr(config, a, None)))]


def _count(value: Any) -> int:
    """`value` when it is a count (a positive int, not a bool), else 0."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0
