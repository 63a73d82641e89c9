"""The bad-input table: every command's mistakes, each with its exit code and the one line it
prints, found before Ray, torch's workers or MLflow start.

Most cases run in this process through `raylane.cli.main`, with what would start work replaced
by a failure (so a case that got that far fails the test rather than starting Ray); a few run as
`python -m raylane` and under torchrun, end to end, within a few seconds."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass, field

import pytest

from raylane import api, cli, prechecks
from raylane.config import ConfigError, check_metric, load_config
from tests.conftest import RAYLANE, REPO, TORCHRUN, cli_env

OWN = "pipeline: ./pipe.py\nmodel: {}\n"
SWEEP = "sweep: {{name: s, base: digits, space: {space}{extra}}}\n"
# A pipeline with a path key of its own, declared as such (raylane.InputPath).
OWN_WITH_PATH = """import raylane
class Data(raylane.Section):
    path: raylane.InputPath
class Config(raylane.BaseConfig):
    model: dict = {}
    data: Data
def build(cfg):
    pass
"""
# An S3 endpoint where nothing listens.
UNREACHABLE_S3 = {
    "AWS_ENDPOINT_URL": "http://127.0.0.1:9",
    "AWS_ACCESS_KEY_ID": "x",
    "AWS_SECRET_ACCESS_KEY": "y",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


@dataclass
class Case:
    argv: list[str]
    line: str  # a part of the one line printed on stderr; {cwd}: the case's working directory (a path
    # given relative is shown as the absolute path it was resolved to, raylane.paths)
    files: dict[str, str] = field(default_factory=dict)  # created in the working directory first
    subprocess: bool = False  # also end to end, as `python -m raylane`
    code: int = 2
    env: dict[str, str] = field(default_factory=dict)  # set for the case (relative paths: in its directory)


def sweep(space: str = "{optim.lr: {grid: [0.1]}}", extra: str = "") -> dict[str, str]:
    return {"s.yaml": SWEEP.format(space=space, extra=extra)}


def ran(name: str = "r", *sets: str) -> dict[str, str]:
    """runs/<name> as a digits run (with `sets`) left it: a committed checkpoint's manifest."""
    config = load_config("digits", [f"run.name={name}", *sets]).model_dump(mode="json")
    return {
        f"runs/{name}/checkpoint_000000003/manifest.json": json.dumps({"train_state": {"step": 3, "config": config}})
    }


def committed(folder: str, files: dict[str, str], sizes: dict[str, int] | None = None) -> dict[str, str]:
    """A checkpoint folder of a digits run holding `files`, whose manifest records `sizes` (by
    default, each file's own)."""
    config = load_config("digits", []).model_dump(mode="json")
    sizes = sizes or {name: len(text) for name, text in files.items()}
    manifest = {
        "train_state": {"step": 3, "config": config},
        "files": {name: {"size": size, "sha256": "0" * 64} for name, size in sizes.items()},
    }
    return {
        **{f"{folder}/{name}": text for name, text in files.items()},
        f"{folder}/manifest.json": json.dumps(manifest),
    }


def swept(*sets: str) -> dict[str, str]:
    """runs/digits-asha as the shipped sweep (with `sets`) left it: its record."""
    from raylane.config.sweep import load_sweep
    from raylane.sweeps.record import SWEEP_RECORD, settings

    record = {"status": "FINISHED", "settings": settings(*load_sweep("digits-sweep", sets))}
    return {f"runs/digits-asha/{SWEEP_RECORD}": json.dumps(record)}


