"""B1b: the per-step cost of a dict batch passed as `model(**batch)`, with the model's own loss,
against the same model fed `(input, target)` pairs and a `loss_fn` (scripts.benchmarks.batchform), on
2 torchrun ranks. Slopes between a short and a long run, both forms interleaved."""

from __future__ import annotations

import statistics
from typing import Any

PIPELINE = "scripts.benchmarks.batchform"
FORMS = ("pair", "dict")


def b1b(bench: Any) -> dict[str, Any]:
    from scripts.benchmarks.common import QUIET, stats

    short, long = (30, 90) if bench.quick else (100, 600)
    print(f"[bench] B1b dict batches against pairs: {short} and {long} steps", flush=True)

    config = bench.work / "b1b.yaml"  # `raylane train` takes a config file or a shipped name
    config.write_text(f"pipeline: {PIPELINE}\n")

    def run(form: str, steps: int) -> dict[str, Any]:
        sets = [
            *QUIET,
            f"model.form={form}",
            f"train.max_steps={steps}",
            "train.max_epochs=1000000",
            "scaling.num_workers=2",
        ]
        return bench.raylane(str(config), sets, launcher="torchrun")

    pairs: dict[str, list[tuple[dict[str, Any], dict[str, Any]]]] = {form: [] for form in FORMS}
    for _ in range(bench.repeats):
        for form in FORMS:
            pairs[form].append((run(form, short), run(form, long)))
    out: dict[str, Any] = {"steps": [short, long]}
    for key, label in (("train_s", "step_ms"), ("train_cpu_s", "cpu_step_ms")):
        slopes = {
            form: [(b[key] - a[key]) / (b["steps"] - a["steps"]) * 1e3 for a, b in runs] for form, runs in pairs.items()
        }
        out[label] = {form: stats(v) for form, v in slopes.items()}
        out[f"{label}_dict_over_pair"] = statistics.median(slopes["dict"]) / statistics.median(slopes["pair"])
        # The spread between identical runs: what a difference must exceed to be seen.
        out[f"{label}_pair_spread"] = (max(slopes["pair"]) - min(slopes["pair"])) / statistics.median(slopes["pair"])
    return out
