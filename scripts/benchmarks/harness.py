"""`raylane bench`: raylane against a hand-written torchrun DDP loop and plain Ray, side by side.

Every figure is the median of `repeats` runs with its [min, max]; the sides of a comparison run
interleaved (A B A B ...) in one process, all with OMP_NUM_THREADS=1 and 2 gloo ranks unless
said otherwise. Step costs are slopes between a short and a long run, so start-up and the end of
the run cancel out. Results go to `<out>/results.json`, `<out>/results.md` and PNG charts
(scripts.benchmarks.report). Benchmarks are measurements, not tests: nothing here asserts a target."""

from __future__ import annotations

import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from scripts.benchmarks.common import PY, QUIET, RAYLANE, REPO, TORCHRUN, stats

BASELINE = str(REPO / "scripts" / "ddp_baseline.py")
RUN_TIMEOUT_S = 900
# (pipeline, short and long run in steps, overrides); quick runs use the first only, shorter.
B1_CASES = [("regression", (100, 600), []), ("digits", (50, 300), []), ("gpt-tiny", (20, 80), [])]
B1_SIDES = ("raylane on Ray", "raylane under torchrun", "hand-written torchrun DDP")
HAND = B1_SIDES[2]
# The hand-written loop in a plain TorchTrainer: tells Ray's own cost from raylane's. On the
# tiny-step case only, where per-step overhead shows (each of its runs starts a Ray cluster).
PLAIN_RAY = "hand-written loop on plain Ray Train"
# Compute-bound for B3: a wide MLP on digits, large batches.
B3_MODEL = ["model.hidden_size=1024", "model.num_layers=3", "train.batch_size=128"]
# B9, the cost of an epoch's end: run lengths in epochs, each pipeline's own defaults otherwise.
B9_EPOCHS = (30, 90)
# About 50 MB of parameters and Adam state for B7, so a save takes visible time.
B7_MODEL = ["model.hidden_size=2048", "model.num_layers=2"]


