"""`raylane` command line. Config errors exit 2 with one message, before torch or Ray start."""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from raylane import api, logs
from raylane import cli_tools as tools
from raylane.config import BaseConfig, ConfigError, for_shapes
from raylane.onray import output
from raylane.version import __version__

# Under torchrun, how long a rank other than 0 waits before exiting on a config error (see _config_error).
CONFIG_ERROR_GRACE_S = 5.0
VERBOSE_HELP = (
    "also show what Ray, MLflow, Tune and torch print (by default they go to a log file "
    "under $RAYLANE_HOME/logs, named at the end of a run)"
)
ADDRESS_HELP = (
    "Ray cluster to join (default: RAY_ADDRESS, else the head `raylane up` started, else a fresh "
    "embedded one; `local` for a fresh embedded one in any case)"
)


def parser() -> argparse.ArgumentParser:
    """The `raylane` command's parser: one subcommand per API call (scripts/config_docs.py reads
    it for the reference's example)."""
    p = argparse.ArgumentParser(prog="raylane", description="Distributed PyTorch training on Ray.")
    p.add_argument("--version", action="version", version=f"raylane {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    _add_check(sub)
    _add_runs(sub)
    _add_submit(sub)
    _add_cluster(sub)
    _add_export(sub)
    _add_bench(sub)
    tools.add_stacks(sub)
    tools.add_k8s(sub)
    tools.add_slurm(sub)
    return p


def _add_config_args(
    sp: argparse.ArgumentParser, what: str = "pipeline config YAML (or a shipped config's name: digits, gpt-tiny, ...)"
) -> None:
    sp.add_argument("config", help=what)
    sp.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set train.batch_size=64 (repeatable)",
    )


def _add_check(sub: Any) -> None:
    check = sub.add_parser("check", help="validate a config and print it resolved")
    _add_config_args(check)
    shown = check.add_mutually_exclusive_group()
    shown.add_argument(
        "--blocks",
        action="store_true",
        help="also build the pipeline here (runs its build(cfg) on this machine's CPU) and print the "
        "model's blocks: what FSDP shards, activation checkpointing recomputes and compile takes",
    )
    shown.add_argument(
        "--plan",
        action="store_true",
        help="also build the model on the meta device here and print the layout (strategy.tp and pp over "
        "scaling.num_workers), its pipeline stages under strategy.pp (each one's modules and parameters) and "
        "the pipeline's tensor-parallel plan on it: which modules are split how, what every rank holds whole, "
        "what is tied (instead of the config)",
    )
    shown.add_argument(
        "--explain",
        metavar="KEY",
        help="print one key (e.g. train.batch_size) instead of the whole config: its description, "
        "type, default, allowed values and the value this config resolves it to "
        "(docs/configuration.md lists every key)",
    )
    shown.add_argument(
        "--world",
        type=int,
        metavar="N",
        help="rehearse the run at N ranks instead, in this process on torch's fake process group: each rank's "
        "memory against the GPU's, the mesh, the batch, the step time, a checkpoint's files, MLflow's entries per "
        "window; what would fail at N exits 2 (docs/scale.md, Rehearse at full size)",
    )
    check.add_argument("--nodes", type=int, metavar="M", help="with --world: on M nodes of N/M ranks (default 1)")
    gpu = "with --world: H100, H200, A100, L4, ... (default: scaling.accelerator_type, else H100)"
    check.add_argument("--gpu", metavar="MODEL", help=gpu)
    # Its builds (--blocks, --plan, a model-parallel config's checks) import torch and
    # transformers: their warnings go to the library log, as a run's do.
    check.add_argument("--verbose", action="store_true", default=None, help=VERBOSE_HELP)


