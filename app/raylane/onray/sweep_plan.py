"""What a sweep will run, known before it runs: how many trials (a grid's points times
`num_samples`), and for `raylane check SWEEP.yaml` each trial's values, drawn by the same seeded
search that `raylane tune` hands Tune. Ray Tune is imported for the draw; no Ray cluster starts."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from raylane.config import BaseConfig
from raylane.config.sweep import SweepSection, trial_config
from raylane.tracking.progress import plural


def grid_points(sweep: SweepSection) -> int:
    """The points of the space's grid: the product of its listed values' counts (1 without a grid)."""
    return math.prod(len(args) for kind, args in _domains(sweep) if _is_grid(kind, sweep))


def trial_count(sweep: SweepSection) -> int:
    """The trials the sweep runs: Tune repeats the whole grid `num_samples` times."""
    return grid_points(sweep) * sweep.num_samples


def _domains(sweep: SweepSection) -> list[tuple[str, Any]]:
    return [next(iter(domain.items())) for domain in sweep.space.values()]


def _is_grid(kind: str, sweep: SweepSection) -> bool:
    return kind == "grid" or (kind == "choice" and sweep.algorithm == "grid")


def trials_text(sweep: SweepSection) -> str:
    """'4 trials', or with a grid '6 trials (a grid of 3 points, 2 samples each)'."""
    points = grid_points(sweep)
    if not any(_is_grid(kind, sweep) for kind, _ in _domains(sweep)):
        return plural(trial_count(sweep), "trial")
    each = f", {plural(sweep.num_samples, 'sample')} each" if sweep.num_samples > 1 else ""
    return f"{plural(trial_count(sweep), 'trial')} (a grid of {plural(points, 'point')}{each})"


def param_space(sweep: SweepSection) -> dict[str, Any]:
    """The space as Tune's domains."""
    from ray import tune

    out = {}
    for key, domain in sweep.space.items():
        kind, args = next(iter(domain.items()))
        if _is_grid(kind, sweep):
            out[key] = tune.grid_search(list(args))
        elif kind == "choice":
            out[key] = tune.choice(list(args))
        elif kind == "uniform":
            out[key] = tune.uniform(*args)
        elif kind == "loguniform":
            out[key] = tune.loguniform(*args)
        else:
            out[key] = tune.randint(*args)
    return out


def search_alg(sweep: SweepSection, concurrency: int):
    """The search that draws each trial's values."""
    if sweep.algorithm == "optuna":
        from ray.tune.search import ConcurrencyLimiter
        from ray.tune.search.optuna import OptunaSearch

        return ConcurrencyLimiter(OptunaSearch(metric=sweep.metric, mode=sweep.mode, seed=sweep.seed), concurrency)
    from ray.tune.search import BasicVariantGenerator

    # The same seed, the same trials. (TuneConfig.max_concurrent_trials is ignored for it.)
    return BasicVariantGenerator(random_state=sweep.seed, max_concurrent=concurrency)


@dataclass
class SweepPlan:
    """What `raylane check SWEEP.yaml` found: the sweep, its base config (the sweep file's
    overrides and --set applied), each trial's config keys that differ from the base (None where
    Optuna draws the values as results come in), and the line to show when the sweep already
    finished."""

    sweep: SweepSection
    base: BaseConfig
    trials: list[dict[str, Any]] | None
    finished: str | None = None


def planned_trials(sweep: SweepSection, base: BaseConfig) -> list[dict[str, Any]] | None:
    """Each trial's changes to the base config, in the order Tune creates the trials: the
    space's values, and a key that `sweep.global_batch` adjusts to hold the batch."""
    if sweep.algorithm == "optuna":
        return None
    from ray.tune.experiment import Experiment

    search = search_alg(sweep, concurrency=trial_count(sweep))  # all at once: none ends here
    search.add_configurations(
        [Experiment("plan", run=lambda config: None, config=param_space(sweep), num_samples=sweep.num_samples)]
    )
    flat = base.flat()
    out = []
    for _ in range(trial_count(sweep)):
        values = search.next_trial().config
        trial = trial_config(base, values, sweep.global_batch).flat()
        out.append({k: v for k, v in trial.items() if k in values or v != flat.get(k)})
    return out


def plan_text(plan: SweepPlan) -> str:
    """What `raylane check SWEEP.yaml` prints after the sweep's section."""
    sweep = plan.sweep
    how = {"random": f"random search, seed {sweep.seed}", "grid": "grid search", "optuna": "Optuna"}[sweep.algorithm]
    later = {
        "asha": f"; ASHA may stop a trial after {plural(sweep.grace_period, 'epoch')}",
        "pbt": "; PBT then perturbs their values",
        "fifo": "",
    }[sweep.scheduler]
    lines = [
        f"# base config: {sweep.base} with this file's overrides, {plural(plan.base.train.epoch_limit, 'epoch')} "
        f"a trial on {plural(plan.base.scaling.num_workers, 'worker')}",
        f"# {trials_text(sweep)}, {how}{later}:",
    ]
    if plan.trials is None:
        lines.append("#   drawn by Optuna as the trials' results come in")
    for number, changes in enumerate(plan.trials or [], 1):
        lines.append(f"#   {number}: " + " ".join(f"--set {k}={_shown(v)}" for k, v in changes.items()))
    if plan.finished:
        lines.append(f"# {plan.finished}")
    return "\n".join(lines)


def _shown(value: Any) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)
