"""B17: expert parallelism (issue 65) against FSDP and DDP alone, on a tiny mixture of experts on
2 torchrun ranks (gloo): the step time of each layout (from each run's summary, after its warm-up
steps), the parameter bytes each rank holds, experts and the rest, and the bytes each rank sends
to the other per step, by collective.

The model and data are examples/moe/make_moe.py's: a Qwen2-MoE of 2 layers, 8 experts each (top-2),
a small shared expert, hidden size 64, the experts 82% of the parameters; text of Python's help,
rows of SEQ_LEN tokens, BATCH rows a rank. The four layouts run interleaved, their order rotating
from one repeat to the next; the bytes come from one more run of each under a dispatch mode that
sees every collective (scripts/benchmarks/ep_traffic.py), not timed.

What a CPU can show: with 2 ranks on 2 cores over gloo, a step is mostly collectives and the
scheduler's noise; neither the memory ep saves nor the weight traffic it removes costs time here
as it does on GPUs at scale, so the timing is reported with its spread and no target. The bytes
are exact and are what carries to a larger machine."""

from __future__ import annotations

import importlib.util
import json
import statistics
from pathlib import Path
from typing import Any

from scripts.benchmarks.common import QUIET, REPO, TORCHRUN, stats

SEQ_LEN, BATCH = 128, 8
PROBE_STEPS = 4
SIDES = {
    "fsdp": ["strategy.name=fsdp", "strategy.ep=1"],
    "ddp": ["strategy.name=ddp", "strategy.ep=1"],
    "fsdp×ep2": ["strategy.name=fsdp", "strategy.ep=2"],
    "ddp×ep2": ["strategy.name=ddp", "strategy.ep=2"],
}
# What a rank holds of the experts (E) and of the rest (R), as fractions of the whole, at world 2:
# FSDP shards both in 2; DDP keeps both whole; ep 2 halves the experts (by expert), leaving the
# rest as the strategy holds it (and, under FSDP, the experts sharded over W/ep = 1 rank: as is).
HELD = {"fsdp": (0.5, 0.5), "ddp": (1.0, 1.0), "fsdp×ep2": (0.5, 0.5), "ddp×ep2": (0.5, 1.0)}


