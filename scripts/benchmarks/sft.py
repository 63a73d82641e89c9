"""B16: packed conversations against the same conversations one a row (issue 64): the packing
efficiency (the tokens that are data, of every row's tokens) and the real tokens a second, each
run's whole-run figure from its summary (after the warm-up steps), in one process.

The data and model are examples/sft/make_chat.py's: a tiny chat Llama and conversations of mixed
lengths about Python's help texts (answers of a few words to a few hundred tokens), the loss on
the answers, rows of 512 tokens. Both sides train the same steps of the same micro-batch of rows:
the packed side puts more conversations in each row, so its real tokens a second are what
packing buys; the one-a-row side is TRL's and the Trainer's padded batch."""

from __future__ import annotations

import importlib.util
import statistics
from typing import Any

from scripts.benchmarks.common import QUIET, REPO, stats

SEQ_LEN, BATCH = 512, 4


def _make(out):
    spec = importlib.util.spec_from_file_location("make_chat", REPO / "examples" / "sft" / "make_chat.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.make(out)


def b16(bench: Any) -> dict[str, Any]:
    steps = 12 if bench.quick else 40
    print(f"[bench] B16 packed conversations against one a row: {steps} steps each, in one process", flush=True)
    chat = _make(bench.work / "b16")
    config = bench.work / "b16.yaml"
    config.write_text("pipeline: hf\n")
    sets = [
        *QUIET,
        f"model.name_or_path={chat / 'model'}",
        f"data.train={chat / 'train.jsonl'}",
        "data.format=json",
        "data.style=messages",
        f"model.seq_len={SEQ_LEN}",
        f"train.batch_size={BATCH}",
        f"train.max_steps={steps}",
        "train.max_epochs=1000",
        "optim.name=adamw",
        "optim.lr=0.002",
    ]
    sides = {"packed": "data.packing=true", "one_a_row": "data.packing=false"}
    efficiency: dict[str, list[float]] = {name: [] for name in sides}
    real: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(bench.repeats):
        for name, packing in sides.items():
            s = bench.raylane(str(config), [*sets, packing], launcher="local")["summary"]
            efficiency[name].append(s["packing_efficiency"])
            real[name].append(s["real_tokens_per_s"])
            print(
                f"[bench]   {name}: {s['packing_efficiency']:.1%} of the tokens data, "
                f"{s['real_tokens_per_s']:,.0f} real tokens/s",
                flush=True,
            )
    median = {name: statistics.median(v) for name, v in real.items()}
    return {
        "steps": steps,
        "seq_len": SEQ_LEN,
        "batch": BATCH,
        "packing_efficiency": {name: stats(v) for name, v in efficiency.items()},
        "real_tokens_per_s": {name: stats(v) for name, v in real.items()},
        "real_tokens_packed_over_one_a_row": median["packed"] / median["one_a_row"],
        # The spread between identical runs of each side: what a difference must exceed to be seen.
        "real_tokens_spread": {name: (max(v) - min(v)) / statistics.median(v) for name, v in real.items()},
    }


def rows(r: dict[str, Any] | None) -> list[tuple[str, str, str, str, str]]:
    """The report's lines: the packed side's efficiency (target ≥ 0.95) and its real tokens a
    second against one a row's."""
    if not r or "packing_efficiency" not in r:
        return []
    eff = {name: v["median"] for name, v in r["packing_efficiency"].items()}
    tokens = {name: v["median"] for name, v in r["real_tokens_per_s"].items()}
    spread = max(r["real_tokens_spread"].values())
    return [
        (
            "B16",
            f"packing efficiency, conversations of mixed lengths in rows of {r['seq_len']} (one a row)",
            f"{eff['packed']:.1%} ({eff['one_a_row']:.1%})",
            "≥ 95%",
            "yes" if eff["packed"] >= 0.95 else "**no**",
        ),
        (
            "B16",
            "real tokens/s, packed ÷ one a row (one process)",
            f"{r['real_tokens_packed_over_one_a_row']:.2f} ({tokens['packed']:,.0f} vs {tokens['one_a_row']:,.0f}; "
            f"spread {spread:.0%})",
            "> 1",
            "yes" if r["real_tokens_packed_over_one_a_row"] > 1 + spread else "**no**",
        ),
    ]