def _add_runs(sub: Any) -> None:
    """`train`, `tune` and `autotune`: the commands that start work on Ray (or without it)."""
    train = sub.add_parser("train", help="train a pipeline on Ray (or under torchrun / in-process)")
    _add_config_args(train)
    train.add_argument("--address", help=ADDRESS_HELP)
    train.add_argument("--summary-json", metavar="PATH", help="write the run's summary here")
    train.add_argument(
        "--register", metavar="NAME", help="register the final model in the MLflow model registry under NAME"
    )
    train.add_argument("--local", action="store_true", help="run in this process without Ray (implied under torchrun)")
    train.add_argument("--verbose", action="store_true", default=None, help=VERBOSE_HELP)
    sweep = sub.add_parser("tune", help="run a Ray Tune sweep of multi-worker trials (nested MLflow runs)")
    _add_config_args(
        sweep,
        "sweep YAML: a `sweep:` section naming its base pipeline config (or a shipped sweep's name: digits-sweep)",
    )
    sweep.add_argument("--address", help=ADDRESS_HELP)
    sweep.add_argument("--summary-json", metavar="PATH", help="write the sweep's summary here")
    sweep.add_argument("--register", metavar="NAME", help="register the best trial's model under NAME")
    sweep.add_argument("--verbose", action="store_true", default=None, help=VERBOSE_HELP)
    tuner = sub.add_parser(
        "autotune", help="find the fastest configuration of a pipeline that fits, in one worker group"
    )
    _add_config_args(tuner)
    tuner.add_argument("--address", help=ADDRESS_HELP)
    tuner.add_argument("--local", action="store_true", help="search in this one process, without Ray")
    tuner.add_argument("--budget-s", type=float, metavar="N", help="stop after N seconds with the best so far")
    tuner.add_argument("--summary-json", metavar="PATH", help="write the search's summary here")
    tuner.add_argument(
        "--out", default="autotuned.yaml", help="the winner's ready-to-train YAML (default: %(default)s)"
    )
    tuner.add_argument("--verbose", action="store_true", default=None, help=VERBOSE_HELP)


def _add_submit(sub: Any) -> None:
    job = sub.add_parser("submit", help="run `raylane train` as a Ray job on a cluster (Jobs SDK)")
    _add_config_args(job)
    job.add_argument(
        "--address",
        help="the cluster's dashboard URL (default: RAY_ADDRESS, else `raylane up`'s, else http://127.0.0.1:8265)",
    )
    job.add_argument("--follow", action="store_true", help="stream the job's logs and exit with its result")
    job.add_argument("--summary-json", metavar="PATH", help="with --follow: write the job's summary here")
    job.add_argument("--verbose", action="store_true", default=None, help=VERBOSE_HELP + "; for the job too")


def _add_cluster(sub: Any) -> None:
    """`up` and `down`: the persistent local Ray head."""
    start = sub.add_parser("up", help="start a persistent local Ray head that later runs on this machine join")
    start.add_argument(
        "--num-cpus",
        type=int,
        default=max(4, os.cpu_count() or 1),
        help="logical CPUs the head offers (default: max(4, cores))",
    )
    start.add_argument(
        "--warm",
        type=int,
        nargs="?",
        const=None,
        default=0,
        metavar="N",
        help="keep N idle warm workers for runs' actors, each a process that imported torch and Ray Train "
        "(--warm alone: one per CPU up to 8, plus 3). Off by default: every worker of the head then imports "
        "torch, which made a sweep slower (docs/clusters.md)",
    )
    start.add_argument("--port", type=int, help="GCS port (default: a free one)")
    start.add_argument("--dashboard-port", type=int, help="dashboard and jobs API port (default: a free one)")
    sub.add_parser("down", help="stop the local Ray head `raylane up` started")


def _add_export(sub: Any) -> None:
    export = sub.add_parser("export", help="write a checkpoint's full model weights as safetensors")
    export.add_argument("checkpoint", help="a checkpoint directory (runs/<name>/checkpoint_<step>)")
    export.add_argument(
        "--out",
        required=True,
        help="output .safetensors file (config JSON goes beside it); with --format hf, a new or empty folder",
    )
    export.add_argument(
        "--format",
        choices=("safetensors", "hf"),
        default="safetensors",
        help="safetensors: one file, raylane's names; hf: a Hugging Face model's save_pretrained "
        "folder, which from_pretrained loads (needs raylane[hf]; a LoRA run is merged)",
    )
    export.add_argument(
        "--adapter-only",
        action="store_true",
        help="with --format hf: a LoRA run's adapter alone, which PeftModel.from_pretrained loads",
    )
    export.add_argument("--summary-json", metavar="PATH", help="write what was exported here")
    export.add_argument("--verbose", action="store_true", default=None, help=VERBOSE_HELP)