class Bench:
    def __init__(self, out: Path, repeats: int, quick: bool) -> None:
        self.out, self.repeats, self.quick = out, repeats, quick
        self.work = Path(tempfile.mkdtemp(prefix="raylane-bench-"))
        self.env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        self.env.update(
            OMP_NUM_THREADS="1",
            MKL_NUM_THREADS="1",
            RAY_USAGE_STATS_ENABLED="0",
            MLFLOW_TRACKING_URI=f"sqlite:///{self.work / 'mlflow.db'}",
            PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        )
        self._n = 0

    # -- running one process -------------------------------------------------------------------

    def run(self, argv: list[str], env: dict[str, str] | None = None) -> dict[str, float]:
        """Run to completion in its own session; (launched, exited) wall-clock times."""
        self._n += 1
        log = self.work / f"run-{self._n}.log"
        launched = time.time()
        with open(log, "w") as f:
            proc = subprocess.Popen(
                argv,
                cwd=self.work,
                env={**self.env, **(env or {})},
                stdout=f,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            try:
                rc = proc.wait(RUN_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rc = -9
        exited = time.time()
        if rc != 0:
            raise RuntimeError(f"{' '.join(argv)} exited {rc}; its output:\n{log.read_text()[-3000:]}")
        return {"launched": launched, "exited": exited}

    def raylane(
        self,
        pipeline: str,
        sets: list[str],
        *,
        launcher: str = "ray",
        env: dict[str, str] | None = None,
        args: list[str] = (),
    ) -> dict[str, Any]:
        """One `raylane train`: on an embedded Ray (`ray`), under torchrun, or in one process."""
        summary = self.work / f"summary-{self._n + 1}.json"
        head = {"ray": RAYLANE, "torchrun": [*TORCHRUN, "-m", "raylane"], "local": RAYLANE}[launcher]
        argv = [
            *head,
            "train",
            pipeline,
            *(["--local"] if launcher == "local" else []),
            "--set",
            f"run.storage_path={self.work / 'runs'}",
            "--set",
            f"run.name=b{self._n + 1}",
            *[x for s in sets for x in ("--set", s)],
            *args,
            "--summary-json",
            str(summary),
        ]
        times = self.run(argv, env)
        s = json.loads(summary.read_text())
        if s["status"] != "FINISHED":
            raise RuntimeError(f"{argv}: {s['status']} {s['error']}")
        return {
            **times,
            "train_s": s["train_s"],
            "train_cpu_s": s["train_cpu_s"],
            "steps": s["steps"],
            "summary": s,
            "epoch_end_s": s.get("epoch_end_s") or [],
            "first_step": s["timing"]["first_step_unix"],
            "last_step": s["timing"]["last_step_unix"],
        }

    def baseline(
        self,
        pipeline: str,
        steps: int | None,
        sets: list[str],
        *,
        plain_ray: bool = False,
        epochs: int | None = None,
        env: dict[str, str] | None = None,
        args: list[str] = (),
    ) -> dict[str, Any]:
        """The hand-written loop; with `epochs`, that many epochs and a snapshot at each end."""
        out = self.work / f"baseline-{self._n + 1}.json"
        head = [PY, BASELINE, "--ray"] if plain_ray else [*TORCHRUN, BASELINE]
        limits = ["--max-steps", str(steps)] if steps else []
        limits += ["--max-epochs", str(epochs), "--save-every-epoch"] if epochs else []
        times = self.run(
            [
                *head,
                "--pipeline",
                pipeline,
                *limits,
                *args,
                *[x for s in sets for x in ("--set", s)],
                "--json",
                str(out),
            ],
            env,
        )
        r = json.loads(out.read_text())
        return {
            **times,
            "train_s": r["train_s"],
            "train_cpu_s": r["train_cpu_s"],
            "steps": r["steps"],
            "epoch_end_s": r.get("epoch_end_s") or [],
            "first_step": r["first_step_unix"],
            "startup": r.get("startup", {}),
            "last_step": r["last_step_unix"],
        }

    def interleaved(self, sides: dict[str, Callable[[], Any]]) -> dict[str, list[Any]]:
        """Each side `repeats` times, A B C A B C ..."""
        samples: dict[str, list[Any]] = {name: [] for name in sides}
        for _ in range(self.repeats):
            for name, fn in sides.items():
                samples[name].append(fn())
                print(f"[bench]   {name}: done", flush=True)
        return samples

    # -- the benchmarks ------------------------------------------------------------------------

    def b1_b2(self) -> tuple[dict[str, Any], dict[str, Any]]:
        cases = B1_CASES[:1] if self.quick else B1_CASES
        b1: dict[str, Any] = {}
        short_runs: dict[str, list[dict[str, Any]]] = {}
        for pipeline, (short, long), extra in cases:
            if self.quick:
                short, long = short // 2, long // 3
            print(f"[bench] B1 {pipeline}: {short} and {long} steps", flush=True)

            def sides(steps: int, pipeline: str = pipeline, extra: list[str] = extra) -> dict[str, Callable[[], Any]]:
                sets = [*QUIET, *extra, f"train.max_steps={steps}", "train.max_epochs=1000000", "scaling.num_workers=2"]
                return {
                    B1_SIDES[0]: lambda: self.raylane(pipeline, sets),
                    B1_SIDES[1]: lambda: self.raylane(pipeline, sets, launcher="torchrun"),
                    B1_SIDES[2]: lambda: self.baseline(pipeline, steps, [*extra]),
                    PLAIN_RAY: lambda: self.baseline(pipeline, steps, [*extra], plain_ray=True),
                }

            names = [*B1_SIDES, *([PLAIN_RAY] if pipeline == "regression" else [])]
            pairs: dict[str, list[tuple[Any, Any]]] = {name: [] for name in names}
            for _ in range(self.repeats):  # short and long of each side back to back, sides interleaved
                for name in names:
                    pairs[name].append((sides(short)[name](), sides(long)[name]()))
            b1[pipeline] = {
                "steps": [short, long],
                **_slopes(pairs, "train_s", ""),
                **_slopes(pairs, "train_cpu_s", "cpu_"),
            }
            if pipeline == "regression":
                short_runs = {n: [a for a, _ in runs] for n, runs in pairs.items()}
        b2 = {
            name: {
                "launch_to_first_step_s": stats([r["first_step"] - r["launched"] for r in runs]),
                "last_step_to_exit_s": stats([r["exited"] - r["last_step"] for r in runs]),
            }
            for name, runs in short_runs.items()
        }
        return b1, b2

    def b2_tracked(self) -> dict[str, Any]:
        """B2 with MLflow on (local sqlite) and the default end-of-run records."""
        print("[bench] B2 with MLflow records", flush=True)
        sets = ["train.max_steps=50", "scaling.num_workers=2", "checkpoint.every_n_epochs=0"]
        runs = self.interleaved({"raylane on Ray, MLflow on": lambda: self.raylane("regression", sets)})
        return {
            name: {
                "launch_to_first_step_s": stats([r["first_step"] - r["launched"] for r in rs]),
                "last_step_to_exit_s": stats([r["exited"] - r["last_step"] for r in rs]),
            }
            for name, rs in runs.items()
        }

    def b3(self) -> dict[str, Any]:
        print("[bench] B3 scaling 1 -> 2 ranks", flush=True)
        sets = [*QUIET, *B3_MODEL, f"train.max_steps={15 if self.quick else 60}", "train.max_epochs=1000"]
        runs = self.interleaved(
            {
                "1 rank": lambda: self.raylane("digits", [*sets, "scaling.num_workers=1"], launcher="local"),
                "2 ranks": lambda: self.raylane("digits", [*sets, "scaling.num_workers=2"], launcher="torchrun"),
            }
        )
        one = [r["summary"]["samples_per_s"] for r in runs["1 rank"]]
        two = [r["summary"]["samples_per_s"] for r in runs["2 ranks"]]
        return {
            "samples_per_s": {"1 rank": stats(one), "2 ranks": stats(two)},
            "efficiency": stats([b / (2 * a) for a, b in zip(one, two, strict=True)]),
        }

    def b5(self) -> dict[str, Any]:
        print("[bench] B5 MLflow overhead (scripts/bench_mlflow.py)", flush=True)
        out = self.work / "b5.json"
        self.run([PY, str(REPO / "scripts" / "bench_mlflow.py"), "--repeats", str(self.repeats), "--out", str(out)])
        data = json.loads(out.read_text())
        return {
            mode: {
                "step_ms": stats(v["step_ms"]),
                "end_to_end_cost_pct": v["cost_pct"],
                "attributed_cost_pct": v["attributed_cost_pct"],
            }
            for mode, v in data.items()
        }

    def b6(self) -> dict[str, Any]:
        print("[bench] B6 FSDP against DDP memory", flush=True)
        sets = [*QUIET, "train.max_steps=3", "scaling.num_workers=2"]
        runs = self.interleaved(
            {
                s: (lambda s=s: self.raylane("gpt-tiny", [*sets, f"strategy.name={s}"], launcher="torchrun"))
                for s in ("ddp", "fsdp")
            }
        )
        state = {s: [r["summary"]["memory"]["state_bytes_per_rank"] for r in rs] for s, rs in runs.items()}
        return {
            "state_bytes_per_rank": {s: stats(v) for s, v in state.items()},
            "fsdp_over_ddp": stats([f / d for d, f in zip(state["ddp"], state["fsdp"], strict=True)]),
        }

    def b7(self) -> dict[str, Any]:
        """Checkpoint stall: the time rank 0's loop waits on saves before its last step, as the
        trainer measures it (`checkpoint_stall_s`), async against sync. The end-to-end figure
        (train time with saves minus without, per save) is kept too: on 2 busy cores it also
        carries the async writer's CPU and the noise of the machine."""
        print("[bench] B7 checkpoint stall", flush=True)
        steps, every = (60, 20) if self.quick else (200, 20)
        sets = [*QUIET, *B7_MODEL, f"train.max_steps={steps}", "train.max_epochs=1000", "scaling.num_workers=2"]
        saving = [f"checkpoint.every_n_steps={every}"]
        runs = self.interleaved(
            {
                "none": lambda: self.raylane("digits", sets, launcher="torchrun"),
                "sync": lambda: self.raylane(
                    "digits", [*sets, *saving, "checkpoint.async_save=false"], launcher="torchrun"
                ),
                "async": lambda: self.raylane(
                    "digits", [*sets, *saving, "checkpoint.async_save=true"], launcher="torchrun"
                ),
            }
        )
        saves = steps // every - 1  # the last step's save is the end of the run on every side
        stall = {m: [r["summary"]["checkpoint_stall_s"] / saves * 1e3 for r in runs[m]] for m in ("sync", "async")}
        lost = {
            m: [(r["train_s"] - n["train_s"]) / saves * 1e3 for r, n in zip(runs[m], runs["none"], strict=True)]
            for m in ("sync", "async")
        }
        return {
            "saves_per_run": saves,
            "stall_ms_per_checkpoint": {m: stats(v) for m, v in stall.items()},
            "async_over_sync": statistics.median(stall["async"]) / max(statistics.median(stall["sync"]), 1e-9),
            "end_to_end_ms_per_checkpoint": {m: stats(v) for m, v in lost.items()},
        }


def _epoch_end(bench: Bench) -> dict[str, Any]:
    """B9: what an epoch costs with `regression`'s own defaults (evaluation, a checkpoint and MLflow
    tracking at each epoch end) against the tutorial's loop saving a snapshot each epoch: the
    per-epoch slope between a short and a long run, and raylane's stall per checkpoint."""
    print("[bench] B9 epoch-end cost", flush=True)
    short, long = (2, 6) if bench.quick else B9_EPOCHS

    def side(name: str, epochs: int) -> dict[str, Any]:
        sets = [f"train.max_epochs={epochs}", "scaling.num_workers=2"]
        if name == HAND:
            return bench.baseline("regression", None, [], epochs=epochs)
        return bench.raylane("regression", sets, launcher="ray" if name == "raylane on Ray" else "torchrun")

    names = ("raylane on Ray", "raylane under torchrun", HAND)
    pairs: dict[str, list[tuple[Any, Any]]] = {n: [] for n in names}
    for _ in range(bench.repeats):
        for name in names:
            pairs[name].append((side(name, short), side(name, long)))
    # Epochs short+1..long of the long run, timed inside it: a Ray run's driver prepares the
    # end-of-run records (~5 s of CPU) and its rank 0 imports MLflow while the first epochs
    # train, which on 2 cores slows them by half; a short run lying inside that window makes
    # the slope between two runs charge start-up to epochs (30 vs 90 epochs: 59-143 ms on Ray).
    per_epoch = {
        n: [(b["epoch_end_s"][long - 1] - b["epoch_end_s"][short - 1]) / (long - short) * 1e3 for _, b in runs]
        for n, runs in pairs.items()
    }
    two_runs = {n: [(b["train_s"] - a["train_s"]) / (long - short) * 1e3 for a, b in runs] for n, runs in pairs.items()}
    # The end-of-run save is not a stall (the loop is over): long - 1 saves before the last step.
    stall = {
        n: [b["summary"]["checkpoint_stall_s"] / (long - 1) * 1e3 for _, b in runs]
        for n, runs in pairs.items()
        if n != HAND
    }
    return {
        "epochs": [short, long],
        "epoch_ms": {n: stats(v) for n, v in per_epoch.items()},
        "ratio_vs_hand_written": _ratios(per_epoch),
        "two_run_epoch_ms": {n: stats(v) for n, v in two_runs.items()},
        "two_run_ratio_vs_hand_written": _ratios(two_runs),
        "stall_ms_per_checkpoint": {n: stats(v) for n, v in stall.items()},
    }


def _ratios(per_epoch: dict[str, list[float]]) -> dict[str, float]:
    base = statistics.median(per_epoch[HAND])
    return {n: statistics.median(v) / base for n, v in per_epoch.items()}


def _slopes(pairs: dict[str, list[tuple[Any, Any]]], key: str, prefix: str) -> dict[str, Any]:
    """Per-step cost (ms) of each side from its (short, long) run pairs, and its ratio to the
    hand-written loop's. `train_s` gives wall time; `train_cpu_s` rank 0's CPU time, which other
    processes on the machine disturb far less, so it shows a per-step overhead under the noise."""
    slopes = {
        side: [(b[key] - a[key]) / (b["steps"] - a["steps"]) * 1e3 for a, b in runs] for side, runs in pairs.items()
    }
    base = statistics.median(slopes[B1_SIDES[2]])
    return {
        f"{prefix}step_ms": {side: stats(v) for side, v in slopes.items()},
        f"{prefix}ratio_vs_hand_written": {side: statistics.median(v) / base for side, v in slopes.items()},
    }


def machine() -> dict[str, Any]:
    import torch

    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
    }


ALL = (
    "B1",
    "B1b",
    "B2",
    "B2b",
    "B2w",
    "B3",
    "B4",
    "B5",
    "B6",
    "B7",
    "B8",
    "B9",
    "B10",
    "B11",
    "B12",
    "B13",
    "B14",
    "B15",
    "B16",
    "B17",
)


def run_bench(out: Path, *, quick: bool, only: list[str] | None, repeats: int | None) -> int:
    chosen = [next((a for a in ALL if a.upper() == b.upper()), b.upper()) for b in (only or ALL)]
    unknown = sorted(set(chosen) - set(ALL))
    if unknown:
        print(
            f"error: --only: unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(ALL)}", file=sys.stderr
        )
        return 2
    bench = Bench(out, repeats or (1 if quick else 5), quick)
    started = time.time()
    results: dict[str, Any] = {}
    failed: list[str] = []
    steps: list[tuple[str, Callable[[], Any]]] = []
    if "B1" in chosen or "B2" in chosen:
        steps.append(("B1", lambda: dict(zip(("B1", "B2"), bench.b1_b2(), strict=True))))
    if "B2" in chosen:
        steps.append(("B2", lambda: {"B2": {**results.get("B2", {}), **bench.b2_tracked()}}))
    steps += [
        (name, lambda fn=fn, name=name: {name: fn()})
        for name, fn in (
            ("B3", bench.b3),
            ("B4", lambda: b4(bench)),
            ("B5", bench.b5),
            ("B6", bench.b6),
            ("B7", bench.b7),
            ("B8", b8),
            ("B9", lambda: _epoch_end(bench)),
            ("B2b", lambda: b2b(bench)),
            ("B2w", lambda: b2w(bench)),
            ("B10", lambda: b10(bench)),
            ("B1b", lambda: b1b(bench)),
            ("B11", lambda: hf_bench(bench, "b11")),
            ("B12", lambda: hf_bench(bench, "b12")),
            ("B13", lambda: b13(bench)),
            ("B14", lambda: b14(bench)),
            ("B15", lambda: b15(bench)),
            ("B16", lambda: hf_bench(bench, "b16")),
            ("B17", lambda: hf_bench(bench, "b17")),
        )
        if name in chosen
    ]
    for name, step in steps:
        # One failed benchmark must not throw away the hour of figures around it: its error is
        # recorded and shown in the table, and results.json is rewritten after every benchmark.
        try:
            results.update(step())
        except Exception as e:  # noqa: BLE001 - any failure of a measured run
            print(f"[bench] {name} FAILED: {e}", flush=True)
            failed.append(name)
            results.setdefault("failed", {})[name] = str(e)[-4000:]
        _write(bench, out, only, chosen, started, results, final=False)
    print(_write(bench, out, only, chosen, started, results, final=True), flush=True)
    if failed:
        print(
            f"error: benchmark(s) {', '.join(failed)} failed; see results.json 'failed' and {bench.work}",
            file=sys.stderr,
        )
        return 1
    # Its runs' logs, checkpoints and MLflow database: kept above for a failure, else removed
    # (a full bench leaves ~1 GB of checkpoints in the temporary folder).
    shutil.rmtree(bench.work, ignore_errors=True)
    return 0


def _write(
    bench: Bench,
    out: Path,
    only: list[str] | None,
    chosen: list[str],
    started: float,
    results: dict[str, Any],
    *,
    final: bool,
) -> str:
    from scripts.benchmarks import report as bench_report

    report = {
        "machine": machine(),
        "quick": bench.quick,
        "repeats": bench.repeats,
        "started_unix": started,
        "wall_s": time.time() - started,
        "complete": final,
        "command": "raylane bench"
        + (" --quick" if bench.quick else "")
        + (f" --only {','.join(chosen)}" if only else ""),
        "results": results,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    return bench_report.write(report, out) if final else ""


def b2w(bench: Bench) -> dict[str, Any]:
    from scripts.benchmarks.warm_start import b2w as run_b2w

    return run_b2w(bench)


def b2b(bench: Bench) -> dict[str, Any]:
    from scripts.benchmarks.startup import b2b as run_b2b

    return run_b2b(bench)


def b4(bench: Bench) -> dict[str, Any]:
    from scripts.benchmarks.tune import b4 as run_b4

    return run_b4(bench)


def b8() -> dict[str, Any]:
    """GPU: gpt2-124m tokens/s and MFU (scripts/gpu-check.sh); skipped without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device on this machine (run scripts/gpu-check.sh on a GPU machine)"}
    out = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu-check.sh")],
        capture_output=True,
        text=True,
        env={**os.environ, "STEPS": os.environ.get("STEPS", "100")},
    )
    return {"exit_code": out.returncode, "output": out.stdout[-2000:]}


def b1b(bench: Bench) -> dict[str, Any]:
    from scripts.benchmarks.batches import b1b as run_b1b

    return run_b1b(bench)


def b13(bench: Bench) -> dict[str, Any]:
    from scripts.benchmarks.steptimes import b13 as run_b13

    return run_b13(bench)


def b14(bench: Bench) -> dict[str, Any]:
    from scripts.benchmarks.faults import b14 as run_b14

    return run_b14(bench)


def b15(bench: Bench) -> dict[str, Any]:
    from scripts.benchmarks.driverscale import b15 as run_b15

    return run_b15(bench)


def b10(bench: Bench) -> dict[str, Any]:
    from scripts.benchmarks.tune import b10 as run_b10

    return run_b10(bench)


def hf_bench(bench: Bench, name: str) -> dict[str, Any]:
    """B11, B12, B16 and B17 need raylane[hf]; without it they are skipped, saying why."""
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        return {"skipped": "raylane[hf] is not installed (pip install 'raylane[hf]')"}
    if name == "b16":
        from scripts.benchmarks.sft import b16

        return b16(bench)
    if name == "b17":
        from scripts.benchmarks.moe import b17

        return b17(bench)
    from scripts.benchmarks import hf

    return getattr(hf, name)(bench)
