"""data.mix's sources beside local files (issue 64 §3): a `datasets.Dataset` that a pipeline's own
build(cfg) hands to raylane.hf.pipeline(cfg, train={name: dataset}), taken by the source of that
name without `train`, and files on `s3://` (moto's S3 server on loopback, read in-process). Each
source's rows drawn by the same deficit draw as files' (raylane.hf.mixture.draw); every mismatch
between the sources and the datasets handed in is one line (ConfigError: exit 2)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")


def _conversation(word: str, i: int) -> dict:
    return {"messages": [{"role": "user", "content": f"{word} w{3 + i % 50}"}, {"role": "assistant", "content": word}]}


def _chat(folder: Path, name: str, n: int, word: str) -> Path:
    path = folder / f"{name}.jsonl"
    path.write_text("".join(json.dumps(_conversation(word, i)) + "\n" for i in range(n)))
    return path


def _dataset(n: int, word: str):
    return datasets.Dataset.from_list([_conversation(word, i) for i in range(n)])


@pytest.fixture(scope="session")
def chat_model(tmp_path_factory) -> Path:
    from tests.helpers.hf_chat import llama

    return llama(tmp_path_factory.mktemp("mix-sources-llama"))


def _config(model: Path, data: dict, pipeline: str = "own"):
    """A raylane.hf.Config, as a pipeline of one's own validates it (`pipeline: hf` is the shipped one's)."""
    if pipeline == "hf":
        from raylane.pipelines.hf import Config
    else:
        from raylane.hf.config import Config
    return Config.model_validate(
        {"pipeline": pipeline, "model": {"name_or_path": str(model), "seq_len": 32}, "data": {"format": "json", **data}}
    )


@pytest.fixture
def drawn():
    """What each source gave, as the summary says it (raylane.loop.data.baddata's record)."""
    from raylane.loop.data import baddata

    baddata.forget_skipped()
    yield lambda: {k: v for k, v in baddata.skipped_rows()["data.mix"]["counts"].items() if k.startswith("from ")}
    baddata.forget_skipped()


def _words(messages: np.ndarray) -> list[str]:
    return [m[1]["content"] for m in messages]


def test_a_dataset_source_and_a_file_source_are_drawn_together_at_0_8_and_0_2(chat_model, tmp_path, drawn):
    """2,000 drawn: exactly 1,600 of the dataset's rows and 400 of the file's, each the row the
    draw names (its row in its own source); through raylane.hf.pipeline, the summary's counts."""
    import raylane.hf
    from raylane.hf import mixture

    code = _chat(tmp_path, "code", 300, "w2")
    chat = _dataset(500, "w1")
    mix = [{"name": "chat", "weight": 0.8}, {"train": str(code), "weight": 0.2, "name": "code"}]
    cfg = _config(chat_model, {"mix": mix, "mix_examples": 2000})
    sources = mixture.handed_datasets(cfg.data.mix, {"chat": chat})
    assert sources[0] is chat and sources[1] is None
    batch, which, where, taken = mixture.mixed_rows(cfg, ["messages"], sources)
    assert taken == [1600, 400]
    # Each drawn example is the row `where` of its source: the dataset's (w1) or the file's (w2).
    expected = [_conversation(("w1", "w2")[s], int(r))["messages"] for s, r in zip(which, where, strict=True)]
    assert [list(m) for m in batch["messages"]] == expected  # a file's lists are read as arrays

    cfg = _config(chat_model, {"mix": mix, "mix_examples": 100})
    rows = raylane.hf.pipeline(cfg, train={"chat": chat}).train_set
    assert len(rows) > 0 and {"input_ids", "labels", "position_ids"} <= set(rows.arrays)
    assert drawn() == {"from chat": 80, "from code": 20}


def test_datasets_alone_resolve_data_style_auto_and_a_bad_row_is_named_by_its_dataset(chat_model, drawn):
    """No files: data.style auto is read off the datasets' columns (messages, the loss on the
    answers); a bad row is `data.mix.N (dataset 'name') row R`, its row in the dataset, from 1."""
    import raylane.hf
    from raylane import DataError
    from raylane.hf.data import pad_id, tokenizer

    mix = [{"name": "chat", "weight": 3}, {"name": "code", "weight": 1}]
    cfg = _config(chat_model, {"mix": mix})
    rows = raylane.hf.pipeline(cfg, train={"chat": _dataset(9, "w1"), "code": _dataset(3, "w2")}).train_set
    ids, labels = rows.arrays["input_ids"], rows.arrays["labels"]
    real = ids != pad_id(tokenizer(str(chat_model)))
    assert (labels[real] != -100).any() and (labels[real] == -100).any()  # the answers only, as messages
    assert drawn() == {"from chat": 9, "from code": 3}

    bad = _dataset(3, "w2").to_list()
    bad[1]["messages"][0]["role"] = "robot"
    with pytest.raises(DataError, match=r"data.mix.1 \(dataset 'code'\) row 2, column 'messages'"):
        raylane.hf.pipeline(cfg, train={"chat": _dataset(9, "w1"), "code": datasets.Dataset.from_list(bad)})


def _one_line(exc: BaseException) -> str:
    text = str(exc)
    assert "\n" not in text, text
    return text


@pytest.mark.parametrize(
    "mix, handed, line",
    [
        (  # a source of neither: named by its key, with what was handed in
            [{"name": "chat", "weight": 1}, {"name": "code", "weight": 1}],
            ["code"],
            r"^data.mix.0: no train, and no dataset named 'chat' handed to raylane.hf.pipeline\(cfg, "
            r"train=\{name: dataset\}\) \(handed in: 'code'\)$",
        ),
        (  # a dataset no source takes
            [{"name": "chat", "weight": 1}, {"train": "FILE", "name": "code", "weight": 1}],
            ["chat", "cod"],
            r"^raylane.hf.pipeline\(cfg, train=\{'cod': ...\}\): no data.mix source is named 'cod' "
            r"\(the sources: 'chat', 'code'\)$",
        ),
        (  # a source of both
            [{"name": "chat", "weight": 1}, {"train": "FILE", "name": "code", "weight": 1}],
            ["chat", "code"],
            r"^data.mix.1: train = '.*code.jsonl' and a dataset named 'code' handed to raylane.hf.pipeline: give one$",
        ),
        (  # a dataset without the style's column (the files resolved it: messages)
            [{"name": "chat", "weight": 1}, {"train": "FILE", "name": "code", "weight": 1}],
            ["chat:text"],
            r"^data.mix.0 \(dataset 'chat'\): no column 'messages' in the dataset \(it has: text\)$",
        ),
        (  # one dataset, not by name
            [{"name": "chat", "weight": 1}, {"train": "FILE", "name": "code", "weight": 1}],
            "one",
            r"^data.mix with a dataset handed to raylane.hf.pipeline\(cfg, train=...\): hand a mixture's datasets "
            r"by source name, train=\{name: dataset\}",
        ),
        (  # datasets by name, no mixture
            None,
            ["chat", "code"],
            r"^raylane.hf.pipeline\(cfg, train=\{'chat': ..., 'code': ...\}\): datasets by name are the sources of "
            r"data.mix, which is not set",
        ),
    ],
)
def test_datasets_that_do_not_match_the_sources_are_one_line_each(chat_model, tmp_path, mix, handed, line):
    import raylane.hf
    from raylane import ConfigError

    code = str(_chat(tmp_path, "code", 4, "w2"))
    sources = [{k: code if v == "FILE" else v for k, v in s.items()} for s in mix or ()]
    cfg = _config(chat_model, {"mix": sources} if mix else {"train": code})
    plain = datasets.Dataset.from_list([{"text": "w3"}])  # `name:text`: a dataset of plain text
    train = (
        _dataset(4, "w1")
        if handed == "one"
        else {n.split(":")[0]: plain if ":" in n else _dataset(4, "w1") for n in handed}
    )
    with pytest.raises(ConfigError) as caught:
        raylane.hf.pipeline(cfg, train=train)
    _one_line(caught.value)
    caught.match(line)


@pytest.mark.parametrize(
    "mix, pipeline, line",
    [
        ([{"weight": 1}, {"name": "b", "weight": 1}], "own", r"data.mix.0: neither train \(its files\) nor name"),
        ([{"name": "a", "weight": 1}, {"name": "a", "weight": 2}], "own", r"data.mix.1.name = 'a': data.mix.0 has"),
        ([{"name": "a", "weight": 1}, {"name": "b", "weight": 1}], "hf", r"data.mix.0.train = None: pipeline 'hf'"),
    ],
)
def test_a_source_that_can_never_have_rows_is_refused_by_the_config(chat_model, mix, pipeline, line):
    """Before any pipeline is built: no files and no name; two sources of one name (a dataset is
    handed in by it, and the summary counts by it); the shipped pipeline, which hands in none."""
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as caught:
        _config(chat_model, {"mix": mix}, pipeline)
    caught.match(line)


def test_a_local_and_an_s3_source_are_drawn_at_their_weights(chat_model, tmp_path, drawn, s3_endpoint, monkeypatch):
    """The s3:// source's files listed and read through pyarrow's S3 filesystem from a real
    S3-compatible server on loopback (its columns checked by the config, as a local source's)."""
    import pyarrow.fs as pafs

    from raylane.hf.data import from_mix

    for name, value in s3_endpoint.items():
        monkeypatch.setenv(name, value)
    url = s3_endpoint["AWS_ENDPOINT_URL"]
    fs = pafs.S3FileSystem(endpoint_override=url, access_key="testing", secret_key="testing", region="us-east-1")
    with fs.open_output_stream("raylane/mix/code/part-0.jsonl") as out:
        out.write(_chat(tmp_path, "remote", 30, "w2").read_bytes())
    local = _chat(tmp_path, "chat", 50, "w1")
    mix = [{"train": str(local), "weight": 0.8, "name": "chat"}, {"train": "s3://raylane/mix/code/", "weight": 0.2}]
    cfg = _config(chat_model, {"mix": mix, "mix_examples": 200})
    assert cfg.data.style == "messages"
    rows = from_mix(cfg)
    assert len(rows) > 0 and (rows.arrays["labels"] != -100).any()
    assert drawn() == {"from chat": 160, "from source 1": 40}

    from raylane.hf import mixture

    batch, which, _, _ = mixture.mixed_rows(cfg, ["messages"])
    assert set(_words(batch["messages"][which == 1])) == {"w2"}  # the bucket's rows, 30 of them drawn 40 times


@pytest.mark.parametrize("mixed", [False, True], ids=["dataset", "mixture-of-datasets"])
def test_conversations_handed_in_as_datasets_are_packed_by_default_as_files_are(chat_model, drawn, mixed):
    """data.style auto resolved by a dataset's columns before the model is prepared: `messages`
    rows are packed (several documents a row) and the model takes packed rows (no cache), as the
    same conversations in files would be (before: one a row, padded, the model unprepared)."""
    import raylane.hf

    if mixed:
        cfg = _config(chat_model, {"mix": [{"name": "chat", "weight": 1}, {"name": "code", "weight": 1}]})
        pipe = raylane.hf.pipeline(cfg, train={"chat": _dataset(12, "w1"), "code": _dataset(12, "w2")})
    else:
        cfg = _config(chat_model, {})
        pipe = raylane.hf.pipeline(cfg, train=_dataset(24, "w1"))
    assert cfg.data.style == "messages"
    starts = (pipe.train_set.arrays["position_ids"] == 0).sum(1)
    assert len(starts) < 24 and starts.max() > 2, starts  # 24 short conversations in fewer rows of 32
    assert pipe.model.config.use_cache is False