def _add_bench(sub: Any) -> None:
    bench = sub.add_parser("bench", help="benchmark against hand-written torchrun DDP and plain Ray (B1-B10)")
    bench.add_argument("--quick", action="store_true", help="one repeat, short runs, fewer cases: checks the harness")
    bench.add_argument("--only", type=lambda s: s.split(","), metavar="B1,B2,...", help="run only these benchmarks")
    bench.add_argument("--repeats", type=int, help="runs per figure (default 5, or 1 with --quick)")
    bench.add_argument("--out", type=Path, default=Path("bench"), help="results.json, results.md and charts go here")
    bench.add_argument(
        "--verbose",
        action="store_true",
        default=None,
        help=VERBOSE_HELP + "; the runs it starts log to files under --out either way",
    )


def _bench(args: argparse.Namespace) -> int:
    if args.repeats is not None and args.repeats < 1:
        raise ConfigError(f"bench: --repeats must be at least 1, got {args.repeats}")
    # The benchmarks compare raylane with hand-written scripts of the repo (scripts/): they run
    # from a source checkout and are not in the wheel.
    checkout = Path(__file__).resolve().parents[2]
    if not (checkout / "scripts" / "benchmarks" / "harness.py").is_file():
        raise ConfigError(
            "bench: the benchmarks run from raylane's source checkout (scripts/benchmarks, beside "
            "hand-written baselines), which this install has none of: clone the repo, `make install` "
            "and run `raylane bench` there"
        )
    if str(checkout) not in sys.path:
        sys.path.insert(0, str(checkout))
    from scripts.benchmarks.harness import run_bench

    return run_bench(args.out.resolve(), quick=args.quick, only=args.only, repeats=args.repeats)


def _check(args: argparse.Namespace) -> int:
    rehearsal = args.world is not None or args.nodes is not None or args.gpu is not None
    with for_shapes(rehearsal or bool(args.plan or args.blocks)):  # the model on meta: no weights read
        return _rehearse(args) if rehearsal else _checked(args)


def _checked(args: argparse.Namespace) -> int:
    checked = api.check(args.config, args.overrides)
    sweep: dict[str, Any] = {}
    if isinstance(checked, BaseConfig):
        cfg = checked
    else:  # a sweep file: its section and trials; --explain and --blocks on its base config too
        from raylane.onray.sweep_plan import plan_text

        cfg, sweep = checked.base, {"sweep": checked.sweep.model_dump(mode="json")}
        if not (args.explain or args.blocks or args.plan):
            print(yaml.safe_dump(sweep, sort_keys=False), end="")
            print(plan_text(checked), flush=True)
            return 0
    if args.explain:
        from raylane.config_keys import explain, value_text

        text = explain(cfg, args.explain)
        if sweep and args.explain.split(".")[0] == "sweep":  # the sweep file's own value
            node: Any = sweep
            for part in args.explain.split("."):
                node = node[part] if isinstance(node, dict) else None
            text = text.rsplit("\n", 1)[0] + f"\n  {'resolved:':10}{value_text(node)}"
        print(text)
        return 0
    if args.plan:  # the plan, not the config again (`raylane check CONFIG` prints that)
        _print_plan(cfg)
        return 0
    print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False), end="")
    if args.blocks:
        from raylane.loop.usercode import pipeline_blocks
        from raylane.pipelines_ref import UserCodeError

        try:
            print(f"blocks: {pipeline_blocks(cfg).describe()}", flush=True)
        except UserCodeError as exc:  # build(cfg) raised, or returned no Pipeline (its blocks included)
            raise ConfigError(str(exc)) from None
    elif cfg.strategy.name != "ddp" or cfg.train.activation_checkpointing or cfg.train.compile:
        # Blocks matter to this run; finding them means building the model, which check does not.
        print("# blocks: `raylane check --blocks` builds the model and lists the blocks FSDP shards, "
              "activation checkpointing recomputes and compile takes", flush=True)  # fmt: skip
    return 0


