"""A real browser looks at the MLflow UI: headless Chromium (Debian's, driven by Playwright) opens
a real `mlflow server` after a short training, and after the session's ASHA sweep
(conftest.asha_sweep), at the link raylane prints: the experiment opens in the model-training
view, the runs table shows the eval metric and the throughput, a sweep's trials sit under their
parent and open side by side in the compare view, and the run's metric charts are drawn. The
screenshots are kept in test-artifacts/."""

from __future__ import annotations

import base64
import json
import re
import shutil
import zlib

import pytest
from mlflow.tracking import MlflowClient

from raylane.tracking.experiment import EXPERIMENT_KIND_TAG, MODEL_TRAINING_KIND, VIEW_TAG, use_experiment
from tests.conftest import ASHA_TRIALS, REPO, cli_env, read_json

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ARTIFACTS = REPO / "test-artifacts"
UI_WAIT_MS = 60_000

needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="Debian's chromium is not installed (make test installs it as root)"
)


def _printed_link(output: str) -> str:
    found = re.findall(r"MLflow UI:\s+open (http\S+)", output)
    assert found, output
    return found[-1]


def _open_training_view(page, url: str, first_run: str) -> None:
    """The runs page in the model-training view, not the GenAI one (its sidebar lists Judges)."""
    from playwright.sync_api import expect

    page.goto(url)
    expect(_run_link(page, first_run)).to_be_visible(timeout=UI_WAIT_MS)
    expect(page.get_by_role("heading", name="Runs")).to_be_visible()
    expect(page.get_by_role("link", name="Model registry")).to_be_visible()
    expect(page.get_by_text("Judges", exact=True)).to_have_count(0)


def _run_link(page, run_name: str):
    return page.locator("div.ag-root").get_by_role("link", name=run_name, exact=True)


def _row(page, run_name: str):
    """The run's row: its name's part (the grid pins it to the left, in a container of its own)."""
    return page.locator("div.ag-root div.ag-row", has=page.get_by_role("link", name=run_name, exact=True))


def _assert_row_shows(page, run_name: str, run, metrics: tuple[str, ...]) -> None:
    """The table's row for the run shows each metric's last value, in a column named after it."""
    from playwright.sync_api import expect

    index = _row(page, run_name).get_attribute("row-index")  # the same in every part of the row
    for key in metrics:
        expect(page.get_by_role("columnheader", name=key, exact=True).first).to_be_visible()
        cell = page.locator(f"div.ag-row[row-index='{index}'] [role=gridcell][col-id='metrics.`{key}`']")
        expect(cell).to_have_text(re.compile(r"\d"))
        assert float(cell.inner_text().replace(",", "")) == pytest.approx(run.data.metrics[key], rel=1e-3)


@pytest.mark.slow  # ~40 s: a run of its own; make test opens the UI in Chromium on the session's sweep (below): its trials nested under the parent and compared
@needs_chromium
def test_mlflow_ui_shows_the_run_its_columns_and_its_charts(run_cli, tmp_path, shared_mlflow_server):
    from playwright.sync_api import expect, sync_playwright

    proc = run_cli(
        "train",
        "digits",
        "--local",
        "--set",
        "run.name=seen-in-chromium",
        "--set",
        "train.max_epochs=3",
        "--set",
        "mlflow.log_model=false",
        "--summary-json",
        "s.json",
        env=cli_env(tmp_path, MLFLOW_TRACKING_URI=shared_mlflow_server.uri),
    )
    assert proc.wait(180) == 0, proc.output
    s = read_json(tmp_path / "s.json")
    client = MlflowClient(shared_mlflow_server.uri)
    run = client.get_run(s["run_id"])
    experiment_id = run.info.experiment_id
    assert client.get_experiment(experiment_id).tags[EXPERIMENT_KIND_TAG] == MODEL_TRAINING_KIND
    link = _printed_link(proc.output)
    assert f"/#/experiments/{experiment_id}/runs?" in link
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1600, "height": 1000})
            _open_training_view(page, link, "seen-in-chromium")
            _assert_row_shows(page, "seen-in-chromium", run, ("eval/accuracy", "run/samples_per_s"))
            page.screenshot(path=str(ARTIFACTS / "mlflow-ui-experiment.png"), full_page=True)

            page.goto(f"{shared_mlflow_server.uri}/#/experiments/{experiment_id}/runs/{s['run_id']}/model-metrics")
            expect(page.get_by_text("seen-in-chromium (eval/accuracy)")).to_be_visible(timeout=UI_WAIT_MS)
            chart = page.locator("svg.main-svg")  # plotly draws each metric chart as SVG
            expect(chart.first).to_be_visible(timeout=UI_WAIT_MS)
            assert chart.count() >= 3
            page.screenshot(path=str(ARTIFACTS / "mlflow-ui-run-metrics.png"), full_page=True)
        finally:
            browser.close()
    assert (ARTIFACTS / "mlflow-ui-run-metrics.png").stat().st_size > 10_000