def _make_moe():
    spec = importlib.util.spec_from_file_location("make_moe", REPO / "examples" / "moe" / "make_moe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _sets(moe: Path, steps: int) -> list[str]:
    return [
        *QUIET,
        f"model.name_or_path={moe / 'model'}",
        f"data.train={moe / 'train'}",
        "data.format=json",
        "data.text_column=text",
        "model.task=causal-lm",
        f"model.seq_len={SEQ_LEN}",
        f"train.batch_size={BATCH}",
        f"train.max_steps={steps}",
        "train.max_epochs=1000",
        "optim.name=adamw",
        "optim.lr=0.003",
        "scaling.num_workers=2",
    ]


def b17(bench: Any) -> dict[str, Any]:
    steps = 12 if bench.quick else 40
    make = _make_moe()
    moe = make.make(bench.work / "b17")
    config = bench.work / "b17.yaml"
    config.write_text("pipeline: hf\n")
    sets = _sets(moe, steps)
    print(f"[bench] B17 expert parallelism, tiny Qwen2-MoE, 2 torchrun ranks: {steps} steps a run", flush=True)
    step_ms: dict[str, list[float]] = {side: [] for side in SIDES}
    loss: dict[str, list[float]] = {side: [] for side in SIDES}
    state: dict[str, int] = {}
    names = list(SIDES)
    for i in range(bench.repeats):
        for side in names[i % len(names) :] + names[: i % len(names)]:  # a different side leads each repeat
            s = bench.raylane(str(config), [*sets, *SIDES[side]], launcher="torchrun")["summary"]
            step_ms[side].append(1e3 * BATCH * 2 / s["samples_per_s"])
            loss[side].append(s["last_window"]["loss"])
            state[side] = s["memory"]["state_bytes_per_rank"]
            print(f"[bench]   {side} ({s['strategy']}): {step_ms[side][-1]:.1f} ms a step", flush=True)
    traffic = {side: _probe(bench, config, [*_sets(moe, PROBE_STEPS), *extra], side) for side, extra in SIDES.items()}
    whole = _whole_bytes(make, moe)
    median = {side: statistics.median(v) for side, v in step_ms.items()}
    return {
        "steps": steps,
        "seq_len": SEQ_LEN,
        "batch": BATCH,
        "model": whole,
        "step_ms": {side: stats(v) for side, v in step_ms.items()},
        # The spread between identical runs of each side: what a difference must exceed to be seen.
        "spread": {side: (max(v) - min(v)) / statistics.median(v) for side, v in step_ms.items()},
        "fsdp_ep2_over_fsdp": median["fsdp×ep2"] / median["fsdp"],
        "ddp_ep2_over_ddp": median["ddp×ep2"] / median["ddp"],
        # Each repeat's own ratio: its runs a few minutes apart, under the same load of the machine.
        "per_repeat": {
            f"{ep} ÷ {alone}": stats([a / b for a, b in zip(step_ms[ep], step_ms[alone], strict=True)])
            for ep, alone in (("fsdp×ep2", "fsdp"), ("ddp×ep2", "ddp"))
        },
        "last_loss": loss,
        "state_bytes_per_rank": state,
        "params_per_rank": {side: t["params"] for side, t in traffic.items()},
        "sent_per_step": {side: t["sent"] for side, t in traffic.items()},
        "expected_params_per_rank": {
            side: {"experts": whole["experts"] * e, "rest": whole["rest"] * r} for side, (e, r) in HELD.items()
        },
        "expected_sent_per_step": expected_traffic(whole, tokens=BATCH * SEQ_LEN, world=2, ep=2),
    }


def expected_traffic(model: dict[str, Any], *, tokens: int, world: int, ep: int) -> dict[str, float]:
    """What each rank sends a step because of the experts, from the sizes alone (fp32):
    - FSDP alone: every layer's experts all-gathered for the forward, again for the backward,
      and their gradients reduce-scattered: 3 (W-1)/W of the experts' bytes, whatever the tokens;
    - ep: each layer's (token, expert) rows to the ranks holding the experts and back, and the
      same for their gradients: 4 x (ep-1)/ep x tokens x top-k rows of the hidden size, with the
      routing even (the router's real choice moves it), whatever the number of experts."""
    row = model["hidden"] * 4
    return {
        "fsdp_experts": 3 * (world - 1) / world * model["experts"],
        "ep_all_to_all": 4 * (ep - 1) / ep * tokens * model["top_k"] * row * model["layers"],
    }


def _probe(bench: Any, config: Path, sets: list[str], side: str) -> dict[str, Any]:
    """One run under ep_traffic: each rank's parameter bytes, and its bytes sent per step by
    collective, the mean over the steps after the first (rank 0; the all-to-alls follow the
    routing, which moves from step to step)."""
    out = bench.work / f"b17-traffic-{side.replace('×', '-')}"
    argv = [*TORCHRUN, "-m", "scripts.benchmarks.ep_traffic", str(out), "--", "train", str(config)]
    bench.run([*argv, "--set", f"run.storage_path={bench.work / 'runs'}", *[x for s in sets for x in ("--set", s)]])
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    later = ranks[0]["steps"][1:] or ranks[0]["steps"]
    ops = sorted({op for step in later for op in step["sent"]})
    sent = {op: statistics.mean(step["sent"].get(op, 0) for step in later) for op in ops}
    return {"params": [r["params"] for r in ranks], "sent": {op: b for op, b in sent.items() if b}}


def _whole_bytes(make: Any, moe: Path) -> dict[str, Any]:
    """The whole model's parameter bytes, experts and the rest, and the shapes the traffic
    figures follow from."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(moe / "model")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return {
        **make.parameter_bytes(model),
        "experts_per_layer": cfg.num_experts,
        "top_k": cfg.num_experts_per_tok,
        "hidden": cfg.hidden_size,
        "layers": cfg.num_hidden_layers,
    }


def rows(r: dict[str, Any] | None) -> list[tuple[str, str, str, str, str]]:
    """The report's lines: step time of each ep layout against its strategy alone (no target:
    what 2 CPU ranks can show), the parameter and state bytes per rank against the expected ones,
    and the bytes sent a step."""
    if not r or "step_ms" not in r:
        return []
    out = [_timed(r, "fsdp×ep2", "fsdp", r["fsdp_ep2_over_fsdp"]), _timed(r, "ddp×ep2", "ddp", r["ddp_ep2_over_ddp"])]
    held, expected, kib = r["params_per_rank"], r["expected_params_per_rank"], 1 / 1024
    measured = "; ".join(
        f"{side} {held[side][0]['experts'] * kib:,.0f} + {held[side][0]['rest'] * kib:,.0f}" for side in SIDES
    )
    met = all(rank[k] == expected[side][k] for side in SIDES for rank in held[side] for k in ("experts", "rest"))
    out.append(
        (
            "B17",
            "parameter KiB per rank, experts + the rest (rank 0's; both ranks checked against the expected)",
            measured,
            "experts at ep2 ½ of DDP's; FSDP×ep2 = FSDP at world 2",
            _met(met),
        )
    )
    state, m = r["state_bytes_per_rank"], r["model"]
    share = m["experts"] / (m["experts"] + m["rest"])
    ddp, fsdp = state["ddp×ep2"] / state["ddp"], state["fsdp×ep2"] / state["fsdp"]
    out.append(
        (
            "B17",
            "parameters + gradients + AdamW state per rank (the run's summary): ddp×ep2 ÷ ddp; fsdp×ep2 ÷ fsdp",
            f"{ddp:.3f}; {fsdp:.3f}",
            f"1 − ½ × {share:.3f} (the experts' share) = {1 - share / 2:.3f}; 1",
            _met(abs(ddp - (1 - share / 2)) < 0.005 and abs(fsdp - 1) < 0.005),
        )
    )
    mb = 1 / 1e6
    sent = "; ".join(
        f"{side} {sum(r['sent_per_step'][side].values()) * mb:.2f}"
        + (f" (all-to-all {r['sent_per_step'][side]['alltoall_base_'] * mb:.2f})" if "×ep" in side else "")
        for side in SIDES
    )
    exp = r["expected_sent_per_step"]
    out.append(
        (
            "B17",
            "MB each rank sends a step, all collectives (the experts' part from the sizes: FSDP's all-gathers and "
            f"reduce-scatter {exp['fsdp_experts'] * mb:.2f}, ep's all-to-alls at even routing {exp['ep_all_to_all'] * mb:.2f})",
            sent,
            "— (reported)",
            "—",
        )
    )
    return out


def _timed(r: dict[str, Any], ep: str, alone: str, ratio: float) -> tuple[str, str, str, str, str]:
    ms, spread = r["step_ms"], max(r["spread"][ep], r["spread"][alone])
    noise = (
        f"identical runs spread ±{spread / 2:.0%}" + ("" if abs(ratio - 1) > spread else ": within noise")
        if ms[ep]["n"] > 1
        else "one run a side: no spread"
    )
    return (
        "B17",
        f"step time, {ep} ÷ {alone}, tiny Qwen2-MoE (8 experts, top-2), 2 torchrun ranks",
        f"{ratio:.2f} ({_m(ms[ep])} vs {_m(ms[alone])} ms; {noise}"
        + (f"; each repeat's ratio {_m(r['per_repeat'][f'{ep} ÷ {alone}'], '.2f')}" if "per_repeat" in r else "")
        + ")",
        "— (reported)",
        "—",
    )


def _met(ok: bool) -> str:
    return "yes" if ok else "**no**"


def _m(s: dict[str, Any], fmt: str = ".1f") -> str:
    return f"{s['median']:{fmt}} [{s['min']:{fmt}}–{s['max']:{fmt}}]"