def _rehearse(args: argparse.Namespace) -> int:
    """`raylane check --world N [--nodes M] [--gpu MODEL]`: the config's checks at N ranks, then
    the rehearsal (raylane.loop.rehearsal); what would fail at N is a ConfigError."""
    from raylane.loop.rehearsal import rehearse, target_of

    if args.world is None:
        raise ConfigError(f"{'--nodes' if args.nodes is not None else '--gpu'}: rehearses a run of --world N ranks")
    target_of(args.world, args.nodes or 1, args.gpu)  # the flags first: before the config is built
    try:
        checked = api.check(args.config, [*args.overrides, f"scaling.num_workers={args.world}"])
    except ConfigError as exc:  # the config's own checks at N: say it as the user asked it
        raise ConfigError(str(exc).replace(f"scaling.num_workers = {args.world}", f"--world {args.world}")) from None
    if not isinstance(checked, BaseConfig):
        raise ConfigError(f"--world {args.world}: rehearses a pipeline config; a sweep's trials are its base's")
    report = rehearse(checked, target_of(args.world, args.nodes or 1, args.gpu, checked.scaling.accelerator_type))
    print("\n".join(report.lines + [f"warning: {w}" for w in report.warnings]), flush=True)
    return 0


def _print_plan(cfg: BaseConfig) -> None:
    from raylane.loop.meta_build import Unchecked
    from raylane.loop.plan_view import pipeline_plan
    from raylane.pipelines_ref import UserCodeError

    world = int(os.environ.get("WORLD_SIZE", "0")) or cfg.scaling.num_workers  # torchrun's, as the check's
    try:
        lines = pipeline_plan(cfg, world)
    except (UserCodeError, ValueError, Unchecked) as exc:  # build(cfg) failed, or its plan fits not the model
        raise ConfigError(str(exc)) from None
    print("\n".join(lines), flush=True)


def _export(args: argparse.Namespace) -> int:
    api.export(
        args.checkpoint, args.out, format=args.format, adapter_only=args.adapter_only, summary_json=args.summary_json
    )  # which says what it wrote
    return 0


def _submit(args: argparse.Namespace) -> int:
    from raylane.onray.jobs import SubmitError

    if args.summary_json:
        if not args.follow:
            raise ConfigError(f"--summary-json = {args.summary_json!r}: needs --follow (the summary is the job's end)")
        from raylane.prechecks import writable_file

        writable_file("--summary-json", args.summary_json)
    try:
        # The job's `raylane train` inherits it (RAYLANE_VERBOSE): its log is what --follow shows.
        run = api.submit(
            args.config,
            args.overrides,
            address=args.address,
            env_vars={logs.VERBOSE_ENV: "1" if logs.verbose() else "0"},
        )
    except SubmitError as exc:  # the cluster did not take the job: not the user's input
        print(f"raylane: submit: {exc}", file=sys.stderr, flush=True)
        return 1
    print(f"submitted job {run.job_id} to {run.address}", flush=True)
    print(_destinations(run), flush=True)
    follow = f"RAY_AUTH_MODE=token ray job logs --follow --address {run.address} {run.job_id}"
    if not args.follow:
        print(f"follow it with: {follow}")
        return 0
    try:
        _show_job_log(run.follow())
        summary = run.summary(run.wait())
    except KeyboardInterrupt:  # the job goes on: it has no end to summarise yet
        print(
            f"raylane: stopped following job {run.job_id}; it goes on (follow it again with: {follow})",
            file=sys.stderr,
            flush=True,
        )
        return 130
    except Exception as exc:  # noqa: BLE001 - the cluster went away while following: one line
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        summary = run.summary(None, f"lost job {run.job_id} at {run.address} ({type(exc).__name__}: {first})")
        print(f"raylane: submit: {summary.error}", file=sys.stderr, flush=True)
        summary.write(args.summary_json)
        return summary.exit_code
    summary.write(args.summary_json)
    print(f"job {run.job_id}: {summary.job_status} (MLflow run {summary.run_id})", flush=True)
    return summary.exit_code


def _destinations(run: Any) -> str:
    """Where a submitted job records its run and checkpoints."""
    if run.run_name:
        checkpoints = f"checkpoints in {run.storage_path.rstrip('/')}/{run.run_name}"
    else:
        checkpoints = f"checkpoints under {run.storage_path.rstrip('/')}/ (in a folder named for the run)"
    tracked = f"MLflow {run.tracking_uri}, experiment {run.experiment}" if run.tracking_uri else "MLflow off"
    return f"{tracked}; {checkpoints}"


# What Ray's job supervisor writes into a job's log besides the job's own output.
_JOB_SUPERVISOR_LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+\t(DEBUG|INFO) |Running entrypoint for job ")


