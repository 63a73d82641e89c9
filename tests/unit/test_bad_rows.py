"""Data rows as they are: a row whose text or label is missing, null or of the wrong type is a
DataError naming the file, the row (from 1) and the column, wherever the rows are transformed
(a rank's pyarrow reader, a Ray Data task's batch, a dataset tokenized at once); with
`data.skip_bad_rows` such rows are dropped, counted once before training, and bounded. The
readers and transforms run here in-process, on a tiny real tokenizer and model folder;
tests/e2e/test_failures.py runs the CLI on the same files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.fs as pafs
import pytest

from raylane import DataError
from raylane.loop.data import baddata
from raylane.loop.data.streaming import FileEvalStream, FileStream
from tests.helpers.hf_lm import make_base

pytest.importorskip("transformers")


@pytest.fixture(scope="session")
def base(tmp_path_factory) -> Path:
    """A tiny LLaMA and its word-level tokenizer (words w3..w127), saved."""
    folder = tmp_path_factory.mktemp("hf-base")
    make_base(folder)
    return folder


@pytest.fixture(autouse=True)
def _no_record():
    baddata.forget_skipped()
    yield
    baddata.forget_skipped()


def _jsonl(path: Path, rows: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _good(n: int, start: int = 0) -> list[dict]:
    return [{"text": f"w{3 + (start + i) % 100} w{4 + i % 90} w5", "label": i % 2} for i in range(n)]


def _with(rows: list, index: int, row) -> list:
    return [*rows[:index], row, *rows[index + 1 :]]


def _hf(base: Path, train, task: str = "causal-lm", **data):
    import raylane.hf
    from raylane.hf.config import Config

    cfg = Config.model_validate(
        {
            "pipeline": "hf",
            "model": {"name_or_path": str(base), "task": task, "seq_len": 8},
            "data": {"train": str(train), **data},
        }
    )
    return raylane.hf.file_source(cfg, cfg.data.train, "data.train")


def _read(source, world: int = 1) -> list:
    """Every batch a one-rank reader gives of `source` in its first epoch."""
    stream = FileStream(source, batch_size=4, rank=0, world_size=world, seed=0)
    return list(stream)


def _error(source) -> str:
    with pytest.raises(DataError) as caught:
        _read(source)
    return str(caught.value)


# -- a bad row is one line naming its place -------------------------------------------------------


TEXT_CASES = {
    # (rows, the row named (from 1), what the line says of the value)
    "no text key in the middle": (_with(_good(40), 20, {"body": "w3 w4", "label": 1}), 21, "has no value"),
    "no text key on the first line": (_with(_good(40), 0, {"body": "w3 w4", "label": 1}), 1, "has no value"),
    "a null text": (_with(_good(40), 2, {"text": None, "label": 1}), 3, "has no value"),
    "a number for every text": ([{"text": 5 + i, "label": 0} for i in range(10)], 1, "has 5; expected a string"),
}


@pytest.mark.parametrize("task", ["causal-lm", "sequence-classification"])
@pytest.mark.parametrize("case", list(TEXT_CASES))
def test_a_missing_null_or_non_string_text_is_a_data_error_naming_file_row_and_column(base, tmp_path, case, task):
    rows, row, said = TEXT_CASES[case]
    path = _jsonl(tmp_path / "train.jsonl", rows)
    line = _error(_hf(base, path, task))
    assert line.startswith(f"data.text_column: {path} row {row}, column 'text' {said}"), line
    assert "data.skip_bad_rows: true skips such rows" in line


def test_a_value_of_another_type_than_the_columns_names_its_row_and_column(base, tmp_path):
    """pyarrow cannot read a JSON block whose column changes type: its message counts the row
    from 0 in the block; the line counts it from 1 in the file, and shows the value. In the first
    block, the config's check says so (exit 2); later, the reader."""
    from raylane.loop.data import files

    rows = [{"text": "w5 " * 100}] * 12_000  # 3.6 MB: pyarrow parses a JSON Lines file in blocks of 1 MB or so
    path = _jsonl(tmp_path / "first.jsonl", _with(rows, 8, {"text": [1]}))
    with pytest.raises(ValueError, match="cannot skip") as caught:
        _hf(base, path)
    assert f"data.train: {path} row 9, column 'text' has [1]; an array where the rows before it" in str(caught.value)
    path = _jsonl(tmp_path / "later.jsonl", _with(rows, 10_000, {"text": 7}))
    with pytest.raises(DataError) as caught:
        list(files.checked_chunks(pafs.LocalFileSystem(), files.Piece(str(path)), "json", ["text"], None, "data.train"))
    assert str(caught.value).startswith(
        f"data.train: {path} row 10001, column 'text' has 7; a number where the rows before it have a string"
    )


