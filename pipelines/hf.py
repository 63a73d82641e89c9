"""Fine-tune a Hugging Face model (`pip install 'raylane[hf]'`): a causal language model or a
sequence classifier saved with `save_pretrained` (`model.name_or_path`), on text files (JSON Lines,
Parquet, CSV or text; local or s3://) streamed and tokenized where they are read (Ray Data's CPU
tasks on Ray, each rank's reader thread under torchrun). The pretrained weights are read once, on
rank 0, and broadcast into every rank's replica or FSDP shard. docs/hf.md has the whole story;
`raylane.hf.pipeline` builds the same from a `datasets.Dataset` in a pipeline of your own."""

from __future__ import annotations

from typing import Literal

from pydantic import model_validator

import raylane.hf


class Config(raylane.hf.Config):
    pipeline: Literal["hf"] = "hf"

    @model_validator(mode="after")
    def _has_data(self) -> Config:
        if self.data.train is None and self.data.mix is None:
            raise ValueError(
                "data.train = None: pipeline 'hf' reads files (a rehearsal, `raylane check --world N`, one "
                "micro-batch of them: train.batch_size packed rows of model.seq_len tokens, for the activations); "
                "give data.train (a file, folder or glob; a local text file that long will do, data.format: text)"
            )
        for i, source in enumerate(self.data.mix or ()):
            if source.train is None:
                raise ValueError(
                    f"data.mix.{i}.train = None: pipeline 'hf' reads files; a source without train takes a dataset "
                    "that a pipeline's own build(cfg) hands to raylane.hf.pipeline(cfg, train={name: dataset})"
                )
        return self


def sources(cfg: Config):
    """What the Ray driver streams (Ray Data), without building a model: not a mixture, which each
    worker draws in memory (raylane.hf.mixture)."""
    return {
        "train": raylane.hf.file_source(cfg, cfg.data.train, "data.train") if cfg.data.train is not None else None,
        "eval": raylane.hf.file_source(cfg, cfg.data.eval, "data.eval") if cfg.data.eval is not None else None,
    }


def build(cfg: Config):
    return raylane.hf.pipeline(cfg)
