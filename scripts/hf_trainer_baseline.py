"""B11's other side: transformers' own Trainer fine-tuning a causal LM, launched with torchrun,
on the data raylane's `hf` pipeline trains on: the JSON Lines files of DATA/train, each document
ended by EOS and packed into rows of --seq-len tokens by the same function (raylane.hf.data.pack),
labels = input_ids. AdamW at a constant learning rate, no weight decay, the gradient norm
clipped at 1, no evaluation, no checkpoint, as the raylane side is configured. Rank 0 writes
--json: the steps and the seconds from the start of training to the end of the last step.

    torchrun --nproc_per_node 2 scripts/hf_trainer_baseline.py --model DIR --data DIR \\
        --seq-len 128 --batch-size 8 --steps 50 --json out.json [--bf16]"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def _packed(data: Path, model: str, seq_len: int):
    import datasets

    from raylane.hf.data import pack

    texts = [
        json.loads(line)["text"]
        for f in sorted((data / "train").glob("*.jsonl"))
        for line in f.read_text().splitlines()
    ]
    ids = pack(texts, model, seq_len)["input_ids"]
    return datasets.Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True, type=Path)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--json", required=True)
    args = p.parse_args()

    import tempfile

    import torch
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    cuda = torch.cuda.is_available()

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.began = self.last = 0.0
            self.steps = 0

        def on_train_begin(self, *a, **k):
            self.began = time.time()

        def on_step_end(self, *a, **k):
            self.last, self.steps = time.time(), self.steps + 1

    clock = Clock()
    with tempfile.TemporaryDirectory() as out:
        training = TrainingArguments(
            output_dir=out,
            per_device_train_batch_size=args.batch_size,
            max_steps=args.steps,
            learning_rate=args.lr,
            lr_scheduler_type="constant",
            warmup_steps=0,
            weight_decay=0.0,
            optim="adamw_torch",
            max_grad_norm=1.0,
            save_strategy="no",
            eval_strategy="no",
            logging_strategy="no",
            report_to="none",
            disable_tqdm=True,
            dataloader_drop_last=True,
            dataloader_num_workers=0,
            seed=0,
            bf16=args.bf16,
            use_cpu=not cuda,
            ddp_backend=None if cuda else "gloo",
        )
        model = AutoModelForCausalLM.from_pretrained(args.model)
        trainer = Trainer(
            model=model, args=training, train_dataset=_packed(args.data, args.model, args.seq_len), callbacks=[clock]
        )
        trainer.train()
        if trainer.is_world_process_zero():
            Path(args.json).write_text(json.dumps({"steps": clock.steps, "train_s": clock.last - clock.began}))


if __name__ == "__main__":
    main()
