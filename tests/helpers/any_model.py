"""A user's pipeline file in the three forms of a step (copied into a test's folder as pipe.py;
model.mode picks the form): a dict batch and a model that returns its own loss, as a Hugging
Face model does (`own`); a two-input model with a `step` of its own and a metric (`step`); and
the mistakes each form's first step names in one line (`bad keys`, `no loss`, `bad step`).

model.kill_mark (a file path): rank 1, from its model's 6th training step on, once a checkpoint
of the run is committed, kills its own process with SIGKILL, once (the mark stays behind: the
restarted worker trains on)."""

from __future__ import annotations

import os
import signal

import torch
from torch import nn

import raylane


class Model(raylane.Section):
    mode: str = "own"
    kill_mark: str = ""


class Config(raylane.BaseConfig):
    model: Model = Model()

    def eval_metrics(self):
        return ("loss",)


class Words(torch.utils.data.Dataset):
    """Token ids whose class is the sum of the first two, mod 3, as a tokenizer's dict would hold
    them; `extra`: a key the model's forward does not take."""

    def __init__(self, n: int, seed: int, extra: bool = False) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, 16, (n, 6), generator=g)
        self.extra = extra

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        item = {
            "input_ids": self.ids[i],
            "attention_mask": torch.ones(6),
            "labels": (self.ids[i, 0] + self.ids[i, 1]) % 3,
        }
        if self.extra:
            item["token_type_ids"] = torch.zeros(6, dtype=torch.long)
        return item


class Classifier(nn.Module):
    def __init__(self, own_loss: bool = True, kill: tuple[str, str] | None = None) -> None:
        super().__init__()
        self.kill = kill
        self.emb = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 3)
        self.own_loss = own_loss
        self.steps = 0

    def forward(self, input_ids, attention_mask=None, labels=None):
        if self.training:
            self.steps += 1
            if self.kill:
                _maybe_die(self.steps, *self.kill)
        h = self.emb(input_ids) * attention_mask[..., None]
        logits = self.head(h.mean(1))
        out = {"logits": logits}
        if labels is not None and self.own_loss:
            out["loss"] = nn.functional.cross_entropy(logits, labels)
        return out


def _maybe_die(step: int, mark: str, run_dir: str) -> None:
    if step < 6 or os.path.exists(mark) or torch.distributed.get_rank() != 1:
        return
    from raylane.loop import checkpoint

    if checkpoint.committed(run_dir):
        open(mark, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 4), nn.Linear(2, 4)
        self.out = nn.Linear(4, 1)

    def forward(self, a, b):
        return self.out(torch.tanh(self.a(a) + self.b(b)))


def pairs(n: int, seed: int) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(n, 3, generator=g), torch.randn(n, 2, generator=g)
    return torch.utils.data.TensorDataset(a, b, a.sum(1, keepdim=True) - b[:, :1])


def my_step(model, batch):
    a, b, y = batch
    error = model(a, b) - y
    return (error**2).mean(), {"my_metric": error.abs().mean()}


def bad_step(model, batch):
    a, b, y = batch
    return {"loss": ((model(a, b) - y) ** 2).mean()}


def build(cfg):
    mode = cfg.model.mode
    if mode in ("step", "bad step"):
        train = pairs(64, 0)
        return raylane.Pipeline(
            model=TwoInputs(),
            train_set=train,
            eval_set=pairs(32, 1),
            step=my_step if mode == "step" else bad_step,
            example_input=train[:2][:2],
        )
    kill = (cfg.model.kill_mark, f"{cfg.run.storage_path}/{cfg.run.name}") if cfg.model.kill_mark else None
    return raylane.Pipeline(
        model=Classifier(own_loss=mode != "no loss", kill=kill),
        train_set=Words(64, 0, mode == "bad keys"),
        eval_set=Words(24, 1),
    )