CASES: dict[str, Case] = {
    # check: the config alone
    "batch size 0": Case(["check", "digits", "--set", "train.batch_size=0"], "train.batch_size = 0: Input should be"),
    "misspelled key": Case(
        ["check", "digits", "--set", "train.max_epoch=3"],
        "train.max_epoch = 3: unknown key (did you mean train.max_epochs?)",
    ),
    "misspelled model key": Case(
        ["check", "digits", "--set", "model.hiden_size=8"], "unknown key (did you mean model.hidden_size?)"
    ),
    "misspelled section": Case(["check", "digits", "--set", "trian.max_epochs=3"], "unknown key (did you mean train?)"),
    "misspelled shipped config": Case(
        ["check", "digitz"],
        "config = 'digitz': no such file, and no shipped config of that name "
        "(did you mean digits?); shipped: digits, digits-sweep",
    ),
    "missing file": Case(["check", "missing.yaml"], "config file 'missing.yaml': no such file"),
    "unknown optimizer": Case(["check", "digits", "--set", "optim.name=lion"], "optim.name = 'lion'"),
    "lr not a number": Case(["check", "digits", "--set", "optim.lr=abc"], "optim.lr = 'abc'"),
    "lr infinite": Case(["check", "digits", "--set", "optim.lr=.inf"], "optim.lr = inf"),
    "no workers": Case(["check", "digits", "--set", "scaling.num_workers=0"], "scaling.num_workers = 0"),
    "run name escapes": Case(["check", "digits", "--set", "run.name=../x"], "run.name = '../x'"),
    "through a scalar": Case(["check", "digits", "--set", "train.seed.x=1"], "train.seed is 0, not a section"),
    "override without =": Case(["check", "digits", "--set", "noequals"], "'noequals': expected dotted.key=value"),
    "invalid YAML": Case(
        ["check", "bad.yaml"], "config file 'bad.yaml': invalid YAML at line 2", files={"bad.yaml": "a: [\n"}
    ),
    "YAML list": Case(["check", "list.yaml"], "top level must be a mapping", files={"list.yaml": "- 1\n"}),
    # a key given twice: YAML keeps the last silently, the author meant one of them
    "a key twice in a config file": Case(
        ["train", "c.yaml"],
        "config file 'c.yaml': key 'optim.lr' is given twice in one mapping (lines 3 and 5): YAML keeps only the last",
        files={"c.yaml": "pipeline: digits\noptim:\n  lr: 0.1\n  name: sgd\n  lr: 0.01\n"},
    ),
    "a key twice in a sweep file": Case(
        ["tune", "s.yaml"],
        "config file 's.yaml': key 'sweep.num_samples' is given twice in one mapping (lines 4 and 5): YAML keeps "
        "only the last",
        files={
            "s.yaml": "sweep:\n  name: s\n  base: digits\n  num_samples: 2\n  num_samples: 4\n"
            "  space: {optim.lr: {grid: [0.1]}}\n"
        },
    ),
    "a key twice in a sweep's base config": Case(
        ["tune", "s.yaml"],
        "config file '{cwd}/b.yaml': key 'train' is given twice in one mapping (lines 2 and 3): YAML keeps only the last",
        files={
            "s.yaml": "sweep: {name: s, base: b.yaml, space: {optim.lr: {grid: [0.1]}}}\n",
            "b.yaml": "pipeline: digits\ntrain: {max_epochs: 1}\ntrain: {max_epochs: 2}\n",
        },
    ),
    "a key twice in an autotune section": Case(
        ["autotune", "c.yaml"],
        "config file 'c.yaml': key 'autotune.batch_sizes' is given twice in one mapping (lines 3 and 4): YAML "
        "keeps only the last",
        files={"c.yaml": "pipeline: digits\nautotune:\n  batch_sizes: [8]\n  batch_sizes: [16]\n"},
    ),
    "fp16 with fsdp": Case(
        ["check", "digits", "--set", "train.precision=fp16", "--set", "strategy.name=fsdp"],
        "train.precision = 'fp16' with strategy.name = 'fsdp'",
    ),
    "bf16 hook on CPU": Case(
        ["check", "digits", "--set", "strategy.comm_hook=bf16"],
        "strategy.comm_hook = 'bf16' needs scaling.use_gpu: true",
    ),
    # tensor parallelism: layouts that cannot work, or are not built yet (raylane.layout_checks.check_layout)
    "tp does not divide the workers": Case(
        ["train", "digits", "--set", "scaling.num_workers=4", "--set", "strategy.tp=3"],
        "strategy.tp = 3: does not divide scaling.num_workers = 4",
        subprocess=True,
    ),
    "tp does not divide one process": Case(
        ["train", "gpt-tiny", "--local", "--set", "strategy.tp=2"], "strategy.tp = 2: does not divide the one process"
    ),
    "tp with ddp replicas": Case(
        ["check", "gpt-tiny", "--set", "scaling.num_workers=4", "--set", "strategy.tp=2"],
        "strategy.tp = 2 with strategy.name = 'ddp' on 4 ranks: torch's DDP does not take tensor-parallel weights",
    ),
    "tp on a pipeline without a plan": Case(
        ["check", "digits", "--set", "scaling.num_workers=2", "--set", "strategy.tp=2"],
        "strategy.tp = 2: the digits pipeline gives no tp_plan",
    ),
    "tp not dividing the heads": Case(
        ["check", "gpt-tiny", "--set", "strategy.tp=2", "--set", "model.n_head=1"],
        "strategy.tp = 2: does not divide model.n_head = 1",
    ),
    "sequence parallel on an odd sequence": Case(
        ["check", "gpt-tiny", "--set", "strategy.tp=2", "--set", "strategy.sequence_parallel=true"]
        + ["--set", "model.block_size=63"],
        "strategy.tp = 2: does not divide model.block_size = 63",
    ),
    "sequence parallel without tp": Case(
        ["check", "gpt-tiny", "--set", "strategy.sequence_parallel=true"],
        "strategy.sequence_parallel = True needs strategy.tp > 1",
    ),
    "tp with auto": Case(
        ["check", "gpt-tiny", "--set", "strategy.tp=2", "--set", "strategy.name=auto"],
        "strategy.name = 'auto' with strategy.tp = 2: the memory estimate chooses tp only with strategy.tp: auto",
    ),
    "loss parallel without tp": Case(
        ["check", "gpt-tiny", "--set", "strategy.loss_parallel=true"],
        "strategy.loss_parallel = True needs strategy.tp > 1",
    ),
    "context parallel on CPU": Case(
        ["train", "gpt-tiny", "--set", "strategy.cp=2"],
        "strategy.cp = 2: context parallelism needs CUDA's SDPA kernels (ring attention), which a CPU run does not "
        "have; use strategy.cp: 1",
    ),
    "tp auto with ddp": Case(
        ["check", "gpt-tiny", "--set", "strategy.tp=auto"],
        "strategy.name = 'ddp' with strategy.tp = 'auto': replicas of a tensor-parallel model by DDP are not built",
    ),
    "tp elastic": Case(
        ["check", "gpt-tiny", "--set", "scaling.num_workers=2,4", "--set", "strategy.tp=2"],
        "scaling.num_workers = [2, 4] with strategy.tp = 2: elastic runs keep no tensor-parallel layout yet",
    ),
    "tp with fp16": Case(
        ["check", "gpt-tiny", "--set", "strategy.tp=2", "--set", "train.precision=fp16"],
        "train.precision = 'fp16' with strategy.tp = 2",
    ),
    # pipeline parallelism (raylane.layout_checks.check_layout, the config's validators, gpt's)
    "pp x tp does not divide the workers": Case(
        ["train", "gpt-tiny", "--set", "scaling.num_workers=6", "--set", "strategy.pp=2", "--set", "strategy.tp=2"]
        + ["--set", "strategy.name=fsdp", "--set", "model.tie_embeddings=false"],
        "strategy.pp = 2 x strategy.tp = 2: 4 ranks do not divide scaling.num_workers = 6",
        subprocess=True,
    ),
    "pp in one process": Case(
        ["train", "gpt-tiny", "--local", "--set", "strategy.pp=2", "--set", "model.tie_embeddings=false"],
        "strategy.pp = 2: 2 ranks do not divide the one process of --local",
    ),
    "pp with ddp replicas": Case(
        ["check", "gpt-tiny", "--set", "scaling.num_workers=4", "--set", "strategy.pp=2"]
        + ["--set", "model.tie_embeddings=false"],
        "strategy.pp = 2 with strategy.name = 'ddp' on 4 ranks: the 2 data-parallel replicas of each stage are FSDP2's",
    ),
    "pp over more stages than blocks": Case(
        ["check", "gpt-tiny", "--set", "strategy.pp=2", "--set", "strategy.pp_schedule=Interleaved1F1B"]
        + ["--set", "model.tie_embeddings=false"],
        "strategy.pp = 2: 4 pipeline stages for model.n_layer = 2 blocks",
    ),
    "pp with tied embeddings": Case(
        ["check", "gpt-tiny", "--set", "strategy.pp=2"],
        "model.tie_embeddings = true with strategy.pp = 2: the embedding (first stage) and the head (last stage)",
    ),
    "pp schedule of one stage given two": Case(
        ["check", "gpt-tiny", "--set", "strategy.pp=2", "--set", "strategy.pp_stages_per_rank=2"],
        "strategy.pp_stages_per_rank = 2 with strategy.pp_schedule = '1F1B': that schedule runs one stage per rank",
    ),
    "pp schedule of two stages given one": Case(
        ["check", "gpt-tiny", "--set", "strategy.pp=2", "--set", "strategy.pp_schedule=ZBVZeroBubble"]
        + ["--set", "strategy.pp_stages_per_rank=1"],
        "strategy.pp_stages_per_rank = 1 with strategy.pp_schedule = 'ZBVZeroBubble': that schedule runs exactly 2",
    ),
    "pp micro-batches not dividing the batch": Case(
        ["check", "gpt-tiny", "--set", "strategy.pp=2", "--set", "strategy.pp_microbatches=3"],
        "strategy.pp_microbatches = 3: does not divide train.batch_size = 16",
    ),
    "pp on a pipeline without stages": Case(
        ["check", "digits", "--set", "scaling.num_workers=2", "--set", "strategy.pp=2"],
        "strategy.pp = 2: the digits pipeline gives no pp_stages",
    ),
    "dp_replicate with ddp": Case(
        ["check", "gpt-tiny", "--set", "strategy.dp_replicate=2"],
        "strategy.dp_replicate = 2 with strategy.name = 'ddp': replicas of a sharded model are FSDP2's",
    ),
    "tp autotuned": Case(
        ["autotune", "digits", "--set", "strategy.tp=2"],
        "strategy.tp = 2: autotune does not search tensor-parallel layouts yet",
    ),
    "tp swept": Case(
        ["tune", "s.yaml"],
        "sweep.space.strategy.tp: sweeps of tensor-parallel runs are not built yet",
        files=sweep("{strategy.tp: {grid: [1, 2]}}"),
    ),
    "keep 0": Case(["check", "digits", "--set", "checkpoint.keep=0"], "checkpoint.keep = 0"),
    "best metric misspelled": Case(
        ["check", "digits", "--set", "checkpoint.keep_best=2", "--set", "checkpoint.best_metric=acuracy"],
        "checkpoint.best_metric = 'acuracy': not a metric the digits pipeline reports "
        "(did you mean accuracy?); it reports: loss, accuracy",
    ),
    "misspelled pipeline": Case(
        ["check", "c.yaml"],
        "pipeline = 'digts': unknown pipeline: did you mean 'digits'?",
        files={"c.yaml": "pipeline: digts\n"},
    ),
    "pipeline file missing": Case(["check", "c.yaml"], "pipeline = './pipe.py': no such file", files={"c.yaml": OWN}),
    "storage path through a file": Case(
        ["check", "digits", "--set", "run.storage_path=afile/runs"],
        "run.storage_path = '{cwd}/afile/runs': ",
        files={"afile": ""},
    ),
    "tabular data missing": Case(
        ["check", "tabular", "--set", "data.train=none.parquet"],
        "data.train = '{cwd}/none.parquet': no parquet files there",
    ),
    # train: the config, and what the run will write
    "train a misspelled name": Case(["train", "digitz"], "(did you mean digits?)", subprocess=True),
    "train a sweep file": Case(
        ["train", "digits-sweep"],
        "config file 'digits-sweep': is a sweep file (it has a `sweep:` section): "
        "run it with `raylane tune digits-sweep`",
    ),
    "train with a sweep key": Case(
        ["train", "digits", "--set", "sweep.metric=loss"], "sweep = {'metric': 'loss'}: unknown key"
    ),
    "summary into a missing folder": Case(
        ["train", "digits", "--summary-json", "out/s.json"],
        "--summary-json = 'out/s.json': folder 'out' does not exist",
        subprocess=True,
    ),
    "summary onto a folder": Case(["train", "digits", "--summary-json", "."], "--summary-json = '.': is a directory"),
    "storage path is a file": Case(
        ["train", "digits", "--set", "run.storage_path=afile"],
        "run.storage_path = '{cwd}/afile': ",
        files={"afile": ""},
    ),
    "local, misspelled key": Case(
        ["train", "digits", "--local", "--set", "train.max_epoch=2"], "did you mean train.max_epochs?"
    ),
    "regression batch 0": Case(["train", "regression", "--set", "train.batch_size=0"], "train.batch_size = 0"),
    "own pipeline without build": Case(
        ["train", "c.yaml"],
        "defines no build(cfg) function",
        files={"c.yaml": OWN, "pipe.py": "import raylane\nclass Config(raylane.BaseConfig):\n    model: dict = {}\n"},
    ),
    "resume with another model": Case(
        ["train", "digits", "--set", "run.name=r", "--set", "model.hidden_size=64"],
        "model.hidden_size = 64: run 'r' has a checkpoint saved with model.hidden_size = 128 (",
        files=ran(),
        subprocess=True,
    ),
    "resume with dropout": Case(
        ["train", "digits", "--local", "--set", "run.name=r", "--set", "model.dropout=0.1"],
        "model.dropout = 0.1: run 'r' has a checkpoint saved with model.dropout = 0.0",
        files=ran(),
    ),
    "resume another pipeline": Case(
        ["train", "regression", "--set", "run.name=r"], "pipeline = 'regression': ", files=ran()
    ),
    "resume with another optimizer": Case(
        ["train", "digits", "--set", "run.name=r", "--set", "optim.name=sgd"],
        "optim.name = 'sgd': run 'r' has a checkpoint saved with optim.name = 'adam' (",
        files=ran(),
    ),
    "resume adding momentum": Case(
        ["train", "digits", "--set", "run.name=r", "--set", "optim.name=sgd", "--set", "optim.momentum=0.9"],
        "optim.momentum = 0.9: ",
        files=ran("r", "optim.name=sgd", "optim.momentum=0"),
    ),
    "resume adding a schedule": Case(
        ["train", "digits", "--set", "run.name=r", "--set", "optim.schedule=cosine"],
        "keep optim.schedule=constant to resume it, or start a fresh run with --set run.name=r-2",
        files=ran(),
    ),
    "check a resume": Case(
        ["check", "digits", "--set", "run.name=r", "--set", "model.num_layers=3"],
        "model.num_layers = 3: run 'r'",
        files=ran(),
    ),
    "global batch the workers cannot split": Case(
        ["train", "digits", "--set", "train.global_batch=7", "--set", "scaling.num_workers=2"],
        "train.global_batch = 7: not a multiple of train.batch_size = 32 x scaling.num_workers = 2",
    ),
    # paths: proven by writing a probe (permission bits say yes to root, and on virtual filesystems)
    "storage on a virtual filesystem": Case(
        ["train", "digits", "--set", "run.storage_path=/proc/raylane-runs"], "run.storage_path = '/proc/raylane-runs': "
    ),
    "storage on an unreachable S3 endpoint": Case(
        ["train", "digits", "--set", "run.storage_path=s3://raylane/runs"],
        "run.storage_path = 's3://raylane/runs': cannot write a probe there "
        "(NETWORK_CONNECTION: Could not connect to server, endpoint "
        "http://127.0.0.1:9)",
        env=dict(UNREACHABLE_S3),
    ),
    "data on an unreachable S3 endpoint": Case(
        ["check", "tabular", "--set", "data.train=s3://raylane/t.parquet"],
        "data.train = 's3://raylane/t.parquet': cannot list it (NETWORK_CONNECTION: Could not connect to server",
        env=dict(UNREACHABLE_S3),
    ),
    "a shipped pipeline's data file missing": Case(
        ["train", "gpt-tiny", "--set", "data.text_path=none.txt"],
        "data.text_path = '{cwd}/none.txt': no such file or folder",
    ),
    "data of one's own pipeline missing": Case(
        ["check", "c.yaml"],
        "data.path = '{cwd}/data/x.csv': no such file",
        files={"c.yaml": OWN + "data: {path: data/x.csv}\n", "pipe.py": OWN_WITH_PATH},
    ),
    # init_from: someone else's checkpoint, checked before any MLflow run exists
    "init from a missing folder": Case(
        ["train", "digits", "--set", "checkpoint.init_from=nope"], "checkpoint.init_from = '{cwd}/nope': no such folder"
    ),
    "init from an uncommitted folder": Case(
        ["train", "digits", "--set", "checkpoint.init_from=ck"],
        "checkpoint.init_from = '{cwd}/ck': not a committed checkpoint",
        files={"ck/x": ""},
    ),
    "init from a truncated checkpoint": Case(
        ["train", "digits", "--set", "checkpoint.init_from=ck"],
        "checkpoint.init_from = '{cwd}/ck': not a valid checkpoint (state.pt has 5 bytes, the manifest says 10)",
        files=committed("ck", {"state.pt": "12345"}, sizes={"state.pt": 10}),
        subprocess=True,
    ),
    "init from a checkpoint missing a file": Case(
        ["train", "digits", "--local", "--set", "checkpoint.init_from=ck"],
        "(state.pt is missing)",
        files=committed("ck", {}, sizes={"state.pt": 10}),
    ),
    "init from a hand-edited manifest": Case(
        ["train", "digits", "--set", "checkpoint.init_from=ck"],
        "(state.pt has 5 bytes, the manifest says None)",
        files={"ck/state.pt": "12345", "ck/manifest.json": '{"files": {"state.pt": 5}}'},
    ),
    "init from another model": Case(
        ["train", "digits", "--set", "checkpoint.init_from=ck", "--set", "model.hidden_size=64"],
        "model.hidden_size = 64: checkpoint.init_from = '{cwd}/ck' was saved with model.hidden_size "
        "= 128, which this config cannot load",
        files=committed("ck", {}),
    ),
    # tune: the sweep and its base config
    "tune a pipeline config": Case(
        ["tune", "digits"],
        "sweep file 'digits': is a pipeline config (no `sweep:` section): train it with `raylane train digits`",
    ),
    "metric misspelled": Case(
        ["tune", "digits-sweep", "--set", "sweep.metric=acuracy"],
        "sweep.metric = 'acuracy': not a metric the digits pipeline reports (did you mean accuracy?)",
        subprocess=True,
    ),
    "metric of another pipeline": Case(
        ["tune", "s.yaml"], "sweep.metric = 'bits_per_byte': not a metric", files=sweep(extra=", metric: bits_per_byte")
    ),
    "sweep key misspelled": Case(
        ["tune", "digits-sweep", "--set", "sweep.num_sample=3"],
        "sweep.num_sample = 3: unknown key (did you mean sweep.num_samples?)",
    ),
    "no samples": Case(["tune", "digits-sweep", "--set", "sweep.num_samples=0"], "sweep.num_samples = 0"),
    "unknown algorithm": Case(["tune", "digits-sweep", "--set", "sweep.algorithm=bayes"], "sweep.algorithm = 'bayes'"),
    "base lr negative": Case(["tune", "digits-sweep", "--set", "optim.lr=-1"], "optim.lr = -1"),
    "space key misspelled": Case(
        ["tune", "s.yaml"],
        "optim.lrr: not a key of the digits config (did you mean optim.lr?)",
        files=sweep("{optim.lrr: {grid: [0.1]}}"),
    ),
    "space range reversed": Case(
        ["tune", "s.yaml"],
        "sweep.space.optim.lr.uniform = [1, 0]: needs low < high",
        files=sweep("{optim.lr: {uniform: [1, 0]}}"),
    ),
    "grid over a range": Case(
        ["tune", "s.yaml"],
        "sweep.algorithm = 'grid' needs listed values",
        files=sweep("{optim.lr: {uniform: [0.1, 1]}}", ", algorithm: grid"),
    ),
    "space value out of range": Case(
        ["tune", "s.yaml"],
        "sweep.space.train.batch_size: invalid config: train.batch_size = 0",
        files=sweep("{train.batch_size: {choice: [0, 8]}}"),
    ),
    "no sweep section": Case(
        ["tune", "t.yaml"], "sweep file 't.yaml': needs a `sweep:` section", files={"t.yaml": "train: {}\n"}
    ),
    "sweep summary into a missing folder": Case(
        ["tune", "digits-sweep", "--summary-json", "out/s.json"],
        "--summary-json = 'out/s.json': folder 'out' does not exist",
    ),
    "sweep rerun with another metric": Case(
        ["tune", "digits-sweep", "--set", "sweep.metric=loss"],
        "sweep.metric = 'loss': sweep 'digits-asha' already ran with sweep.metric = 'accuracy' (",
        files=swept(),
        subprocess=True,
    ),
    "sweep rerun with more samples": Case(
        ["tune", "digits-sweep", "--set", "sweep.num_samples=8"], "sweep.num_samples = 8: ", files=swept()
    ),
    "sweep rerun with another base": Case(
        ["tune", "digits-sweep", "--set", "train.max_epochs=2"],
        "train.max_epochs = 2: sweep 'digits-asha' already ran with train.max_epochs = 4",
        files=swept(),
    ),
    "sweep rerun with another space": Case(
        ["tune", "digits-sweep", "--set", "sweep.space={optim.lr: {grid: [0.1]}}"],
        "start a new sweep with --set sweep.name=digits-asha-2",
        files=swept(),
    ),
    # export: the checkpoint and where the weights go
    "export a missing checkpoint": Case(
        ["export", "runs/x/checkpoint_1", "--out", "m.safetensors"],
        "checkpoint = 'runs/x/checkpoint_1': no such folder",
    ),
    "export onto a folder": Case(
        ["export", "ck", "--out", "ck"], "--out = 'ck': is a directory; name the file", files={"ck/x": ""}
    ),
    "export through a file": Case(
        ["export", "ck", "--out", "afile/m.safetensors"],
        "--out = 'afile/m.safetensors': ",
        files={"ck/x": "", "afile": ""},
    ),
    "export not a checkpoint": Case(
        ["export", "ck", "--out", "new/m.safetensors"], "export: ck: not a valid checkpoint", files={"ck/x": ""}
    ),
    # submit: checked on this machine before anything is uploaded
    "submit a misspelled key": Case(
        ["submit", "digits", "--set", "train.max_epoch=2", "--address", "http://127.0.0.1:9"],
        "did you mean train.max_epochs?",
        subprocess=True,
    ),
    "submit a misspelled name": Case(["submit", "digitz", "--address", "http://127.0.0.1:9"], "(did you mean digits?)"),
    "submit a sweep file": Case(["submit", "digits-sweep", "--address", "http://127.0.0.1:9"], "is a sweep file"),
    "submit a misspelled best metric": Case(
        [
            "submit",
            "digits",
            "--set",
            "checkpoint.keep_best=1",
            "--set",
            "checkpoint.best_metric=f1",
            "--address",
            "http://127.0.0.1:9",
        ],
        "checkpoint.best_metric = 'f1': not a metric the digits pipeline reports",
    ),
    # a cluster address: one line at once, where Ray itself would wait for minutes (issue 36)
    "train at a dead address": Case(
        ["train", "digits", "--address", "127.0.0.1:9"],
        "--address = '127.0.0.1:9': no Ray cluster answers there (connection refused: "
        "nothing listens on that port); check the address (`raylane up` prints it) or "
        "leave --address out for a local cluster",
        subprocess=True,
    ),
    "train at a typo'd address": Case(
        ["train", "digits", "--address", "127.0.0.1:63799x"],
        "--address = '127.0.0.1:63799x': not a Ray address: expected HOST:PORT",
    ),
    "train at an unknown host": Case(
        ["train", "digits", "--address", "nohost.invalid:6379"],
        "--address = 'nohost.invalid:6379': cannot resolve host 'nohost.invalid'",
    ),
    "train at a dashboard URL": Case(
        ["train", "digits", "--address", "http://127.0.0.1:9"], "a dashboard URL (the jobs API, for `raylane submit`)"
    ),
    "train at a dead RAY_ADDRESS": Case(
        ["train", "digits"],
        "RAY_ADDRESS = '127.0.0.1:9': no Ray cluster answers there",
        env={"RAY_ADDRESS": "127.0.0.1:9"},
    ),
    "tune at a dead address": Case(
        ["tune", "digits-sweep", "--address", "127.0.0.1:9"], "--address = '127.0.0.1:9': no Ray cluster answers there"
    ),
    "autotune at a dead address": Case(
        ["autotune", "digits", "--address", "127.0.0.1:9"], "--address = '127.0.0.1:9': no Ray cluster answers there"
    ),
    "submit to a dead address": Case(
        ["submit", "digits", "--address", "http://127.0.0.1:9"],
        "--address = 'http://127.0.0.1:9': no Ray jobs API answers there (connection refused",
        subprocess=True,
    ),
    "submit to another scheme": Case(
        ["submit", "digits", "--address", "ftp://127.0.0.1:9"],
        "--address = 'ftp://127.0.0.1:9': not a jobs API URL: expected http://HOST:PORT",
    ),
    "submit to a GCS address": Case(["submit", "digits", "--address", "127.0.0.1:9"], "not a jobs API URL"),
    "submit to an unknown host": Case(
        ["submit", "digits", "--address", "http://nohost.invalid:8265"], "cannot resolve host 'nohost.invalid'"
    ),
    # a remote cluster (TEST-NET-3: never this machine) would put the results in the job's temporary folder
    "submit relative storage to a remote cluster": Case(
        ["submit", "digits", "--address", "http://203.0.113.5:8265"],
        "run.storage_path = 'runs': a job on the remote cluster at http://203.0.113.5:8265 would write its "
        "checkpoints inside its temporary working directory; set run.storage_path to s3://... or an absolute path "
        "the cluster shares",
    ),
    "submit to a remote cluster with a local MLflow store": Case(
        ["submit", "digits", "--address", "http://203.0.113.5:8265", "--set", "run.storage_path=s3://bucket/runs"],
        "MLFLOW_TRACKING_URI = 'sqlite:///mlflow.db': a job on the remote cluster at http://203.0.113.5:8265 would "
        "record its MLflow run inside its temporary working directory; set MLFLOW_TRACKING_URI to the cluster's "
        "MLflow server",
        env={"MLFLOW_TRACKING_URI": "sqlite:///mlflow.db"},
    ),
    # fault_tolerance: replica groups (issue 62)
    "replica groups that do not divide the world": Case(
        ["train", "digits", "--set", "fault_tolerance.enabled=true", "--set", "scaling.num_workers=3"],
        "fault_tolerance.replica_groups = 2: does not divide scaling.num_workers = 3",
    ),
    "a quorum floor above the groups": Case(
        ["check", "digits", "--set", "fault_tolerance.enabled=true", "--set", "fault_tolerance.min_replicas=3"],
        "fault_tolerance.min_replicas = 3: above fault_tolerance.replica_groups = 2",
    ),
    "replica groups with pipeline stages": Case(
        [
            "check",
            "gpt-tiny",
            "--set",
            "fault_tolerance.enabled=true",
            "--set",
            "scaling.num_workers=4",
            "--set",
            "strategy.pp=2",
        ],
        "strategy.pp = 2 with fault_tolerance.enabled: pipeline stages inside a replica group are not built yet",
    ),
    "replica groups beside HSDP replicas": Case(
        [
            "check",
            "digits",
            "--set",
            "fault_tolerance.enabled=true",
            "--set",
            "scaling.num_workers=4",
            "--set",
            "strategy.name=fsdp",
            "--set",
            "strategy.dp_replicate=2",
        ],
        "strategy.dp_replicate = 2 with fault_tolerance.enabled: the replica groups are the replicas",
    ),
    "replica groups elastic": Case(
        ["check", "digits", "--set", "fault_tolerance.enabled=true", "--set", "scaling.num_workers=2,4"],
        "with fault_tolerance.enabled: an elastic run with replica groups is not built yet",
    ),
    "replica groups in one process": Case(
        ["train", "digits", "--local", "--set", "fault_tolerance.enabled=true"],
        "fault_tolerance.enabled with the one process of --local: replica groups need a launcher that restarts "
        "one group alone",
    ),
    "a layout that does not fit a replica group": Case(
        [
            "check",
            "gpt-tiny",
            "--set",
            "fault_tolerance.enabled=true",
            "--set",
            "scaling.num_workers=2",
            "--set",
            "strategy.name=fsdp",
            "--set",
            "strategy.tp=2",
        ],
        "strategy.tp = 2: does not divide a replica group's 1 worker",
    ),
    "a sweep of replica-group runs": Case(
        ["tune", "s.yaml"],
        "fault_tolerance.enabled: sweeps of replica-group runs are not built yet",
        files=sweep("{fault_tolerance.enabled: {grid: [true]}}"),
    ),
    "autotune of a replica-group run": Case(
        ["autotune", "digits", "--set", "fault_tolerance.enabled=true", "--set", "scaling.num_workers=2"],
        "fault_tolerance.enabled: autotune measures one worker group",
    ),
    # up: the token the head will require
    "up with an empty token file": Case(
        ["up"],
        "RAY_AUTH_TOKEN_PATH = 'tok': the file is empty",
        files={"tok": "\n"},
        env={"RAY_AUTH_TOKEN_PATH": "tok"},
    ),
    "up keeping a negative number of warm workers": Case(
        ["up", "--warm", "-1"], "up: --warm must be 0 or more, got -1"
    ),
    "up with no token file": Case(
        ["up"],
        "RAY_AUTH_TOKEN_PATH = 'nope': cannot read it (No such file or directory)",
        env={"RAY_AUTH_TOKEN_PATH": "nope"},
    ),
}


