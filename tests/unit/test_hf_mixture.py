"""data.mix (raylane.hf.mixture): sources drawn by weight at the example level, within one example
of their shares at every point of the draw, the same for a seed whatever else runs; each
source's rows shuffled anew each time it runs out; the config refusing what cannot be mixed, in
one line naming the key."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raylane.hf.mixture import draw

pytest.importorskip("transformers")


def test_two_sources_at_0_8_and_0_2_are_within_one_example_of_their_shares_over_2000():
    sources, rows = draw([5000, 3000], [0.8, 0.2], 2000, seed=0)
    assert np.bincount(sources).tolist() == [1600, 400]
    counts = np.cumsum(np.eye(2, dtype=int)[sources], axis=0)  # each prefix's examples per source
    expected = np.outer(np.arange(1, 2001), [0.8, 0.2])
    assert np.abs(counts - expected).max() <= 1  # everywhere in the draw, not only at its end
    assert len(set(rows[sources == 0].tolist())) == 1600  # no row twice before its source runs out
    again = draw([5000, 3000], [0.8, 0.2], 2000, seed=0)
    assert np.array_equal(again[0], sources) and np.array_equal(again[1], rows)
    assert not np.array_equal(draw([5000, 3000], [0.8, 0.2], 2000, seed=1)[1], rows)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(1, 40), min_size=2, max_size=4),
    st.lists(st.floats(0.05, 5), min_size=4, max_size=4),
    st.integers(1, 300),
)
def test_any_mixture_stays_within_one_example_and_repeats_a_small_source_only_once_it_ran_out(sizes, weights, n):
    weights = weights[: len(sizes)]
    sources, rows = draw(sizes, weights, n, seed=3)
    target = np.asarray(weights) / sum(weights) * n
    got = np.bincount(sources, minlength=len(sizes))
    assert np.abs(got - target).max() <= 1, (got, target)
    for i, size in enumerate(sizes):
        mine = rows[sources == i]
        assert all(0 <= r < size for r in mine)
        for start in range(0, len(mine), size):  # each pass through the source: every row once
            chunk = mine[start : start + size].tolist()
            assert len(set(chunk)) == len(chunk)


def _chat(folder: Path, name: str, n: int, word: str) -> Path:
    path = folder / f"{name}.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": f"{word} {i}"}, {"role": "assistant", "content": word}]}
        for i in range(n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="session")
def chat_model(tmp_path_factory) -> Path:
    from tests.helpers.hf_chat import llama

    return llama(tmp_path_factory.mktemp("mix-llama"))


def _config(model: Path, data: dict):
    from raylane.hf.config import Config

    return Config.model_validate(
        {"pipeline": "hf", "model": {"name_or_path": str(model), "seq_len": 32}, "data": {"format": "json", **data}}
    )


def test_a_mixture_draws_its_rows_and_says_what_each_source_gave(chat_model, tmp_path):
    from raylane.hf.data import from_mix
    from raylane.loop.data import baddata

    a, b = _chat(tmp_path, "a", 30, "w1"), _chat(tmp_path, "b", 5, "w2")
    cfg = _config(chat_model, {"mix": [{"train": str(a), "weight": 3, "name": "a"}, {"train": str(b), "weight": 1}]})
    assert cfg.data.style == "messages"  # auto, read off the sources' columns
    baddata.forget_skipped()
    rows = from_mix(cfg)
    assert len(rows) > 0 and set(rows.arrays) == {"input_ids", "labels", "position_ids", "tally:a", "tally:source 1"}
    drawn = baddata.skipped_rows()["data.mix"]["counts"]
    assert drawn == {"from a": 26, "from source 1": 9}  # 35 examples at 3:1; b's 5 rows drawn 9 times
    # Each packed row says how many of its examples each source gave: together, every one drawn.
    assert (rows.arrays["tally:a"].sum(), rows.arrays["tally:source 1"].sum()) == (26, 9)
    starts = (rows.arrays["position_ids"] == 0).sum(1)  # a row's documents (and its padding, if any)
    assert ((rows.arrays["tally:a"] + rows.arrays["tally:source 1"]) <= starts).all()
    baddata.forget_skipped()


def test_the_loop_takes_a_batch_s_tallies_out_before_the_forward_and_logs_each_source_s_share_per_window():
    """The tallies never reach the model (the batch loses them on the host, before its forward),
    and each window's shares are of that window's examples alone."""
    import torch

    from raylane.loop.steps import MetricsWindow, Throughput

    def batch(a: list[int], b: list[int]) -> dict:
        return {"input_ids": torch.zeros(len(a), 4), "tally:a": torch.tensor(a), "tally:b b": torch.tensor(b)}

    throughput, window = Throughput(tokens_per_sample=4), MetricsWindow(torch.device("cpu"))
    first = [batch([3, 1], [0, 1]), batch([2], [2])]
    throughput.count(first)
    assert all(set(b) == {"input_ids"} for b in first)
    window.add(torch.tensor(1.0))
    got = window.metrics(1, 0.1, throughput, 1)
    assert (got["source_share/a"], got["source_share/b b"]) == (6 / 9, 3 / 9)
    window.reset()
    throughput.count([batch([1], [3])])
    window.add(torch.tensor(1.0))
    got = window.metrics(1, 0.1, throughput, 1)
    assert (got["source_share/a"], got["source_share/b b"]) == (1 / 4, 3 / 4)
    throughput.count([{"input_ids": torch.zeros(1, 4)}])  # a window without tallies has no shares
    window.reset()
    window.add(torch.tensor(1.0))
    assert not [k for k in window.metrics(1, 0.1, throughput, 1) if k.startswith("source_share/")]


def test_a_sources_name_becomes_a_metric_name_mlflow_takes():
    from raylane.hf.mixture import tally_name

    class Source:
        def __init__(self, name):
            self.name = name

    assert [tally_name([Source("chat:v2 (en)"), Source(None)], i) for i in (0, 1)] == ["chat_v2 _en_", "source 1"]


@pytest.mark.parametrize(
    "mix, line",
    [
        ([{"weight": 0.5}, {"weight": 0}], "data.mix.1.weight"),
        ([{"weight": -1}, {"weight": 1}], "data.mix.0.weight"),
        ([{"weight": 1}], "data.mix"),
    ],
)
def test_a_weight_not_positive_or_a_mixture_of_one_is_refused_naming_its_key(chat_model, tmp_path, mix, line):
    from pydantic import ValidationError

    a = _chat(tmp_path, "a", 3, "w1")
    with pytest.raises(ValidationError) as caught:
        _config(chat_model, {"mix": [{"train": str(a), **m} for m in mix]})
    assert line in str(caught.value).replace(" -> ", ".").replace("\n  ", " "), str(caught.value)


def test_a_mixture_beside_data_train_or_a_source_without_the_columns_is_one_line(chat_model, tmp_path):
    a = _chat(tmp_path, "a", 3, "w1")
    (tmp_path / "plain.jsonl").write_text(json.dumps({"body": "x"}) + "\n")
    both = {"train": str(a), "mix": [{"train": str(a), "weight": 1}, {"train": str(a), "weight": 1}]}
    with pytest.raises(ValueError, match=r"data.train = .* with data.mix: .* give one"):
        _config(chat_model, both)
    odd = {"mix": [{"train": str(a), "weight": 1}, {"train": str(tmp_path / "plain.jsonl"), "weight": 1}]}
    with pytest.raises(ValueError, match=r"data.mix.1.train"):
        _config(chat_model, odd)


def test_a_sources_relative_paths_are_the_config_files_folders(chat_model, tmp_path, monkeypatch):
    """As data.train's: a Ray worker's working directory is neither the config's nor the shell's."""
    from raylane.config import load_config

    project = tmp_path / "project"
    project.mkdir()
    _chat(project, "a", 3, "w1"), _chat(project, "b", 3, "w2")
    (project / "mix.yaml").write_text(
        f"pipeline: hf\nmodel: {{name_or_path: {chat_model}, seq_len: 32}}\n"
        "data: {format: json, mix: [{train: a.jsonl, weight: 1}, {train: [b.jsonl], weight: 2}]}\n"
    )
    monkeypatch.chdir(tmp_path)
    cfg = load_config(str(project / "mix.yaml"))
    assert [s.train for s in cfg.data.mix] == [str(project / "a.jsonl"), [str(project / "b.jsonl")]]


def test_a_bad_row_is_named_by_its_source_and_its_row_there_failed_or_skipped(chat_model, tmp_path):
    """Not by its place in the draw, which no file has (before: 'the data.mix dataset row 16')."""
    from raylane import DataError
    from raylane.hf.data import from_mix
    from raylane.loop.data import baddata

    a, b = _chat(tmp_path, "a", 6, "w1"), _chat(tmp_path, "b", 4, "w2")
    rows = b.read_text().splitlines()
    rows[2] = json.dumps({"messages": [{"role": "robot", "content": "w3"}, {"role": "assistant", "content": "w4"}]})
    b.write_text("\n".join(rows) + "\n")
    mix = [{"train": str(a), "weight": 1}, {"train": str(b), "weight": 1}]
    with pytest.raises(DataError, match=r"data.mix.1.train row 3, column 'messages'"):
        from_mix(_config(chat_model, {"mix": mix}))
    baddata.forget_skipped()
    from_mix(_config(chat_model, {"mix": mix, "skip_bad_rows": True}))
    recorded = baddata.skipped_rows()["data.mix"]
    assert recorded["skipped"] >= 1 and "data.mix.1.train row 3" in recorded["first"], recorded
    baddata.forget_skipped()
