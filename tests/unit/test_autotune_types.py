"""`raylane autotune`'s data is typed from the ranks to the summary (issue 61, item 5): the settings
the driver hands every rank (raylane.config.autotune.SearchSettings), each candidate's Outcome in
the Candidate and Round events, the search's SearchResult in SearchEnd, and the Ranking. A key
nobody knows is refused, not dropped. What the user sees stays the old code's: the summary, the
lines and the record's fingerprint are compared with what the code before the change (c796f42,
dicts across processes) wrote for the same outcomes. And a torchrun rank of autotune starts as a
training rank does (raylane.loop.run.prelude): NCCL's flight recorder before its process group."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
from pydantic import ValidationError

from raylane import results
from raylane.autotuning.driver import Recorder, execute
from raylane.autotuning.record import SearchRecord, fingerprint
from raylane.config import load_config
from raylane.config.autotune import AutotuneSection, SearchSettings, settings
from raylane.loop.protocols.events import Candidate, Round, SearchEnd, SearchStart
from raylane.loop.protocols.result import Fit, Outcome, SearchResult
from raylane.results import Status

BEFORE = Path(__file__).with_name("autotune_summary_c796f42.json")
OWN = {
    "strategy.name": "ddp",
    "train.batch_size": 16,
    "train.precision": "fp32",
    "train.activation_checkpointing": False,
    "train.compile": False,
    "strategy.bucket_cap_mb": 25.0,
    "strategy.reshard_after_forward": True,
    "strategy.comm_hook": "none",
}
# Two tied within the noise (the simpler wins), one out of memory, one slower whose later round failed.
OUTCOMES = [
    Outcome(
        OWN,
        grad_accum_steps=1,
        samples_per_s=100.0,
        interval=[95.0, 104.0],
        windows=[[99.0, 100.0, 101.0, 95.0, 104.0], [100.0, 100.5, 99.5, 98.0, 102.0]],
        window_s=[[0.1] * 5, [0.1] * 5],
        rounds=2,
        samples_per_step=32,
        step_time_s=0.32,
        peak_memory_bytes=123456,
        estimated_bytes=100000,
        profile_s=3.0,
        setup_s=0.5,
        eval_s=0.01,
        save_s=0.2,
        steps_per_epoch=10,
        pid=42,
    ),
    Outcome(
        {**OWN, "strategy.bucket_cap_mb": 1.0},
        grad_accum_steps=1,
        samples_per_s=101.0,
        interval=[96.0, 106.0],
        windows=[[101.0] * 5],
        window_s=[[0.1] * 5],
        rounds=1,
        peak_memory_bytes=120000,
        estimated_bytes=99000,
        profile_s=1.5,
        pid=42,
    ),
    Outcome({**OWN, "train.batch_size": 32}, Fit.OOM, error="out of memory on rank 1", estimated_bytes=200000),
    Outcome(
        {**OWN, "train.batch_size": 8},
        grad_accum_steps=2,
        samples_per_s=50.0,
        interval=[49.0, 51.0],
        windows=[[50.0] * 5],
        window_s=[[0.1] * 5],
        rounds=1,
        profile_s=1.0,
        pid=42,
        final=True,
        round_error="oom",
    ),
]


def _search_settings(tmp_path: Path):
    cfg = load_config(
        "regression",
        ["run.name=at", f"run.storage_path={tmp_path}/runs", "scaling.num_workers=2", "mlflow.enabled=false"],
    )
    section = AutotuneSection(
        strategies=["ddp"], precisions=["fp32"], activation_checkpointing=[False], bucket_cap_mb=[25, 1]
    )
    return cfg, settings(section, cfg, f"{tmp_path}/runs/at/autotune.jsonl")


def _crossed(event):
    """As the event reaches the driver from a Ray worker: pickled through the event actor."""
    return pickle.loads(pickle.dumps(event))


def test_the_typed_search_writes_the_summary_lines_and_fingerprint_the_dict_one_did(tmp_path, capsys):
    before = json.loads(BEFORE.read_text())
    cfg, search = _search_settings(tmp_path)
    assert fingerprint(cfg.flat(), _crossed(search)) == before["fingerprint"]  # an earlier record still replays
    recorder = Recorder(cfg, "sqlite:///x.db", 1000.0, None)
    recorder.on_event(_crossed(SearchStart(time_unix=1001.0)))
    for i, outcome in enumerate(OUTCOMES):
        recorder.on_event(_crossed(Candidate(index=i, replayed=False, outcome=outcome)))
    recorder.on_event(_crossed(Round(index=0, rounds=2, replayed=True, outcome=OUTCOMES[0])))
    recorder.on_event(_crossed(SearchEnd(time_unix=1002.0, result=SearchResult(OUTCOMES, 2.0, 2, 0.1, "cpu"))))
    out, summary_path = tmp_path / "best.yaml", tmp_path / "s.json"
    summary = recorder.finish(recorder.result, Status.FINISHED, None, search, str(out), str(summary_path))

    written = json.loads(summary_path.read_text())
    assert written["timing"].pop("wall_s") > 0
    expected = before["summary"]
    expected["timing"].pop("wall_s")
    expected["best"]["yaml"] = str(out)
    # Every summary's schema version moved on since (7: TrainSummary.packing_efficiency); this one's fields did not.
    assert written.pop("schema_version") == results.SCHEMA_VERSION and expected.pop("schema_version") == 5
    assert written == expected
    assert summary.ranking is not None and summary.ranking.winner == 0 and summary.ranking.ties == [0, 1]
    lines = capsys.readouterr().out.replace(str(tmp_path), "OUT").splitlines()
    replayed_round = "[autotune] 0 again (round 2): ddp, micro-batch 16 x 1, fp32: 100.0 [95.0-104.0] samples/s, peak 0 MiB (recorded)"
    assert lines == [*before["stdout"][:5], replayed_round, *before["stdout"][5:]]
    winner = json.loads(json.dumps(__import__("yaml").safe_load(out.read_text())))
    assert winner["strategy"]["bucket_cap_mb"] == 25.0 and winner["train"]["grad_accum_steps"] == 2


def test_search_settings_refuse_a_key_they_do_not_know(tmp_path):
    """The old SearchSettings.of dropped it: a misspelt setting changed nothing, silently."""
    _, search = _search_settings(tmp_path)
    given = search.model_dump()
    assert SearchSettings.model_validate(given) == search
    with pytest.raises(ValidationError, match="profile_step\n.*Extra inputs are not permitted"):
        SearchSettings.model_validate({**given, "profile_step": 3})
    with pytest.raises(ValidationError, match="frozen"):
        search.windows = 2  # what every rank was handed is what the driver reports


def test_an_outcome_with_a_key_it_does_not_know_is_refused_and_measured_again(tmp_path, caplog):
    """A record line from another version: its candidate is measured again, not replayed with a
    figure silently lost; the other lines replay as they were."""
    with pytest.raises(ValueError, match=r"unknown keys \['samples_per_sec'\]"):
        Outcome.from_dict({"values": OWN, "status": "ok", "samples_per_sec": 3.0})
    path = tmp_path / "autotune.jsonl"
    record = SearchRecord(str(path), "f")
    record.outcome(OUTCOMES[0])
    record.outcome(OUTCOMES[2])
    lines = path.read_text().splitlines()
    odd = json.loads(lines[1])
    odd["samples_per_sec"] = odd.pop("samples_per_s")
    path.write_text("\n".join([lines[0], json.dumps(odd)]) + "\n")
    done, rounds = SearchRecord(str(path), "f").replay()
    assert done == [OUTCOMES[0]] and rounds == []
    assert "an outcome measured again: an autotune outcome with unknown keys ['samples_per_sec']" in caplog.text


@pytest.fixture
def own_environment():
    """What the prelude sets in this process's environment, taken back after the test."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def test_autotune_as_a_torchrun_rank_sets_the_flight_recorder_before_its_process_group(
    tmp_path, monkeypatch, own_environment
):
    """The old autotune driver set `env:` and started the group without NCCL's flight recorder (a
    hang in a search left no collective trace). A GPU run on this CPU machine: the search itself
    fails at its device, after the prelude; the process group is spied on, not replaced."""
    import torch

    from raylane.loop import run

    if torch.cuda.is_available():
        pytest.skip("the search would run on the GPU: this test stops at a missing one")
    seen: list[dict[str, str]] = []
    real = run.init_process_group
    monkeypatch.setattr(run, "init_process_group", lambda *a: seen.append(dict(os.environ)) or real(*a))
    monkeypatch.chdir(tmp_path)
    cfg = load_config(
        "regression",
        [
            "run.name=fr",
            f"run.storage_path={tmp_path}",
            "scaling.use_gpu=true",
            "mlflow.enabled=false",
            "dist.flight_recorder_entries=64",
            "env.PRELUDE_CHECK=set",
        ],
    )
    summary = execute(
        AutotuneSection(), cfg, use_ray=False, address=None, out=str(tmp_path / "b.yaml"), summary_path=None
    )
    assert summary.status == Status.FAILED and "CUDA is not available" in (summary.error or "")
    assert len(seen) == 1
    assert seen[0]["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "64" and seen[0]["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert seen[0]["TORCH_FR_DUMP_TEMP_FILE"] == f"{tmp_path}/fr/stacks/nccl_trace_rank_"
    assert seen[0]["PRELUDE_CHECK"] == "set"