def _line(case: Case, cwd) -> str:
    return case.line.replace("{cwd}", str(cwd.resolve()))


def _write(tmp_path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_exits_2_with_one_line_from_the_cli_and_the_api(name, tmp_path, monkeypatch, capsys, no_work):
    case = CASES[name]
    _write(tmp_path, case.files)
    monkeypatch.chdir(tmp_path)
    for key, value in case.env.items():
        monkeypatch.setenv(key, value)
    assert cli.main(case.argv) == case.code
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1, err
    assert err.startswith("raylane: ") and _line(case, tmp_path) in err, err
    assert "Traceback" not in err
    # Every door checks alike (raylane.api.prepare_train): the Python API raises ConfigError with that line.
    with pytest.raises(ConfigError) as raised:
        _through_the_api(case.argv)
    assert str(raised.value) == err.strip().removeprefix("raylane: ")
    assert capsys.readouterr().out == ""


def _through_the_api(argv: list[str]):
    """The call a notebook makes for the command line `argv` (parsed by the CLI's own parser)."""
    a = cli.parser().parse_args(argv)
    calls = {
        "check": lambda: api.check(a.config, a.overrides),
        "train": lambda: api.train(
            a.config, a.overrides, address=a.address, local=a.local, register=a.register, summary_json=a.summary_json
        ),
        "tune": lambda: api.tune(
            a.config, a.overrides, address=a.address, register=a.register, summary_json=a.summary_json
        ),
        "autotune": lambda: api.autotune(
            a.config,
            a.overrides,
            address=a.address,
            local=a.local,
            budget_s=a.budget_s,
            out=a.out,
            summary_json=a.summary_json,
        ),
        "submit": lambda: api.submit(a.config, a.overrides, address=a.address),
        "export": lambda: api.export(a.checkpoint, a.out),
        "up": lambda: api.up(a.num_cpus, a.port, a.dashboard_port, a.warm),
    }
    return calls[a.command]()


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c.subprocess])
def test_bad_input_end_to_end(name, tmp_path):
    case = CASES[name]
    _write(tmp_path, case.files)
    out = subprocess.run(
        [*RAYLANE, *case.argv],
        check=False,
        cwd=tmp_path,
        env=cli_env(tmp_path, new_database=False),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == case.code and out.stdout == "", out.stdout + out.stderr
    assert out.stderr.splitlines() == [out.stderr.strip()] and _line(case, tmp_path) in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "mlflow.db").exists()