def test_a_null_label_is_named_at_its_own_row(base, tmp_path):
    """A null among a file's labels makes the column float: 0.0 is class 0, NaN the bad row."""
    path = _jsonl(tmp_path / "train.jsonl", _with(_good(40), 6, {"text": "w3", "label": None}))
    line = _error(_hf(base, path, "sequence-classification"))
    assert line.startswith(f"data.label_column: {path} row 7, column 'label' has no value; each row needs its label")
    path = _jsonl(tmp_path / "range.jsonl", _with(_good(40), 6, {"text": "w3", "label": 2.0}))
    line = _error(_hf(base, path, "sequence-classification"))
    assert f"{path} row 7, column 'label' has 2.0; class ids are whole numbers 0..1" in line, line


def test_a_whole_float_label_is_its_class(base, tmp_path):
    rows = [{"text": "w3 w4", "label": float(i % 2)} for i in range(8)]
    path = _jsonl(tmp_path / "train.jsonl", rows)
    labels = [b["labels"] for b in _read(_hf(base, path, "sequence-classification"))]
    assert sorted(np.concatenate(labels).tolist()) == [0, 0, 0, 0, 1, 1, 1, 1]


def test_a_text_pipelines_null_text_names_its_row(tmp_path):
    from raylane.pipelines import text

    path = _jsonl(tmp_path / "train.jsonl", _with([{"text": "hello there"}] * 20, 4, {"text": None}))
    cfg = text.Config.model_validate({"data": {"train": str(path), "format": "json"}, "model": {"block_size": 8}})
    line = _error(text.source(cfg, cfg.data.train, "data.train"))
    assert line.startswith(f"data.text_field: {path} row 5, column 'text' has no value; each row needs its text"), line


def _tabular_csv(path: Path, bad: dict[int, str]) -> Path:
    rows = [f"{i / 10},{-i / 10},{i % 2}" for i in range(40)]
    for i, row in bad.items():
        rows[i] = row
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("a,b,label\n" + "\n".join(rows) + "\n")
    return path


def _tabular(path: Path, **data):
    from raylane.pipelines import tabular

    cfg = tabular.Config.model_construct(
        data=tabular.DataSection(
            train=str(path), format="csv", features=["a", "b"], target="label", num_classes=2, **data
        ),
        model=tabular.ModelSection(),
    )
    return tabular.source(cfg, cfg.data.train, "data.train")


def test_tabular_names_the_first_bad_rows_first_bad_cell(tmp_path):
    path = _tabular_csv(tmp_path / "t.csv", {9: "0.5,0.1,", 3: "0.5,,1"})
    line = _error(_tabular(path))
    assert line.startswith(f"data.features: {path} row 4, column 'b' has no value; fill or drop such rows"), line
    path = _tabular_csv(tmp_path / "y.csv", {9: "0.5,0.1,"})
    assert _error(_tabular(path)).startswith(f"data.target: {path} row 10, column 'label' has no value")


def test_a_csv_row_with_a_field_missing_names_its_row(tmp_path):
    """pyarrow's message gives the row's text, not its number: the line finds it in the file."""
    path = _tabular_csv(tmp_path / "t.csv", {5: "0.5,0.1,1", 25: "0.5,0.1"})
    assert _error(_tabular(path)) == (
        f"data.train: {path} row 26: 2 fields where the header has 3 (a CSV row has every column: an empty "
        "field for a missing value)"
    )


# -- skip_bad_rows: dropped, counted once, bounded --------------------------------------------------


CLS = "sequence-classification"


def _two_files(tmp_path: Path) -> Path:
    folder = tmp_path / "data"
    _jsonl(folder / "a.jsonl", _with(_good(30), 0, {"body": "x", "label": 1}))
    _jsonl(
        folder / "b.jsonl",
        _with(_with(_good(30, 30), 11, {"text": None, "label": 0}), 12, {"text": "w3", "label": None}),
    )
    return folder


def test_skipped_rows_are_dropped_and_counted_once_in_file_order(base, tmp_path):
    folder = _two_files(tmp_path)
    source = _hf(base, folder, "sequence-classification", skip_bad_rows=True)
    stream = FileStream(source, batch_size=4, rank=0, world_size=1, seed=0)
    assert sum(stream.rows) == 57  # 60 rows, 3 bad (the label's row too)
    for epoch in (0, 1):  # read again each epoch, counted once
        stream.set_epoch(epoch)
        assert sum(len(batch["labels"]) for batch in stream) == 57
    recorded = baddata.skipped_rows()
    assert recorded == {
        "data.train": {
            "rows": 60,
            "skipped": 3,
            "first": f"data.text_column: {folder / 'a.jsonl'} row 1, column 'text' has no value; each row needs its text",
            "counts": {},
        }
    }


