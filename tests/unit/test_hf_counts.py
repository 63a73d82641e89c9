"""What the hf pipeline's rows count before training (issue 64): conversations without an answer
(left out, not fatal) and examples longer than model.seq_len (cut, or dropped with
data.drop_cut), summed by the counting pass that counts the rows anyway (FileStream's under
torchrun and in one process, Ray Data's tally on the driver, a dataset's at once) and said in the
summary's `skipped_rows[...].counts` and its `examples` line. In-process: pyarrow's batches, the
tally Ray Data's tasks run, no Ray."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from raylane.loop.data import baddata, files
from raylane.loop.data.streaming import FileStream, split_counts

pytest.importorskip("transformers")

SEQ = 64
ANSWERED = [{"role": "user", "content": "w1 w2"}, {"role": "assistant", "content": "w3 w4"}]
UNANSWERED = [{"role": "system", "content": "w5"}, {"role": "user", "content": "w6 w7"}]
LONG = [{"role": "user", "content": "w8"}, {"role": "assistant", "content": " ".join(["w9"] * 120)}]


@pytest.fixture(autouse=True)
def _no_record():
    baddata.forget_skipped()
    yield
    baddata.forget_skipped()


@pytest.fixture(scope="session")
def tokenizer_folder(tmp_path_factory) -> Path:
    from tests.helpers.hf_chat import llama

    return llama(tmp_path_factory.mktemp("chat-llama"))  # its tokenizer beside it, with a ChatML template


def _source(folder: Path, tmp_path: Path, rows: list, **data):
    import raylane.hf
    from raylane.hf.config import Config

    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
    cfg = Config.model_validate(
        {
            "pipeline": "hf",
            "model": {"name_or_path": str(folder), "seq_len": SEQ},
            "data": {"train": str(train), "format": "json", "style": "messages", **data},
        }
    )
    return raylane.hf.file_source(cfg, cfg.data.train, "data.train")


def test_a_batch_counts_its_unanswered_and_its_cut_examples_beside_its_rows(tokenizer_folder):
    from raylane.hf.rows import CUT, DROPPED, encoded_rows
    from raylane.hf.rows import UNANSWERED as LEFT_OUT

    batch = {"messages": np.array([ANSWERED, UNANSWERED, LONG, UNANSWERED], dtype=object)}
    fields, path = {"messages": "messages"}, str(tokenizer_folder)
    rows, counts = split_counts(encoded_rows(batch, "messages", fields, path, SEQ))
    assert counts == {LEFT_OUT: 2, CUT: 1}
    assert set(rows) == {"input_ids", "labels", "position_ids"} and rows["input_ids"].shape[1] == SEQ
    dropped, counts = split_counts(encoded_rows(batch, "messages", fields, path, SEQ, drop_cut=True))
    assert counts == {LEFT_OUT: 2, DROPPED: 1}
    assert (dropped["labels"] != -100).sum() < (rows["labels"] != -100).sum()  # the long answer is gone
    assert split_counts(encoded_rows({"messages": batch["messages"][:1]}, "messages", fields, path, SEQ))[1] == {}


def test_the_counting_pass_sums_them_under_torchrun_and_on_ray_and_the_summary_says_them(tokenizer_folder, tmp_path):
    from raylane.hf.rows import CUT
    from raylane.hf.rows import UNANSWERED as LEFT_OUT
    from raylane.onray.datasets import _skipped
    from raylane.results import TrainSummary
    from raylane.tracking.progress import outcome_text

    rows = [ANSWERED] * 6 + [UNANSWERED] * 3 + [LONG] * 2
    source = _source(tokenizer_folder, tmp_path, rows)
    stream = FileStream(source, batch_size=2, rank=0, world_size=1, seed=0)  # counts its rows first
    assert sum(stream.rows) > 0 and len(list(stream)) == stream.batches_in_epoch(0)  # the rows read carry no count
    recorded = baddata.skipped_rows()["data.train"]
    assert recorded["counts"] == {LEFT_OUT: 3, CUT: 2} and recorded["skipped"] == 0

    baddata.forget_skipped()  # Ray's: each batch tallied to one row by Ray Data's tasks, summed on the driver
    fs, found = source.files()
    tallies = [
        {k: v[0] for k, v in source.tally(batch).items()}
        for batch in files.read_chunks(fs, files.Piece(found[0]), "json", source.columns)
    ]
    assert _skipped(source, tallies) == sum(stream.rows)
    assert baddata.skipped_rows()["data.train"]["counts"] == {LEFT_OUT: 3, CUT: 2}

    summary = TrainSummary.model_validate(
        {"status": "FINISHED", "run_name": "r", "skipped_rows": baddata.skipped_rows()}
    )
    lines = outcome_text(summary, "ui").splitlines()
    assert "  examples:      data.train: 2 cut to model.seq_len, 3 without an answer (left out)" in lines, lines
    assert not any(line.startswith("  skipped rows:") for line in lines), lines  # nothing was skipped


def test_a_dataset_in_memory_records_its_counts_too(tokenizer_folder):
    from raylane.hf.config import Config
    from raylane.hf.data import _transformed, transform_for
    from raylane.hf.rows import UNANSWERED as LEFT_OUT

    cfg = Config.model_validate(
        {
            "pipeline": "hf",
            "model": {"name_or_path": str(tokenizer_folder), "seq_len": SEQ},
            "data": {"format": "json", "style": "messages"},
        }
    )
    batch = {"messages": np.array([ANSWERED, UNANSWERED], dtype=object)}
    out = _transformed(transform_for(cfg, "messages"), batch, "train", False)
    assert set(out) == {"input_ids", "labels", "position_ids"}
    assert baddata.skipped_rows()["train dataset"]["counts"] == {LEFT_OUT: 1}
