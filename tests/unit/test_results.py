"""The summaries' schema: versioned, documented, and strict. The end-to-end tests check every
summary they read against it (tests/conftest.py: read_json)."""

from __future__ import annotations

import hashlib
import importlib.util
import json

import pytest
from pydantic import ValidationError

import raylane
from raylane import results
from tests.conftest import REPO, check_summary

# Each released schema version and the fingerprint of its JSON Schema. A change to any summary's
# fields (a name, a type, a field added or dropped) changes the fingerprint: release it as a new
# version (SCHEMA_VERSION + 1, its fingerprint added here), never under an old number.
RELEASED = {
    1: "aa2055c11546313678a1ee45182ddcda08089b35b87a07aa0e3fc2a6a474d979",
    2: "7e05ee98d19fb30db1eb0dc7217b98a95a1aa5d5be0ad721312085dc3f9cd39f",  # TrainSummary.skipped_rows
    3: "cf8b283cb24e3b8cd209eb77aae4be0f609f1f632b640fe1b255f12659ec011d",  # TrainSummary.stragglers, profile_traces
    4: "c7b95f217acbb397286777524a3ac27398deacad051744e9a6c76bcfc97ec9fc",  # TrainSummary.memory_snapshots
    5: "ff45be3f9884aeea8b1775ca3706cf863c1d70c306aaf0656f73a1c7ed792f35",  # Timing.warm_actors
    6: "61568c7f7ad5c127560b7af9590c3f9b1929c2f8feb121e2346baa1e0dc57e77",  # TrainSummary.replicas
    7: "b6db263582b695f61e67e88537889ee79914113edc4654627025a42dfb76734b",  # TrainSummary.real_tokens_per_s, packing_efficiency; Window.real_tokens_per_s, padding_share; SkippedRows.counts
    8: "20c4d423fefeee39a0be2494a69b06227ee6fd0dd18d0619557be95d4f4171de",  # TrainSummary.experts
}


def fingerprint() -> str:
    return hashlib.sha256(json.dumps(results.outline(), sort_keys=True).encode()).hexdigest()


def test_a_schema_change_needs_a_new_version():
    assert results.SCHEMA_VERSION == max(RELEASED), "SCHEMA_VERSION is not the newest released version"
    assert fingerprint() == RELEASED[results.SCHEMA_VERSION], (
        f"the summaries' schema changed but SCHEMA_VERSION is still {results.SCHEMA_VERSION}: bump it in "
        f"app/raylane/results.py, add {{{results.SCHEMA_VERSION + 1}: {fingerprint()!r}}} to RELEASED here, run `make docs`"
    )


def test_the_docs_are_what_the_code_generates():
    spec = importlib.util.spec_from_file_location("summary_docs", REPO / "scripts" / "summary_docs.py")
    docs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(docs)
    pages = docs.pages()
    assert (REPO / "docs/summary.md").read_text() == pages[REPO / "docs/summary.md"], "summary.md is stale: `make docs`"
    # Compared as data: the text of pydantic's JSON Schema output may change between its releases.
    assert json.loads((REPO / "docs/summary.schema.json").read_text()) == json.loads(
        pages[REPO / "docs/summary.schema.json"]
    ), "summary.schema.json is stale: run `make docs`"
    page = (REPO / "docs" / "summary.md").read_text()
    for model in results.SUMMARIES.values():  # every field of every summary, nested ones too
        for name, field in model.model_fields.items():
            assert f"| `{field.alias or name}` |" in page and field.description, (model.__name__, name)


def test_one_status_one_exit_code_table():
    assert {s.value: s.exit_code for s in raylane.Status} == {"FINISHED": 0, "FAILED": 1, "KILLED": 130}
    assert raylane.Status("FAILED") == "FAILED" and f"{raylane.Status.KILLED}" == "KILLED"
    # a Ray job's end, as `raylane submit --follow` reports it
    assert {k: v.exit_code for k, v in results.JOB_STATUSES.items()} == {"SUCCEEDED": 0, "FAILED": 1, "STOPPED": 130}


def test_a_misspelt_or_mistyped_field_is_refused_where_the_summary_is_built():
    with pytest.raises(ValidationError, match="stpes"):
        raylane.TrainSummary(status="FINISHED", run_name="r", stpes=3)
    with pytest.raises(ValidationError, match="status"):
        raylane.TrainSummary(status="DONE", run_name="r")
    with pytest.raises(ValidationError, match="steps"):
        raylane.TrainSummary(status="FINISHED", run_name="r", steps="many")


def test_each_summary_round_trips_through_its_file(tmp_path):
    made = [
        raylane.TrainSummary(
            status="FINISHED",
            run_name="r",
            steps=4,
            metrics={"loss": 0.5},
            resizes=[{"step": 2, "from": 2, "to": 1, "reason": "a node was lost", "steps_lost": 0, "time_lost_s": 1.5}],
        ),
        raylane.SweepSummary(status="FAILED", error="1 of 2 trials failed (t1)", sweep="s"),
        raylane.AutotuneSummary(
            status="FINISHED", run_name="a", candidates=[{"config": {"train.batch_size": 8}, "status": "pruned"}]
        ),
        raylane.SubmitSummary(
            status="KILLED", job_id="raysubmit_1", address="http://127.0.0.1:8265", job_status="STOPPED"
        ),
        raylane.ExportSummary(status="FINISHED", checkpoint="/c", format="hf", out="/o", files=["/o/config.json"]),
    ]
    for summary in made:
        path = tmp_path / f"{summary.command}.json"
        summary.write(path)
        data = json.loads(path.read_text())
        assert data["schema_version"] == results.SCHEMA_VERSION and data["command"] == summary.command
        check_summary(data)  # the documented JSON Schema accepts it
        assert raylane.read_summary(path) == summary
    assert json.loads((tmp_path / "train.json").read_text())["resizes"][0]["from"] == 2  # the field's name in JSON


def test_the_documented_schema_refuses_what_the_models_refuse():
    data = json.loads(raylane.TrainSummary(status="FINISHED", run_name="r").to_json())
    with pytest.raises(AssertionError, match="steps"):
        check_summary({**data, "steps": "many"})
    with pytest.raises(AssertionError, match="schema_version"):
        check_summary({**data, "schema_version": 0})
