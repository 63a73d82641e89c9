"""B11 and B12, Hugging Face fine-tuning (needs raylane[hf]).

- B11: raylane's `hf` pipeline against transformers' own Trainer, both launched with torchrun on
  2 ranks, on the same model (a LLaMA-architecture model made here, random weights), the same
  packed data, batch, precision, optimizer and number of steps: the time per step (the slope
  between a short and a long run, so that start-up cancels) and the peak memory per rank (the
  resident set on CPU, CUDA's peak allocation on a GPU), each as raylane ÷ Trainer.
- B12: the peak host memory per rank while loading pretrained weights of a model of a few
  hundred MB, raylane under FSDP on 2 ranks (rank 0 reads, the other receives its shard) against
  every rank calling `from_pretrained` (scripts.benchmarks.hfload)."""

from __future__ import annotations

import importlib.util
import json
import statistics
from pathlib import Path
from typing import Any

from scripts.benchmarks.common import QUIET, REPO, TORCHRUN, stats

PEAK = str(REPO / "scripts" / "peak_memory.py")
TRAINER = str(REPO / "scripts" / "hf_trainer_baseline.py")
# B11's model: big enough that a step is mostly arithmetic on 2 CPU cores, small enough to repeat.
B11_MODEL = {"layers": 4, "hidden": 256, "heads": 4, "kv_heads": 4, "seq_len": 128}
B11_BATCH, B11_LR = 8, 1e-3
# B12's model: about 360 MB of float32 weights (12 layers of 768).
B12_MODEL = {"layers": 12, "hidden": 768, "heads": 12, "kv_heads": 12, "seq_len": 256, "vocab_size": 2048}


