"""A real browser looks at the MLflow UI: headless Chromium (Debian's, driven by Playwright)
opens a real `mlflow server` after a short training and finds the run and its metric charts.
The screenshot is kept in test-artifacts/."""

from __future__ import annotations

import shutil

import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import REPO, cli_env, read_json

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ARTIFACTS = REPO / "test-artifacts"


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (make test installs it as root)")
def test_mlflow_ui_shows_the_run_and_its_charts(run_cli, tmp_path, shared_mlflow_server):
    from playwright.sync_api import expect, sync_playwright

    proc = run_cli("train", "digits", "--local", "--set", "run.name=seen-in-chromium", "--set", "train.max_epochs=3",
                   "--set", "mlflow.log_model=false", "--summary-json", "s.json",
                   env=cli_env(tmp_path, MLFLOW_TRACKING_URI=shared_mlflow_server.uri))
    assert proc.wait(180) == 0, proc.output
    s = read_json(tmp_path / "s.json")
    experiment_id = MlflowClient(shared_mlflow_server.uri).get_run(s["run_id"]).info.experiment_id
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"{shared_mlflow_server.uri}/#/experiments/{experiment_id}/runs")
            expect(page.get_by_text("seen-in-chromium").first).to_be_visible(timeout=60_000)
            page.screenshot(path=str(ARTIFACTS / "mlflow-ui-experiment.png"), full_page=True)

            page.goto(f"{shared_mlflow_server.uri}/#/experiments/{experiment_id}/runs/{s['run_id']}/model-metrics")
            expect(page.get_by_text("seen-in-chromium (eval/accuracy)")).to_be_visible(timeout=60_000)
            chart = page.locator("svg.main-svg")  # plotly draws each metric chart as SVG
            expect(chart.first).to_be_visible()
            assert chart.count() >= 3
            page.screenshot(path=str(ARTIFACTS / "mlflow-ui-run-metrics.png"), full_page=True)
        finally:
            browser.close()
    assert (ARTIFACTS / "mlflow-ui-run-metrics.png").stat().st_size > 10_000
