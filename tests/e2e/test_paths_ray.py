"""A config's input paths on Ray: a run launched from another folder trains with its relative
paths resolved on the driver (their resolution: tests/unit/test_paths.py)."""

from __future__ import annotations

import pytest
import yaml

from tests.conftest import REPO, read_json

CSV = "a,b,label\n" + "".join(f"{i % 5 / 5:.2f},{(i * 7) % 3 / 3:.2f},{i % 2}\n" for i in range(256))


def _project(root):
    """A copy of the shipped tabular.yaml in a project folder, pointed at CSV data beside it."""
    project = root / "project"
    (project / "data").mkdir(parents=True)
    (project / "data" / "train.csv").write_text(CSV)
    config = yaml.safe_load((REPO / "pipelines" / "tabular.yaml").read_text())
    config["data"].update(train="data/train.csv", format="csv", features=["a", "b"], target="label")
    (project / "tabular.yaml").write_text(yaml.safe_dump(config))
    return project


@pytest.mark.slow  # Ray Data beside the workers (~45 s); make test launches Ray runs from another folder than
# their config's, with relative model and data paths, in test_hf.py (map-style data, no Ray Data)
@pytest.mark.ray
@pytest.mark.shared_ray
@pytest.mark.untracked
def test_tabular_trains_on_ray_from_another_working_directory(run_cli, tmp_path):
    """The issue's case: a relative data path in a project's tabular.yaml. Before, it passed the
    driver's check (relative to wherever the command ran) and failed ~40 s later on Ray's
    workers, whose working directory is not the driver's."""
    _project(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = run_cli(
        "train",
        "../project/tabular.yaml",
        "--set",
        "train.max_epochs=1",
        "--set",
        "run.name=rel",
        "--summary-json",
        "s.json",
        cwd=elsewhere,
    )
    assert proc.wait(240) == 0, proc.output
    summary = read_json(elsewhere / "s.json")
    assert summary["status"] == "FINISHED" and summary["epochs"] == 1 and summary["steps"] >= 1
    assert (elsewhere / "runs" / "rel").is_dir()
