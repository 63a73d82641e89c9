"""What the driver records of a run's insides at its end: the per-rank step-time table (CSV, with a
plot) from rank 0's result, and the profiled ranks' traces and top-operations tables (and on a
GPU, memory snapshots) from the run's folder (`<storage_path>/<run.name>/profiles/`, where every
profiled rank wrote, whichever node it ran on: raylane.loop.observe.profiling), logged to MLflow as
artifacts under `steps/` and `profiles/`; and every rank's stacks a hang left in `stacks/`
(raylane.loop.observe.hangs), under `stacks/`."""

from __future__ import annotations

import csv
import io
import logging
from collections.abc import Iterable
from typing import Any

from raylane.config import BaseConfig

log = logging.getLogger("raylane.tracking")
PROFILES = "profiles"
STACKS = "stacks"  # raylane.loop.observe.hangs.STACKS: the tracking layer reads the folder, not the module
OPEN_HINT = "open a trace in https://ui.perfetto.dev or chrome://tracing"
MEMORY_HINT = "drag one onto https://pytorch.org/memory_viz"
NAMED_TABLES = 4  # the end line names this many tables (256 ranks profiled would be 256 names)


def profiles_folder(cfg: BaseConfig) -> tuple[Any, str]:
    """(filesystem, path) of the run's profiles folder."""
    from raylane.loop.checkpoint.storage import filesystem_for

    fs, root = filesystem_for(cfg.run.storage_path)
    return fs, f"{root.rstrip('/')}/{cfg.run.name}/{PROFILES}"


def profile_traces(cfg: BaseConfig, suffix: str = ".json.gz") -> list[str]:
    """The traces in the run's profiles folder (every profiled rank's), or its files ending in
    `suffix`, by name; [] without a profile."""
    if not cfg.profile.enabled:
        return []
    import pyarrow.fs as pafs

    fs, folder = profiles_folder(cfg)
    try:
        infos = fs.get_file_info(pafs.FileSelector(folder, allow_not_found=True))
    except OSError as exc:
        log.warning("could not list the profiles in %s: %s", folder, exc)
        return []
    shown = folder if isinstance(fs, pafs.LocalFileSystem) else f"{fs.type_name}://{folder}"
    names = sorted(i.base_name for i in infos if i.base_name.endswith(suffix))
    return [f"{shown}/{name}" for name in names]


def memory_snapshots(cfg: BaseConfig) -> list[str]:
    """The CUDA memory snapshots in the run's profiles folder (raylane.loop.observe.profiling.MemorySnapshots)."""
    wanted = cfg.profile.memory_snapshot_step is not None or cfg.profile.memory_snapshot_on_oom
    return profile_traces(cfg, ".pickle") if wanted else []


def profile_line(traces: list[str], snapshots: list[str] | None = None, stragglers: Iterable[int] = ()) -> str:
    """The terminal's one line on a profile: where the traces, tables and memory snapshots are,
    how to open them. Every profiled rank's table is named (the first NAMED_TABLES of them, then
    how many more), a named straggler's marked: rank 0's alone sent a reader to the fast rank."""
    if traces:
        folder = traces[0].rsplit("/", 1)[0]
        slow = {f"rank{r}" for r in stragglers}
        tables = []
        for trace in traces[:NAMED_TABLES]:
            name = trace.rsplit("/", 1)[1].replace("trace-", "top-ops-").replace(".json.gz", ".md")
            tables.append(name + (" (the straggler's)" if name.split("-")[2] in slow else ""))
        if len(traces) > NAMED_TABLES:
            tables.append(f"{len(traces) - NAMED_TABLES} more")
        n = len(traces)
        also = ", .txt, .csv" if n == 1 else "; each also .txt, .csv"
        line = f"{n} trace{'s' if n > 1 else ''} in {folder} ({OPEN_HINT}; top operations: {', '.join(tables)}{also})"
    else:
        line = "none written (the run ended before the window: see profile.wait)"
    if snapshots:
        names = ", ".join(s.rsplit("/", 1)[1] for s in snapshots)
        where = "" if traces else f" in {snapshots[0].rsplit('/', 1)[0]}"
        line += f"; memory snapshots{where}: {names} ({MEMORY_HINT})"
    return line


def log_profiles(client: Any, run_id: str, cfg: BaseConfig, name: str = PROFILES) -> None:
    """The profiles folder (or the run folder's `name` one), as the run's artifacts under `name`/."""
    import pyarrow.fs as pafs

    from raylane.loop.checkpoint.storage import local_copy

    fs, folder = profiles_folder(cfg)
    folder = f"{folder.rsplit('/', 1)[0]}/{name}"
    if fs.get_file_info(folder).type == pafs.FileType.NotFound:
        return
    location = folder if isinstance(fs, pafs.LocalFileSystem) else f"{fs.type_name}://{folder}"
    with local_copy(location) as path:
        client.log_artifacts(run_id, path, name)


def log_stacks(client: Any, run_id: str, cfg: BaseConfig) -> None:
    """Every rank's stacks written on a hang (raylane.loop.observe.hangs: `stacks/` in the run's folder,
    with NCCL's flight-recorder dumps), as the run's artifacts under stacks/."""
    log_profiles(client, run_id, cfg, STACKS)


def rank_table_csv(rows: list[dict[str, Any]]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(rows[0]))
    writer.writeheader()
    for row in rows:
        writer.writerow({k: f"{v:.6f}" if isinstance(v, float) else v for k, v in row.items()})
    return out.getvalue()


def log_rank_times(client: Any, run_id: str, rows: list[dict[str, Any]], stragglers: list[dict[str, Any]]) -> None:
    """Each rank's step times over the run: steps/ranks.csv, and steps/ranks.png (busy step time
    per rank, split into data wait and the rest; a named straggler in red)."""
    if not rows:
        return
    client.log_text(run_id, rank_table_csv(rows), "steps/ranks.csv")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    named = {s["rank"] for s in stragglers}
    ranks = [r["rank"] for r in rows]
    data = [min(r["data_s"], r["busy_s"]) for r in rows]
    rest = [r["busy_s"] - d for r, d in zip(rows, data, strict=True)]
    fig, ax = plt.subplots(figsize=(max(6, min(len(rows) * 0.15, 24)), 4))
    ax.bar(ranks, data, color="tab:orange", label="data wait")
    colours = ["tab:red" if r in named else "tab:blue" for r in ranks]
    ax.bar(ranks, rest, bottom=data, color=colours, label="forward, backward, optimizer")
    ax.set_xlabel("rank")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # ranks, not 0.25 steps
    ax.set_ylabel("busy seconds per step (mean)")
    ax.set_title("step time per rank" + (f"; straggler: rank {', '.join(map(str, sorted(named)))}" if named else ""))
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=2, frameon=False)  # below: clear of the bars
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    client.log_figure(run_id, fig, "steps/ranks.png")
    plt.close(fig)
