"""A user's pipeline on raylane.hf for the Ray fine-tunes: the example's JSON Lines read into
`datasets.Dataset`s (map-style: no Ray Data tasks beside the workers), each rank's reads of
weight files counted (a line per file transformers opens to load it, in `<source.reads>/rank<N>`),
and, with `source.kill_mark`, rank 1 killing its own process with SIGKILL once after a committed
checkpoint (the mark stays behind: the restarted worker trains on); with `source.eval_at_start`,
the run's own evaluation of the model as loaded, before its first step, logged at step 0 as
`eval/<metric>` (the pipeline evaluates only after steps). Test-only."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import raylane
import raylane.hf


class Source(raylane.Section):
    rows: raylane.InputPath  # the example's data: train/ and eval/ of JSON Lines
    reads: str = ""
    eval_rows: int = 0  # the first N held-out texts only (0: all): a shorter evaluation
    kill_mark: str = ""
    eval_at_start: bool = False


class Config(raylane.hf.Config):
    source: Source


def _dataset(folder: Path, limit: int = 0):
    import datasets

    rows = [json.loads(line) for file in sorted(folder.glob("*.jsonl")) for line in file.read_text().splitlines()]
    return datasets.Dataset.from_list(rows[:limit] if limit else rows)


class KillRank1(raylane.Hook):
    def __init__(self, mark: str, run_dir: str) -> None:
        self.mark, self.run_dir = mark, run_dir

    def on_step_end(self, ctx: raylane.HookContext) -> None:
        from raylane.loop import checkpoint

        if ctx.rank != 1 or ctx.step < 4 or os.path.exists(self.mark):
            return
        if checkpoint.committed(self.run_dir):
            open(self.mark, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)


class EvalAtStart(raylane.Hook):
    def setup(self, ctx: raylane.HookContext) -> None:
        metrics = ctx.evaluate()  # a collective, on every rank, as the run's evaluations are
        ctx.log({f"eval/{name}": value for name, value in metrics.items()})


def _count_reads(folder: str) -> None:
    import torch.distributed as dist
    import transformers.modeling_utils

    real = transformers.modeling_utils.safe_open

    def counted(filename, *args, **kwargs):
        with open(Path(folder) / f"rank{dist.get_rank()}", "a") as f:
            f.write(f"{filename}\n")
        return real(filename, *args, **kwargs)

    transformers.modeling_utils.safe_open = counted


def build(cfg: Config):
    if cfg.source.reads:
        _count_reads(cfg.source.reads)
    root = Path(cfg.source.rows)
    pipe = raylane.hf.pipeline(cfg, train=_dataset(root / "train"), eval=_dataset(root / "eval", cfg.source.eval_rows))
    if cfg.source.kill_mark:
        pipe.hooks = [KillRank1(cfg.source.kill_mark, f"{cfg.run.storage_path}/{cfg.run.name}")]
    if cfg.source.eval_at_start:
        pipe.hooks = [*pipe.hooks, EvalAtStart()]
    return pipe