@pytest.mark.parametrize(
    "argv, line",
    [
        (["train", "digits", "--set", "train.max_epoch=2"], "did you mean train.max_epochs?"),
        (["train", "digits", "--summary-json", "out/s.json"], "folder 'out' does not exist"),
        (["train", "digits", "--set", "strategy.tp=3"], "strategy.tp = 3: does not divide torchrun's WORLD_SIZE = 2"),
        (
            ["train", "digits", "--set", "fault_tolerance.enabled=true"],
            "fault_tolerance.enabled with torchrun's WORLD_SIZE = 2: replica groups need a launcher",
        ),
    ],
)
def test_bad_input_under_torchrun(argv, line, tmp_path):
    """Each rank finds the mistake before its process group starts; rank 0 alone prints it, and
    every rank exits 2. torchrun then reports the failed child in a block of its own and exits 1:
    a launcher's output that a rank cannot silence (see the closing note of issue 21)."""
    out = subprocess.run(
        [*TORCHRUN, "--nproc_per_node", "2", "-m", "raylane", *argv],
        check=False,
        cwd=tmp_path,
        env=cli_env(tmp_path, new_database=False),
        capture_output=True,
        text=True,
        timeout=60,
    )
    mine = [x for x in (out.stdout + out.stderr).splitlines() if x.startswith("raylane: ")]
    assert len(mine) == 1 and line in mine[0], out.stdout + out.stderr
    assert out.returncode != 0 and "exitcode  : 2" in out.stderr, out.stderr
    # Nothing started: no MLflow run opened, no run's folder (not a time bound: the machine may be
    # busy). The storage folder itself may be there, empty: the ranks agree on the run's name there.
    assert not (tmp_path / "mlflow.db").exists() and not list((tmp_path / "runs").glob("*/*")), out.stderr


