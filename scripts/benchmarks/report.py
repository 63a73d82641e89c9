"""The markdown table and PNG charts of `raylane bench` (see scripts.benchmarks.harness), from results.json alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

HAND = "hand-written torchrun DDP"
PLAIN_RAY = "hand-written loop on plain Ray Train"


def _m(s: dict[str, Any], scale: float = 1.0, fmt: str = "{:.2f}") -> str:
    return f"{fmt.format(s['median'] * scale)} [{fmt.format(s['min'] * scale)}–{fmt.format(s['max'] * scale)}]"


def rows(results: dict[str, Any]) -> list[tuple[str, str, str, str, str]]:
    """(benchmark, what, measured, target, met) for every figure that has a target."""
    out = [
        *_b1_rows(results.get("B1", {})),
        *_b2_rows(results.get("B2", {})),
        *_b2b_rows(results.get("B2b")),
        *_b2w_rows(results.get("B2w")),
    ]
    if "B3" in results:
        e = results["B3"]["efficiency"]
        out.append(
            (
                "B3",
                "scaling 1 → 2 ranks: throughput(2) ÷ 2·throughput(1)",
                _m(e, fmt="{:.3f}"),
                "≥ 0.9",
                _met(e["median"] >= 0.9),
            )
        )
    if "B4" in results:
        r = results["B4"]
        out.append(
            (
                "B4",
                "Tune sweep: ideal ÷ wall time",
                _m(r["ideal_over_wall"], fmt="{:.3f}")
                + f" (plain Ray Tune: {r['plain_ideal_over_wall']['median']:.3f})",
                "≥ 0.95",
                _met(r["ideal_over_wall"]["median"] >= 0.95),
            )
        )
        out.append(
            (
                "B4",
                "Tune sweep wall time: raylane ÷ plain Ray Tune",
                f"{r['raylane_over_plain']:.3f} "
                f"({_m(r['wall_s']['raylane tune'], fmt='{:.1f}')} s vs {_m(r['wall_s']['plain Ray Tune'], fmt='{:.1f}')} s)",
                "—",
                "—",
            )
        )
    for mode, r in results.get("B5", {}).items():
        if mode != "off":
            out.append(
                (
                    "B5",
                    f"MLflow {mode}: logging cost per step",
                    f"{r['attributed_cost_pct']:.2f}% (end to end {r['end_to_end_cost_pct']:+.1f}%)",
                    "≤ 1%",
                    _met(r["attributed_cost_pct"] <= 1),
                )
            )
    if "B6" in results:
        r = results["B6"]["fsdp_over_ddp"]
        out.append(
            (
                "B6",
                "FSDP ÷ DDP state bytes per rank (gpt-tiny)",
                _m(r, fmt="{:.3f}"),
                "≤ 0.55",
                _met(r["median"] <= 0.55),
            )
        )
    if "B7" in results:
        r = results["B7"]
        stall = r["stall_ms_per_checkpoint"]
        lost = r.get("end_to_end_ms_per_checkpoint")
        out.append(
            (
                "B7",
                "checkpoint stall, async ÷ sync",
                f"{r['async_over_sync']:.3f} ({_m(stall['async'], fmt='{:.0f}')} "
                f"ms vs {_m(stall['sync'], fmt='{:.0f}')} ms per save)"
                + (
                    f"; train time lost per save, end to end: async {_m(lost['async'], fmt='{:.0f}')} ms, "
                    f"sync {_m(lost['sync'], fmt='{:.0f}')} ms"
                    if lost
                    else ""
                ),
                # A sync stall at or under zero is noise, not a save: nothing to judge.
                "≤ 0.10",
                _met(stall["sync"]["median"] > 0 and r["async_over_sync"] <= 0.10),
            )
        )
    if "B8" in results:
        r = results["B8"]
        out.append(
            (
                "B8",
                "GPU: gpt2-124m bf16 + compile",
                r.get("skipped") or r.get("summary", "see results.json"),
                "≥ 45% MFU",
                "—" if "skipped" in r else _met(r.get("mfu", 0) >= 0.45),
            )
        )
    out += _b9_rows(results.get("B9"))
    if "B10" in results:
        r = results["B10"]
        out.append(
            (
                "B10",
                "autotune of gpt-tiny, 2 ranks: (wall − one cold start) ÷ the candidates' profiling time",
                f"{_m(r['search_over_profiling'])} over {r['median_of']:.0f} candidates (wall "
                f"{_m(r['wall_s'], fmt='{:.1f}')} s, cold start {_m(r['startup_s'], fmt='{:.1f}')} s)",
                "≤ 1.3",
                _met(r["search_over_profiling"]["median"] <= 1.3 and r["median_of"] >= 12),
            )
        )
        out.append(
            (
                "B10",
                "plain run of the winner ÷ the throughput autotune measured for it",
                _m(r["plain_over_autotune"], fmt="{:.3f}"),
                "0.90–1.10",
                _met(0.9 <= r["plain_over_autotune"]["median"] <= 1.1),
            )
        )
    if "B1b" in results:
        r = results["B1b"]
        out.append(
            (
                "B1b",
                "dict batch through model(**batch), own loss ÷ (input, target) pair + loss_fn, 2 ranks "
                "(CPU ms per step)",
                f"{r['cpu_step_ms_dict_over_pair']:.3f} ({_m(r['cpu_step_ms']['dict'], fmt='{:.2f}')}"
                f" vs {_m(r['cpu_step_ms']['pair'], fmt='{:.2f}')} ms; pair runs spread "
                f"{r['cpu_step_ms_pair_spread']:.0%})",
                "within noise",
                _met(abs(r["cpu_step_ms_dict_over_pair"] - 1) <= max(r["cpu_step_ms_pair_spread"], 0.02)),
            )
        )
    out += _hf_rows(results.get("B11"), results.get("B12"))
    from scripts.benchmarks.driverscale import rows as b15_rows
    from scripts.benchmarks.faults import rows as b14_rows
    from scripts.benchmarks.steptimes import rows as b13_rows

    out += b13_rows(results.get("B13"))
    out += b14_rows(results.get("B14"))
    out += b15_rows(results.get("B15"))
    from scripts.benchmarks.sft import rows as b16_rows

    out += b16_rows(results.get("B16"))
    from scripts.benchmarks.moe import rows as b17_rows

    out += b17_rows(results.get("B17"))
    for name, error in results.get("failed", {}).items():
        first = error.strip().splitlines()[0] if error.strip() else "unknown error"
        out.append(
            (name, "did not finish (results.json has the error)", first[:200].replace("|", "/"), "—", "**failed**")
        )
    return out


def _hf_rows(b11: dict[str, Any] | None, b12: dict[str, Any] | None) -> list[tuple[str, str, str, str, str]]:
    out = []
    if b11 and "step_ms" in b11:
        ms = b11["step_ms"]
        noise = max(b11["step_trainer_spread"], b11["step_raylane_spread"], 0.02)
        ratio = b11["step_raylane_over_trainer"]
        out.append(
            (
                "B11",
                f"raylane's hf pipeline ÷ the HF Trainer, 2 torchrun ranks, {b11['precision']}: time per step",
                f"{ratio:.3f} ({_m(ms['raylane'], fmt='{:.1f}')} vs {_m(ms['hf_trainer'], fmt='{:.1f}')} ms; "
                f"spread between identical runs {noise:.0%})",
                "≤ 1.05 or within noise",
                _met(ratio <= 1.05 + noise),
            )
        )
        peaks = b11["peak_raylane_over_trainer"]
        out.append(
            (
                "B11",
                f"raylane ÷ the HF Trainer: peak memory per rank ({b11['memory']})",
                " / ".join(f"rank {r}: {v:.2f}" for r, v in enumerate(peaks)),
                "≤ 1.10",
                _met(max(peaks) <= 1.10),
            )
        )
    if b12 and "load_bytes_per_rank" in b12:
        loads = b12["load_bytes_per_rank"]
        mb = 1 << 20
        out.append(
            (
                "B12",
                f"peak host memory per rank while loading {b12['weights_bytes'] / mb:.0f} MB of weights: "
                "raylane FSDP (rank 0 reads, broadcast) ÷ from_pretrained on every rank",
                " / ".join(
                    f"rank {r}: {a / mb:.0f} vs {b / mb:.0f} MB"
                    for r, (a, b) in enumerate(zip(loads["raylane"], loads["from_pretrained"], strict=True))
                ),
                "rank ≥ 1 ≤ 0.75",
                _met(b12["load_raylane_over_from_pretrained"][1] <= 0.75),
            )
        )
    return out


def _b1_rows(b1: dict[str, Any]) -> list[tuple[str, str, str, str, str]]:
    out = []
    for pipeline, r in b1.items():
        hand = r["step_ms"][HAND]
        for side in ("raylane on Ray", "raylane under torchrun"):
            ratio = r["ratio_vs_hand_written"][side]
            cpu = r.get("cpu_ratio_vs_hand_written", {}).get(side)
            out.append(
                (
                    "B1",
                    f"{pipeline}: step time, {side} ÷ hand-written",
                    f"{ratio:.3f} ({_m(r['step_ms'][side])} ms vs {_m(hand)} ms)"
                    + (f"; rank 0 CPU time per step {cpu:.3f}" if cpu is not None else ""),
                    "≤ 1.02",
                    _met(ratio <= 1.02),
                )
            )
        if PLAIN_RAY in r["step_ms"]:
            plain = r["step_ms"][PLAIN_RAY]
            out.append(
                (
                    "B1",
                    f"{pipeline}: step time, {PLAIN_RAY} ÷ hand-written",
                    f"{r['ratio_vs_hand_written'][PLAIN_RAY]:.3f} ({_m(plain)} ms)",
                    "—",
                    "—",
                )
            )
            ours = r["step_ms"]["raylane on Ray"]["median"] / plain["median"]
            out.append(("B1", f"{pipeline}: step time, raylane on Ray ÷ {PLAIN_RAY}", f"{ours:.3f}", "—", "—"))
    return out


def _b2_rows(b2: dict[str, Any]) -> list[tuple[str, str, str, str, str]]:
    out: list[tuple[str, str, str, str, str]] = []
    if HAND not in b2:
        return out
    torchrun = b2[HAND]["launch_to_first_step_s"]["median"]
    for side, r in b2.items():
        if side in (HAND, PLAIN_RAY):
            continue
        first, last = r["launch_to_first_step_s"], r["last_step_to_exit_s"]
        out.append(
            (
                "B2",
                f"{side}: launch to first step (s)",
                _m(first),
                f"≤ torchrun + 5 = {torchrun + 5:.1f}",
                _met(first["median"] <= torchrun + 5),
            )
        )
        out.append(("B2", f"{side}: end of training to exit (s)", _m(last), "≤ 2", _met(last["median"] <= 2)))
    for side in (HAND, PLAIN_RAY):
        if side in b2:
            out.append(
                (
                    "B2",
                    f"{side}: launch to first step / end to exit (s)",
                    f"{_m(b2[side]['launch_to_first_step_s'])} / {_m(b2[side]['last_step_to_exit_s'])}",
                    "—",
                    "—",
                )
            )
    return out


TORCHRUN_SIDE = "raylane under torchrun"


def _b2b_rows(r: dict[str, Any] | None) -> list[tuple[str, str, str, str, str]]:
    if not r:
        return []
    phases = r["phases_s"]
    torchrun = phases[TORCHRUN_SIDE]["first_step"]["median"]
    out = []
    for side, p in phases.items():
        first = p["first_step"]
        ray_side = side.startswith("raylane, Ray")
        out.append(
            (
                "B2b",
                f"launch to first step, {side} (s)",
                _m(first),
                f"≤ torchrun + 5 = {torchrun + 5:.1f}" if ray_side else "—",
                _met(first["median"] <= torchrun + 5) if ray_side else "—",
            )
        )
    return out


def _b2w_rows(r: dict[str, Any] | None) -> list[tuple[str, str, str, str, str]]:
    """B2w: first step and 5-epoch run per arm; the warm head's target is torchrun's first step + 2 s."""
    if not r:
        return []
    from scripts.benchmarks.warm_start import ARMS

    torchrun = r["first_step"][ARMS[1]]["first_step_s"]["median"]
    out = []
    for arm, p in r["first_step"].items():
        warm = arm.startswith("warm head")
        target = f"≤ torchrun + 2 = {torchrun + 2:.1f}" if warm else "—"
        out.append(
            (
                "B2w",
                f"command start to first step, {arm} (s)",
                _m(p["first_step_s"]),
                target,
                _met(p["first_step_s"]["median"] <= torchrun + 2) if warm else "—",
            )
        )
    for arm, p in r["five_epochs"].items():
        out.append(("B2w", f"{r['epochs']}-epoch run end to end, {arm} (s)", _m(p["exit_s"]), "—", "—"))
    return out


def startup_table(r: dict[str, Any]) -> str:
    """B2b as a table: each start-up phase (rows) on each side (columns), seconds since launch."""
    from raylane.loop.observe.startup import PHASES

    phases, sides = r["phases_s"], list(r["phases_s"])
    n = next(iter(next(iter(phases.values())).values()))["n"]
    lines = [
        f"Seconds from launch to the end of each phase, median [min–max] of {n} runs "
        f"(`regression`, {r['workers']} ranks, {r['steps']} steps; warm head: {r['warm_head']}).",
        "",
        "| phase | " + " | ".join(sides) + " |",
        "|---|" + "---|" * len(sides),
    ]
    for phase in PHASES:
        if any(phase in phases[s] for s in sides):
            cells = [_m(phases[s][phase], fmt="{:.1f}") if phase in phases[s] else "—" for s in sides]
            lines.append(f"| {phase} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _two_runs(r: dict[str, Any]) -> str:
    """The same slope between the short and the long run, start-up differences included."""
    if "two_run_epoch_ms" not in r:
        return ""
    two, ratio = r["two_run_epoch_ms"], r["two_run_ratio_vs_hand_written"]
    return (
        f"; between a {r['epochs'][0]}- and a {r['epochs'][1]}-epoch run: on Ray {ratio['raylane on Ray']:.3f} "
        f"({_m(two['raylane on Ray'], fmt='{:.0f}')} vs {_m(two[HAND], fmt='{:.0f}')} ms)"
    )


def _b9_rows(r: dict[str, Any] | None) -> list[tuple[str, str, str, str, str]]:
    if not r:
        return []
    epoch, stall = r["epoch_ms"], r["stall_ms_per_checkpoint"]
    ray, torchrun = stall["raylane on Ray"]["median"], stall["raylane under torchrun"]["median"]
    return [
        (
            "B9",
            "epoch-end cost, `regression` defaults: per-epoch slope on Ray ÷ hand-written (snapshot each epoch)"
            + (
                f", epochs {r['epochs'][0] + 1}-{r['epochs'][1]} of a {r['epochs'][1]}-epoch run"
                if "epochs" in r
                else ""
            ),
            f"{r['ratio_vs_hand_written']['raylane on Ray']:.3f} ({_m(epoch['raylane on Ray'], fmt='{:.0f}')} ms vs "
            f"{_m(epoch[HAND], fmt='{:.0f}')} ms); under torchrun "
            f"{r['ratio_vs_hand_written']['raylane under torchrun']:.3f} ({_m(epoch['raylane under torchrun'], fmt='{:.0f}')} ms)"
            + _two_runs(r),
            "≤ 1.10",
            _met(r["ratio_vs_hand_written"]["raylane on Ray"] <= 1.10),
        ),
        (
            "B9",
            "stall per checkpoint: on Ray vs under torchrun (ms)",
            f"{_m(stall['raylane on Ray'], fmt='{:.0f}')} vs {_m(stall['raylane under torchrun'], fmt='{:.0f}')}",
            "≤ torchrun + 20",
            _met(ray <= torchrun + 20),
        ),
    ]


def _met(ok: bool) -> str:
    return "yes" if ok else "**no**"


def write(report: dict[str, Any], out: Path) -> str:
    """Write results.md and the charts; returns the markdown."""
    m = report["machine"]
    lines = [
        f"Machine: {m['cpus']} CPUs, {m['memory_gib']} GiB, {m['cuda'] or 'no GPU'}; {m['platform']}; "
        f"Python {m['python']}, torch {m['torch']}. Command: `{report['command']}` "
        f"({report['repeats']} repeats, median [min–max], {report['wall_s'] / 60:.0f} min).",
        "",
        "| | what | measured | target | met |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {b} | {what} | {measured} | {target} | {met} |"
        for b, what, measured, target, met in rows(report["results"])
    ]
    text = "\n".join(lines) + "\n"
    if report["results"].get("B2b"):
        text += "\nB2b, launch to first step phase by phase (raylane.loop.observe.startup.PHASES):\n\n"
        text += startup_table(report["results"]["B2b"])
    (out / "results.md").write_text(text)
    _charts(report["results"], out)
    return text


def _charts(results: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if results.get("B1"):
        pipelines = list(results["B1"])
        sides = list(dict.fromkeys(side for r in results["B1"].values() for side in r["step_ms"]))
        fig, ax = plt.subplots(figsize=(7, 3.5))
        width = 0.8 / len(sides)
        for i, side in enumerate(sides):
            ratios = [results["B1"][p]["ratio_vs_hand_written"].get(side, 0.0) for p in pipelines]
            ax.bar([j + i * width for j in range(len(pipelines))], ratios, width, label=side)
        ax.axhline(1.02, color="k", ls="--", lw=0.8, label="target 1.02")
        ax.set_xticks([j + width for j in range(len(pipelines))], pipelines)
        ax.set_ylabel("step time ÷ hand-written DDP")
        ax.set_title("B1: per-step cost (slope between two run lengths)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "b1_step_cost.png", dpi=100)
        plt.close(fig)
    if results.get("B2"):
        sides = list(results["B2"])
        fig, ax = plt.subplots(figsize=(7, 3.5))
        for i, key in enumerate(("launch_to_first_step_s", "last_step_to_exit_s")):
            ax.barh(
                [j + i * 0.4 for j in range(len(sides))],
                [results["B2"][s][key]["median"] for s in sides],
                0.4,
                label=key.replace("_s", "").replace("_", " "),
            )
        ax.set_yticks([j + 0.2 for j in range(len(sides))], sides, fontsize=7)
        ax.set_xlabel("seconds")
        ax.set_title("B2: start-up and shut-down")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "b2_startup.png", dpi=100)
        plt.close(fig)
