"""The `gpt` pipeline's byte-level decoder on your own text: UTF-8 text files (one row per
non-empty line) or JSON Lines (the text in `data.text_field`), local or `s3://`, streamed.

Tokens are UTF-8 bytes (256 ids; nothing is downloaded). The transform (Ray Data's map_batches
on Ray, the rank's reader thread elsewhere) joins a chunk of rows with newlines and cuts it
into windows of block_size + 1 bytes; the tail of each chunk shorter than a window is dropped.
The report is `loss` (nats per byte) and `bits_per_byte` on `data.eval`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from raylane import BaseConfig, InputPaths, Section
from raylane.pipelines.gpt import ModelSection


class DataSection(Section):
    """The text files, streamed."""

    train: InputPaths = Field(
        min_length=1, description="Training files, directories or globs; local or `s3://bucket/prefix`."
    )
    eval: InputPaths | None = Field(None, description="Held-out files, directories or globs.")
    format: Literal["text", "json"] = Field(
        "text", description="`text`: one row per non-empty line; `json`: JSON Lines, the text in `text_field`."
    )
    text_field: str = Field("text", min_length=1, description="JSON Lines: the field that holds each record's text.")
    shuffle_rows: int = Field(4096, ge=1, le=100_000_000, description="Rows in each rank's shuffle buffer.")
    skip_bad_rows: bool | int = Field(
        False,
        ge=0,
        description="Rows whose text is missing, null or not a string: `false` fails the run naming the first one's "
        "file, row and column; `true` skips them; N skips at most N in each of data.train and data.eval (more fails "
        "the run before its first step). The rows are counted before training; the summary's `skipped_rows` and "
        "the terminal give the count and the first one.",
    )


class Config(BaseConfig):
    pipeline: Literal["text"] = "text"
    data: DataSection
    model: ModelSection = ModelSection()

    def gives_tp_plan(self) -> bool:
        return False

    def gives_pp_stages(self) -> bool:
        return False

    def eval_metrics(self) -> tuple[str, ...]:
        return ("loss", "bits_per_byte")

    @model_validator(mode="after")
    def _data_is_there(self) -> Config:
        for field, paths in (("data.train", self.data.train), ("data.eval", self.data.eval)):
            if paths is not None:
                source(self, paths, field).check(field)  # exit 2 before anything starts
        return self


def source(cfg: Config, paths, key: str | None = None):
    import numpy as np

    from raylane import DataError, FileSource

    d, width = cfg.data, cfg.model.block_size + 1
    column = "text" if d.format == "text" else d.text_field

    def transform(batch):
        texts = batch[column]
        bad = [row for row, text in enumerate(texts) if not isinstance(text, str)]
        if bad:  # a missing text would train as the bytes of "None", a number as its digits
            raise DataError(
                "data.text_field",
                column=column,
                row=bad[0],
                rows=bad,
                value=texts[bad[0]],
                why="each row needs its text, a string (data.skip_bad_rows: true skips such rows)",
            )
        data = "\n".join(texts).encode("utf-8")
        n = len(data) // width
        return {"tokens": np.frombuffer(data[: n * width], dtype=np.uint8).reshape(n, width)}

    def to_tensors(batch):
        import torch

        tokens = torch.tensor(batch["tokens"], dtype=torch.long)
        return tokens[:, :-1], tokens[:, 1:]

    return FileSource(
        paths=paths,
        format=d.format,
        columns=[column],
        transform=transform,
        keeps_rows=False,
        to_tensors=to_tensors,
        shuffle_rows=d.shuffle_rows,
        key=key,
        skip_bad_rows=d.skip_bad_rows,
    )


def sources(cfg: Config):
    """What a streaming pipeline declares for the driver (Ray Data), without building a model."""
    return {
        "train": source(cfg, cfg.data.train, "data.train"),
        "eval": source(cfg, cfg.data.eval, "data.eval") if cfg.data.eval is not None else None,
    }


def build(cfg: Config):
    import torch
    import torch.nn.functional as F

    from raylane import Pipeline
    from raylane.pipelines.gpt import build_model, flops_per_token

    m = cfg.model

    def loss_fn(logits, targets):
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    def eval_sums(logits, targets):
        nats = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum") / m.block_size
        return {"loss": nats, "bits_per_byte": nats / torch.log(torch.tensor(2.0))}

    model = build_model(m)
    data = sources(cfg)
    # The logged model's signature and torch.export need an input; a stream has none to spare.
    example = torch.zeros(1, m.block_size, dtype=torch.long)
    return Pipeline(
        model=model,
        train_set=data["train"],
        eval_set=data["eval"],
        loss_fn=loss_fn,
        eval_sums=eval_sums,
        example_input=example,
        tokens_per_sample=m.block_size,
        flops_per_token=flops_per_token(model, m),
    )