@needs_chromium
@pytest.mark.shared_ray
def test_mlflow_ui_nests_a_sweeps_trials_and_compares_them(asha_sweep):
    """The session's ASHA sweep (conftest.asha_sweep; test_tune.py checks its records): 2 trials,
    some stopped early by ASHA, under the parent run named after the sweep."""
    from playwright.sync_api import expect, sync_playwright

    s = asha_sweep.summary
    client = MlflowClient(asha_sweep.tracking_uri)
    trials = [client.get_run(r["run_id"]) for r in s["trials"]]
    assert len(trials) == ASHA_TRIALS and {t.data.tags["mlflow.parentRunId"] for t in trials} == {s["parent_run_id"]}
    experiment_id = trials[0].info.experiment_id
    assert client.get_experiment(experiment_id).tags[EXPERIMENT_KIND_TAG] == MODEL_TRAINING_KIND
    names = [t.info.run_name for t in trials]
    # Every trial has its eval metric, one ASHA stopped too; the whole-run throughput is a
    # trial's that ran to its end.
    assert any(t.info.status == "FINISHED" for t in trials)
    assert all("eval/accuracy" in t.data.metrics for t in trials)
    assert all("run/samples_per_s" in t.data.metrics for t in trials if t.info.status == "FINISHED")
    shown = ("eval/accuracy", "run/samples_per_s")
    parent = s["sweep"]
    assert parent == "digits-asha"
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1600, "height": 1000})
            _open_training_view(page, _printed_link(asha_sweep.output), parent)
            expect(_run_link(page, names[0])).to_have_count(0)  # folded under the parent
            _row(page, parent).locator("button[data-component-id$='runnamecellrenderer.tsx_46']").click()
            for name, trial in zip(names, trials, strict=True):
                _assert_row_shows(page, name, trial, tuple(k for k in shown if k in trial.data.metrics))
            page.screenshot(path=str(ARTIFACTS / "mlflow-ui-sweep.png"), full_page=True)

            compared = trials[:2]
            for trial in compared:
                _row(page, trial.info.run_name).locator("input.ag-checkbox-input").check()
            page.get_by_role("button", name="Compare", exact=True).click()
            expect(page.get_by_text("Comparing 2 Runs")).to_be_visible(timeout=UI_WAIT_MS)
            assert "/compare-runs?" in page.url and all(t.info.run_id in page.url for t in compared)
            for trial in compared:
                expect(page.get_by_text(trial.info.run_name, exact=True).first).to_be_visible()
            page.screenshot(path=str(ARTIFACTS / "mlflow-ui-compare.png"), full_page=True)
        finally:
            browser.close()


def _view_columns(client, experiment_id: str) -> list[str]:
    view = json.loads(client.get_experiment(experiment_id).tags[VIEW_TAG])
    state = view["state"]
    if state.startswith("deflate;"):
        state = zlib.decompress(base64.b64decode(state[len("deflate;") :])).decode()
    return json.loads(state)["selectedColumns"]


def test_an_experiment_keeps_the_kind_and_the_view_columns_someone_chose(shared_mlflow_server):
    """In-process, against the server: raylane adds its columns to the view and sets the kind only
    where none is set; a view it cannot read is left as it is."""
    client = MlflowClient(shared_mlflow_server.uri)
    name = "kind-chosen-by-a-person"
    chosen = json.dumps({"selectedColumns": ["params.`optim.lr`"]}).encode()
    # The UI's own format after 'Override saved view': the state deflated, in base64.
    saved = {"name": "raylane", "createdAt": 1, "state": f"deflate;{base64.b64encode(zlib.compress(chosen)).decode()}"}
    own = client.create_experiment(name, tags={EXPERIMENT_KIND_TAG: "genai_development", VIEW_TAG: json.dumps(saved)})

    assert use_experiment(client, name, ["eval/loss", "run/samples_per_s"]) == own
    assert client.get_experiment(own).tags[EXPERIMENT_KIND_TAG] == "genai_development"
    assert _view_columns(client, own) == ["params.`optim.lr`", "metrics.`eval/loss`", "metrics.`run/samples_per_s`"]
    use_experiment(client, name, ["eval/accuracy", "eval/loss"])
    assert _view_columns(client, own)[1:] == [
        "metrics.`eval/loss`",
        "metrics.`run/samples_per_s`",
        "metrics.`eval/accuracy`",
    ]

    client.set_experiment_tag(own, VIEW_TAG, "a view of someone else's")
    use_experiment(client, name, ["eval/f1"])
    assert client.get_experiment(own).tags[VIEW_TAG] == "a view of someone else's"
