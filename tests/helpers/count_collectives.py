"""`torchrun ... tests/helpers/count_collectives.py OUT -- train CONFIG ...`: a real `raylane train`
whose optimizer steps (`Trainer.run_step`) run under a dispatch mode that counts every c10d
collective issued; each rank writes its counts per step to OUT.<rank>.json. Instrumentation
only: the training code runs unchanged."""

from __future__ import annotations

import json
import os
import sys
from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode

import raylane.loop.trainer
from raylane.cli import main


class CollectiveCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name.startswith("c10d."):
            self.counts[name.removeprefix("c10d.").split(".")[0]] += 1
        return func(*args, **(kwargs or {}))


def run(out: str, argv: list[str]) -> int:
    per_step: list[dict[str, int]] = []
    original = raylane.loop.trainer.Trainer.run_step

    def counted(self, micro_batches):
        with CollectiveCounter() as counter:
            loss = original(self, micro_batches)
        per_step.append(dict(counter.counts))
        return loss

    raylane.loop.trainer.Trainer.run_step = counted
    code = main(argv)
    with open(f"{out}.{os.environ.get('RANK', '0')}.json", "w") as f:
        json.dump(per_step, f)
    return code


if __name__ == "__main__":
    out, sep, *rest = sys.argv[1:]
    assert sep == "--"
    code = run(out, rest)
    # As `python -m raylane` does on torchrun ranks: no interpreter teardown, where gloo's threads
    # can abort the process after the run is done (see app/raylane/__main__.py).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