def _make(out: Path, **shape: Any) -> Path:
    """examples/hf-finetune/make_model.py's model, data and tokenizer (nothing downloaded)."""
    spec = importlib.util.spec_from_file_location("make_model", REPO / "examples" / "hf-finetune" / "make_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.make(out, **shape)


def _peaks(folder: Path) -> list[float]:
    """Each rank's peak, CUDA's where a GPU was used, else the resident set (bytes)."""
    ranks = [json.loads(p.read_text()) for p in sorted(folder.glob("rank*.json"))]
    return [r.get("cuda_peak_bytes", r["rss_peak_bytes"]) for r in ranks]


def b11(bench: Any) -> dict[str, Any]:
    import torch

    short, long = (10, 30) if bench.quick else (20, 100)
    bf16 = torch.cuda.is_available()
    print(f"[bench] B11 raylane's hf pipeline against the HF Trainer: {short} and {long} steps", flush=True)
    tiny = _make(bench.work / "b11", **B11_MODEL)
    config = bench.work / "b11.yaml"
    config.write_text("pipeline: hf\n")

    def raylane(steps: int, peaks: Path) -> dict[str, Any]:
        sets = [
            *QUIET,
            f"model.name_or_path={tiny / 'model'}",
            f"data.train={tiny / 'train'}",
            f"model.seq_len={B11_MODEL['seq_len']}",
            f"train.batch_size={B11_BATCH}",
            f"train.max_steps={steps}",
            "train.max_epochs=1000000",
            "optim.name=adamw",
            f"optim.lr={B11_LR}",
            "optim.schedule=constant",
            "optim.warmup_steps=0",
            "optim.weight_decay=0",
            "train.grad_clip_norm=1.0",
            "strategy.name=ddp",
            f"train.precision={'bf16' if bf16 else 'fp32'}",
            "scaling.num_workers=2",
            "mlflow.enabled=false",
        ]
        summary = bench.work / f"b11-raylane-{bench._n + 1}.json"
        argv = [
            *TORCHRUN,
            PEAK,
            str(peaks),
            "-m",
            "raylane",
            "train",
            str(config),
            *[x for s in sets for x in ("--set", s)],
            "--set",
            f"run.storage_path={bench.work / 'runs'}",
            "--set",
            f"run.name=b11-{bench._n + 1}",
            "--summary-json",
            str(summary),
        ]
        bench.run(argv)
        s = json.loads(summary.read_text())
        return {"train_s": s["train_s"], "steps": s["steps"]}

    def trainer(steps: int, peaks: Path) -> dict[str, Any]:
        out = bench.work / f"b11-trainer-{bench._n + 1}.json"
        bench.run(
            [
                *TORCHRUN,
                PEAK,
                str(peaks),
                TRAINER,
                "--model",
                str(tiny / "model"),
                "--data",
                str(tiny),
                "--seq-len",
                str(B11_MODEL["seq_len"]),
                "--batch-size",
                str(B11_BATCH),
                "--steps",
                str(steps),
                "--lr",
                str(B11_LR),
                "--json",
                str(out),
                *(["--bf16"] if bf16 else []),
            ]
        )
        return json.loads(out.read_text())

    sides = {"raylane": raylane, "hf_trainer": trainer}
    step_ms: dict[str, list[float]] = {name: [] for name in sides}
    peaks: dict[str, list[list[float]]] = {name: [] for name in sides}
    for i in range(bench.repeats):
        for name, side in sides.items():
            a = side(short, bench.work / f"peak-{name}-{i}-short")
            folder = bench.work / f"peak-{name}-{i}-long"
            b = side(long, folder)
            step_ms[name].append((b["train_s"] - a["train_s"]) / (b["steps"] - a["steps"]) * 1e3)
            peaks[name].append(_peaks(folder))
            print(f"[bench]   {name}: {step_ms[name][-1]:.1f} ms/step", flush=True)
    per_rank = {name: [statistics.median(run[r] for run in runs) for r in range(2)] for name, runs in peaks.items()}
    return {
        "steps": [short, long],
        "precision": "bf16" if bf16 else "fp32",
        "model": B11_MODEL,
        "batch": B11_BATCH,
        "step_ms": {name: stats(v) for name, v in step_ms.items()},
        "step_raylane_over_trainer": statistics.median(step_ms["raylane"]) / statistics.median(step_ms["hf_trainer"]),
        # The spread between identical runs: what a difference must exceed to be seen.
        "step_trainer_spread": _spread(step_ms["hf_trainer"]),
        "step_raylane_spread": _spread(step_ms["raylane"]),
        "peak_bytes_per_rank": per_rank,
        "memory": "cuda" if bf16 else "rss",
        "peak_raylane_over_trainer": [per_rank["raylane"][r] / per_rank["hf_trainer"][r] for r in range(2)],
    }


def _spread(values: list[float]) -> float:
    return (max(values) - min(values)) / statistics.median(values)


def b12(bench: Any) -> dict[str, Any]:
    print("[bench] B12 peak host memory per rank while loading pretrained weights", flush=True)
    model = _make(bench.work / "b12", **B12_MODEL) / "model"
    size = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    loads: dict[str, list[list[dict[str, int]]]] = {"raylane": [], "from_pretrained": []}
    for i in range(bench.repeats):
        for mode in loads:
            out = bench.work / f"b12-{mode}-{i}"
            bench.run([*TORCHRUN, "-m", "scripts.benchmarks.hfload", mode, str(model), str(out)])
            loads[mode].append([json.loads((out / f"rank{r}.json").read_text()) for r in range(2)])
    per_rank = {
        mode: [statistics.median(run[r]["load_bytes"] for run in runs) for r in range(2)]
        for mode, runs in loads.items()
    }
    return {
        "weights_bytes": size,
        "load_bytes_per_rank": per_rank,
        "peak_bytes_per_rank": {
            mode: [statistics.median(run[r]["peak_bytes"] for run in runs) for r in range(2)]
            for mode, runs in loads.items()
        },
        "load_raylane_over_from_pretrained": [
            per_rank["raylane"][r] / per_rank["from_pretrained"][r] for r in range(2)
        ],
    }