def _show_job_log(chunks: Iterable[str]) -> None:
    """The job's log as it comes; without --verbose, less the supervisor's own lines."""
    pending = ""
    for chunk in chunks:
        if logs.verbose():
            print(chunk, end="", flush=True)
            continue
        *lines, pending = (pending + chunk).split("\n")
        shown = [line for line in lines if not _JOB_SUPERVISOR_LINE.match(line)]
        if shown:
            print("\n".join(shown), flush=True)
    if pending and not _JOB_SUPERVISOR_LINE.match(pending):
        print(pending, flush=True)


def _up(args: argparse.Namespace) -> int:
    try:
        cluster, started = api.up(args.num_cpus, args.port, args.dashboard_port, args.warm)
    except RuntimeError as exc:
        print(f"raylane: up: {exc}", file=sys.stderr)
        return 1
    from raylane.onray import warmpool

    took = f" in {time.time() - cluster.started_unix:.1f} s" if started else ""
    pool = warmpool.describe(cluster, started, asked=args.warm != 0)  # what it has, not what it was asked
    print(
        f"{'started' if started else 'already running:'} a local Ray head at {cluster.address}{took} "
        f"({cluster.num_cpus} CPUs, {pool}, dashboard {cluster.dashboard_url}, log {cluster.log}).\n"
        f"raylane train/tune/bench/submit on this machine join it; `raylane down` stops it.",
        flush=True,
    )
    return 0


def _down(args: argparse.Namespace) -> int:
    cluster = api.down()
    print(f"stopped the local Ray head at {cluster.address}" if cluster else "no local Ray head is running")
    return 0


# The commands that are one call of the Python API of the same name (raylane.api.train, ...) with
# these options, after CONFIG and --set: what the call returns is the command's exit code.
API_RUNS = {
    "train": ("address", "local", "register", "summary_json"),
    "tune": ("address", "register", "summary_json"),
    "autotune": ("address", "local", "budget_s", "out", "summary_json"),
}
COMMANDS = {
    "check": _check,
    "submit": _submit,
    "export": _export,
    "bench": _bench,
    "k8s": lambda args: tools.k8s(args, parser),
    "slurm": tools.slurm,
    "up": _up,
    "down": _down,
    "stacks": tools.stacks,
}


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if hasattr(args, "verbose"):  # the commands that start Ray, MLflow or torch
        logs.setup(args.verbose, args.command)
        output.install()  # before Ray is imported
    try:
        if args.command in API_RUNS:
            call = getattr(api, args.command)
            summary = call(args.config, args.overrides, **{k: getattr(args, k) for k in API_RUNS[args.command]})
            return 0 if getattr(summary, "already_finished", False) else summary.exit_code  # nothing left to do
        return COMMANDS[args.command](args)
    except ConfigError as exc:  # before anything started, or found once the cluster is known
        return _config_error(exc)
    except KeyboardInterrupt:  # a signal while a launch waits or winds down; its MLflow run is closed
        print("raylane: interrupted", file=sys.stderr, flush=True)
        return 130


def _config_error(exc: ConfigError) -> int:
    # Under torchrun every rank finds the same mistake: one line, from rank 0.
    if os.environ.get("RANK", "0") == "0":
        print(f"raylane: {exc}", file=sys.stderr, flush=True)
    elif os.environ.get("TORCHELASTIC_RUN_ID"):
        # torchrun stops the other ranks as soon as one exits: on a busy machine a rank that
        # finished first had rank 0 killed before it printed, and the user saw no reason at all.
        time.sleep(CONFIG_ERROR_GRACE_S)
    return 2


def run() -> None:
    """The `raylane` command: main(), then exit without the interpreter's teardown.

    Everything is written and closed when main() returns. What the interpreter would still do at
    exit (wait for other threads, atexit handlers) runs here; its teardown is skipped: after a
    Ray run, freeing torch's and Ray's modules took ~1.4 s on 2 cores, and under torchrun gloo's
    threads were seen to abort a finished rank there ("terminate called without an active
    exception", about 1 run in 15)."""
    code = main()
    cluster = sys.modules.get("raylane.onray.cluster")
    # After a join given up on, what is left waits on the ray.init that cannot be cancelled (Ray's
    # own atexit shutdown, a thread importing Ray Train): raylane's records are closed already.
    if cluster is None or not cluster.join_abandoned():
        for thread in threading.enumerate():
            if thread is not threading.main_thread() and not thread.daemon:
                thread.join()
        atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run()