def test_skipped_texts_never_reach_a_causal_lms_tokens(base, tmp_path):
    from raylane.hf.data import tokenizer

    _jsonl(tmp_path / "data/a.jsonl", [{"text": "w7 w8"}, {"text": None}, {"body": "w9"}] * 4)
    _jsonl(tmp_path / "data/b.jsonl", [{"text": 12}] * 5)  # numbers all through: a column of numbers
    batches = _read(_hf(base, tmp_path / "data", skip_bad_rows=True))
    tokens = np.concatenate([batch["input_ids"].flatten().numpy() for batch in batches])
    tok = tokenizer(str(base))
    assert set(tokens.tolist()) == {tok.convert_tokens_to_ids("w7"), tok.convert_tokens_to_ids("w8"), tok.eos_token_id}
    assert baddata.skipped_rows()["data.train"]["skipped"] == 13


def test_more_bad_rows_than_skip_bad_rows_allows_fails_before_the_first_batch(base, tmp_path):
    folder = _two_files(tmp_path)
    with pytest.raises(DataError) as caught:
        FileStream(_hf(base, folder, CLS, skip_bad_rows=2), batch_size=4, rank=0, world_size=1, seed=0)
    assert str(caught.value) == (
        "data.skip_bad_rows = 2: data.train: 3 bad rows of 60, more than 2; the first: data.text_column: "
        f"{folder / 'a.jsonl'} row 1, column 'text' has no value; each row needs its text"
    )
    FileStream(_hf(base, folder, CLS, skip_bad_rows=3), batch_size=4, rank=0, world_size=1, seed=0)  # within the bound


def test_a_held_out_stream_counts_its_skipped_rows_before_evaluating(base, tmp_path):
    folder = _two_files(tmp_path)
    source = _hf(base, folder, "sequence-classification", skip_bad_rows=True)
    import dataclasses

    stream = FileEvalStream(dataclasses.replace(source, key="data.eval"), batch_size=8, rank=0, world_size=1)
    assert baddata.skipped_rows()["data.eval"]["skipped"] == 3
    assert sum(len(batch["labels"]) for batch in stream) == 57


def test_tabular_skips_rows_with_a_missing_or_bad_cell(tmp_path):
    path = _tabular_csv(tmp_path / "t.csv", {3: "0.5,,1", 9: "0.5,0.1,", 20: "abc,0.1,1", 30: "0.5,0.1,7"})
    batches = _read(_tabular(path, skip_bad_rows=True))
    assert sum(len(x) for x, _ in batches) == 36
    assert all(np.isfinite(x.numpy()).all() for x, _ in batches)
    assert baddata.skipped_rows()["data.train"]["skipped"] == 4


def test_a_dataset_in_memory_names_its_bad_row_or_skips_it(base):
    import datasets

    from raylane.hf import data
    from raylane.hf.config import Config

    rows = _with(_good(10), 3, {"text": None, "label": 1})
    cfg = Config.model_validate(
        {"pipeline": "hf", "model": {"name_or_path": str(base), "task": "sequence-classification", "seq_len": 8}}
    )
    with pytest.raises(DataError, match=r"^data.text_column: the train dataset row 4, column 'text' has no value"):
        data.from_dataset(cfg, datasets.Dataset.from_list(rows), "train")
    skipping = cfg.model_copy(update={"data": cfg.data.model_copy(update={"skip_bad_rows": True})})
    assert len(data.from_dataset(skipping, datasets.Dataset.from_list(rows), "train")) == 9
    assert baddata.skipped_rows()["train dataset"]["skipped"] == 1


def test_ray_datas_counting_pass_tallies_each_batch_and_finds_the_first_skipped_row(base, tmp_path):
    """What Ray Data's tasks run on the driver's counting pass (FileSource.tally, one row per
    batch), and how the driver adds the tallies up (raylane.onray.datasets._skipped): here on
    the batches pyarrow gives, in-process."""
    from raylane.loop.data import files
    from raylane.onray.datasets import _skipped

    folder = _two_files(tmp_path)
    source = _hf(base, folder, "sequence-classification", skip_bad_rows=True)
    fs, found = source.files()
    tallies = [
        {k: v[0] for k, v in source.tally(batch).items()}
        for path in found
        for batch in files.read_chunks(fs, files.Piece(path), "json", source.columns)
    ]
    assert _skipped(source, tallies) == 57
    assert baddata.skipped_rows()["data.train"] == {
        "rows": 60,
        "skipped": 3,
        "first": f"data.text_column: {folder / 'a.jsonl'} row 1, column 'text' has no value; each row needs its text",
        "counts": {},
    }


def test_the_summary_and_the_terminal_say_what_was_skipped():
    from raylane.results import TrainSummary
    from raylane.tracking.progress import outcome_text

    summary = TrainSummary.model_validate(
        {
            "status": "FINISHED",
            "run_name": "r",
            "skipped_rows": {"data.train": {"rows": 1003, "skipped": 3, "first": "data.text_column: t.jsonl row 2"}},
        }
    )
    text = outcome_text(summary, "ui")
    assert "  skipped rows:  data.train 3 of 1,003; the first: data.text_column: t.jsonl row 2" in text.splitlines()
