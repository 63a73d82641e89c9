"""A user's pipeline (tests copy it into their tmp dir) for the optimizer and the schedule: a tiny
language model with an embedding tied to its output layer, a linear block with a bias and a
LayerNorm, so that raylane's parameter groups have something in each. `model.optimizer` and
`model.scheduler` pick the pipeline's own (`own`), none (`raylane`: raylane's from cfg.optim), or a
broken one (`raises`, `wrong`: a return its contract does not allow)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import raylane

VOCAB, WIDTH = 16, 8
OWN_LR = 0.05


class Model(raylane.Section):
    optimizer: str = "raylane"
    scheduler: str = "raylane"


class Config(raylane.BaseConfig):
    model: Model = Model()

    def eval_metrics(self):
        return ("loss",)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, WIDTH)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(WIDTH, WIDTH)])
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied: one tensor, two names

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(torch.tanh(self.blocks[0](self.emb(x)))))


def tokens(rows: int, length: int = 6, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, VOCAB, (rows, length + 1), generator=g)
    return TensorDataset(seq[:, :-1], seq[:, 1:])


def lm_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.reshape(-1, VOCAB), target.reshape(-1))


def eval_sums(output: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"loss": lm_loss(output, target) * len(target)}


def own_optimizer(model, cfg):
    # Groups over what it is given (the wrapped model): the norm without momentum.
    norm = [p for name, p in model.named_parameters() if "norm" in name]
    rest = [p for name, p in model.named_parameters() if "norm" not in name]
    return torch.optim.SGD([{"params": rest}, {"params": norm, "momentum": 0.0}], lr=OWN_LR, momentum=0.5)


def raising_optimizer(model, cfg):
    raise ValueError("no optimizer today")


def wrong_optimizer(model, cfg):
    return {"lr": 0.1}


def own_scheduler(optimizer, cfg, total_steps):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)


def wrong_scheduler(optimizer, cfg, total_steps):
    return torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)


OPTIMIZERS = {"own": own_optimizer, "raises": raising_optimizer, "wrong": wrong_optimizer}
SCHEDULERS = {"own": own_scheduler, "wrong": wrong_scheduler}


def build(cfg: Config) -> raylane.Pipeline:
    return raylane.Pipeline(
        model=Net(),
        train_set=tokens(64),
        eval_set=tokens(16, seed=1),
        loss_fn=lm_loss,
        eval_sums=eval_sums,
        optimizer=OPTIMIZERS.get(cfg.model.optimizer),
        scheduler=SCHEDULERS.get(cfg.model.scheduler),
    )