def test_more_workers_than_cores_on_an_embedded_cluster_is_a_warning(tmp_path):
    cores = os.cpu_count() or 1
    cfg = load_config(REPO / "pipelines" / "digits.yaml", [f"scaling.num_workers={cores + 1}"])
    warning = prechecks.oversubscription(cfg, address=None)
    assert warning and f"scaling.num_workers = {cores + 1}" in warning
    assert f"oversubscribes this machine's {cores} cores" in warning
    assert prechecks.oversubscription(cfg, address="10.0.0.1:6379") is None  # a cluster's cores are not ours
    fits = load_config(REPO / "pipelines" / "digits.yaml", ["scaling.num_workers=1"])
    assert prechecks.oversubscription(fits, address=None) is None


def test_export_makes_the_folder_it_writes_into(tmp_path):
    """A missing folder of --out is not a mistake: it passes the checks and export makes it."""
    (tmp_path / "ck").mkdir()
    prechecks.check_export(str(tmp_path / "ck"), str(tmp_path / "new" / "deeper" / "m.safetensors"))
    assert not (tmp_path / "new").exists()  # nothing made before the checkpoint has loaded


def test_a_pipeline_that_declares_no_metrics_takes_any(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pipe.py").write_text(
        "import raylane\nclass Config(raylane.BaseConfig):\n    model: dict = {}\ndef build(cfg):\n    pass\n"
    )
    cfg = load_config({"pipeline": "./pipe.py", "checkpoint": {"keep_best": 1, "best_metric": "anything"}})
    prechecks.check_run(cfg)  # no error
    check_metric("sweep.metric", "f1", cfg)


def test_the_table_covers_every_command():
    commands = {c.argv[0] for c in CASES.values()}
    assert commands >= {"check", "train", "tune", "autotune", "export", "submit"} and len(CASES) >= 40
