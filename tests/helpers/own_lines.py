"""The lines raylane itself prints in a run (raylane.tracking.progress, raylane.driver,
raylane.cli): a test of what a run prints holds its output to these, so that a line of Ray,
MLflow, Tune or torch on the terminal fails it."""

from __future__ import annotations

import re

FIGURES = r"loss [\d.]+ [\d,]+ samples/s( [\d,]+ tokens/s)? \(steps? \d+(-\d+)?\)"
OWN_FORMATS = [
    re.compile(p)
    for p in (
        r"run \S+ \(MLflow run [0-9a-f]{32}(, continued)?\)",
        r"no run '\S+' under \S+: starting a fresh one",
        r"joining the local Ray head at \S+ .*",
        r"raylane: (warning: )?.+",
        r"\[raylane\] strategy \w+ \(.+\)",
        rf"\[raylane\] epoch \d+(/\d+)? step \d+/\d+ \(\d+%\)( {FIGURES})? eta [\d:?]+",
        r"\[raylane\] (epoch|step) \d+ eval: (\w+ [\d.]+ ?)+",
        r"\[raylane\] (warning|error)( \(rank \d+\))?: .+",
        r"\[raylane\] (resumed from step \d+|worker group restarted \(\d+\))",
        r"\[raylane\] straggler: rank \d+ on \S+ takes .+",
        r"run \S+: (FINISHED|FAILED|KILLED)",
        r"  (error|resumed from|steps|train loss|throughput|eval|MLflow run id|MLflow|checkpoint|model|MLflow UI|"
        + r"straggler|profile|"
        + r"library log): +\S.*",
    )
]


def foreign(output: str) -> list[str]:
    return [line for line in output.splitlines() if not any(f.fullmatch(line) for f in OWN_FORMATS)]
