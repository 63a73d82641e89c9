"""Plan and stage mistakes of a user's own pipeline (tests/helpers/plan_mistakes.py: its own
decoder, or a tiny Hugging Face Llama made in build()) refused by the commands before any worker
starts: `raylane train` on Ray (exit 2, one line, nothing started), under torchrun (every rank
exits 2 before its process group, rank 0 says the line), and `raylane check` itself; `raylane
check --plan` on pipelines that make their data in build() (examples/own-model), and what it
prints. The checks themselves, case by case, are tests/unit/test_plan_checks.py's."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from raylane import cli
from tests.conftest import REPO, TORCHRUN, cli_env, read_json

HELPER = REPO / "tests" / "helpers" / "plan_mistakes.py"
EXAMPLE = REPO / "examples" / "own-model"


@pytest.fixture
def config(tmp_path) -> Path:
    shutil.copy(HELPER, tmp_path / "plan_mistakes.py")
    (tmp_path / "train.yaml").write_text(
        "pipeline: ./plan_mistakes.py\nscaling:\n  num_workers: 2\nmlflow:\n  enabled: false\n"
    )
    return tmp_path / "train.yaml"


def _sets(*sets: str) -> list[str]:
    return [x for s in sets for x in ("--set", s)]


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err.strip()


@pytest.mark.parametrize(
    ("sets", "line"),
    [
        (["strategy.tp=2", "model.heads=3"], "strategy.tp = 2: does not divide layers.0.attn.n_heads = 3"),
        (["strategy.tp=2", "model.plan=no_module"], "Pipeline.tp_plan: 'layers.*.attn.out_projection' names no module"),
        (["strategy.tp=2", "model.plan=misspelt"], "Pipeline.tp_plan['layers.*.attn.q_proj'] = 'colwize': no such"),
        (["strategy.pp=2", "model.tied=true"], "strategy.pp = 2: Pipeline.pp_stages: 'embed.weight' and 'head.weight'"),
        (
            ["strategy.pp=4", "scaling.num_workers=4", "strategy.name=fsdp", "model.layers=3"],
            "strategy.pp = 4: Pipeline.pp_stages = 'auto': 4 stages for the 3 blocks of TinyLM",
        ),
        (
            ["strategy.tp=2", "model.kind=hf", "model.plan=hf", "model.heads=3"],
            "strategy.tp = 2: does not divide model.layers.0.self_attn.config.num_attention_heads = 3",
        ),
        (
            ["strategy.pp=2", "model.kind=hf", "model.plan=hf", "model.tied=true"],
            "strategy.pp = 2: Pipeline.pp_stages: 'model.embed_tokens.weight' and 'lm_head.weight' are one tied",
        ),
    ],
)
def test_train_on_ray_refuses_each_mistake_before_anything_starts(sets, line, config, capsys, no_work):
    """`raylane train` (on Ray: no --local, no torchrun) exits 2 with the line, before Ray, a
    worker or MLflow starts (no_work); `raylane check` says the same. Before: both passed, and
    the workers failed 48-78 s later (the report's times), the heads and the string style with
    torch's own errors naming no key."""
    code, out, err = _run(capsys, "train", str(config), *_sets(*sets))
    assert (code, out) == (2, ""), err
    assert err.startswith(f"raylane: {line}") and len(err.splitlines()) == 1, err
    code, _, checked = _run(capsys, "check", str(config), *_sets(*sets))
    assert (code, checked) == (2, err)


def test_under_torchrun_every_rank_refuses_before_its_process_group(run_cli, config, tmp_path):
    """Each rank runs the checks before its process group starts: rank 0 alone prints the line,
    every rank exits 2 (torchrun then reports its failed child and exits 1, as for any bad input:
    tests/e2e/test_bad_input.py); nothing is recorded."""
    for sets, line in (
        (["strategy.tp=2", "model.plan=misspelt"], "raylane: Pipeline.tp_plan['layers.*.attn.q_proj'] = 'colwize'"),
        (
            ["strategy.tp=2", "model.kind=hf", "model.plan=hf", "model.heads=3"],
            "raylane: strategy.tp = 2: does not divide model.layers.0.self_attn.config.num_attention_heads = 3",
        ),
    ):
        p = run_cli(
            "--nproc_per_node", "2", "-m", "raylane", "train", str(config), *_sets(*sets),
            launcher=TORCHRUN, env=cli_env(tmp_path, new_database=False),
        )  # fmt: skip
        assert p.wait(timeout=240) != 0, p.output
        mine = [x for x in p.output.splitlines() if x.startswith("raylane: ")]
        assert len(mine) == 1 and mine[0].startswith(line), p.output
        assert "exitcode  : 2" in p.output and "exitcode  : 1" not in p.output, p.output
    assert not (tmp_path / "mlflow.db").exists() and not list((tmp_path / "runs").glob("*/*"))


def test_check_plan_works_on_a_pipeline_that_makes_its_data_in_build(run_cli, tmp_path):
    """examples/own-model makes its data in build() (`int(k)` of its labels): before, check
    --plan ran the whole build() on the meta device and exited 2 with `Tensor.item() cannot be
    called on meta tensors`. It prints the layout and the plan, and not the config before them."""
    project = Path(shutil.copytree(EXAMPLE, tmp_path / "own-model", ignore=shutil.ignore_patterns("__pycache__")))
    p = run_cli("check", "train.yaml", "--plan", cwd=project)
    assert p.wait(timeout=240) == 0, p.output
    assert p.output.splitlines() == [
        "layout: ddp on 2 ranks: dp 2 (strategy.tp = 1: every rank holds whole layers)",
        "plan: none (the shapes pipeline gives no tp_plan)",
    ]


def test_check_plan_prints_each_part_once_and_only_what_the_layout_uses(config, capsys, no_work):
    """The plan of a pipeline that reads its data's values in build(), under tp 2 with styles by
    name (transformers' notation: shown as the split each makes, not `str` with every weight
    whole); with only pp set the stages and no tensor-parallel plan; with tp: auto the layout
    line once; never the config."""
    code, out, err = _run(capsys, "check", str(config), "--plan", *_sets("strategy.tp=2", "model.plan=strings"))
    assert code == 0, err
    lines = out.splitlines()
    assert lines[:3] == [
        "layout: tp2 on 2 ranks: dp 1 × tp 2",
        "plan on TinyLM (7 rules):",
        "  layers.*.attn.q_proj    colwise: weight Shard(0); in Replicate, out Shard(-1)  (×2)",
    ]
    assert "  layers.*.down           rowwise: weight Shard(1); in Shard(-1), out Replicate  (×2)" in lines
    assert "  head                    colwise: weight Shard(0); in Replicate, out Replicate" in lines
    assert len(lines) == 2 + 7 + 1 and lines[-1].startswith("whole on every tensor-parallel rank: embed.weight, ")

    code, out, err = _run(capsys, "check", str(config), "--plan", *_sets("strategy.pp=2"))
    assert code == 0, err
    assert out.splitlines() == [
        "layout: pp2 on 2 ranks: dp 1 × pp 2",
        "stages of TinyLM (2, 1F1B):",
        "  stage 0 (pp rank 0): embed, layers.0  (5,616 parameters)",
        "  stage 1 (pp rank 1): layers.1, head  (5,616 parameters)",
        "plan: not laid out (strategy.tp = 1: every rank holds whole layers; --set strategy.tp=2 shows it)",
    ]

    code, out, err = _run(capsys, "check", str(config), "--plan", *_sets("strategy.tp=auto", "strategy.name=fsdp"))
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("layout: fsdp on 2 ranks: tp chosen on the ranks")
    assert sum(line.startswith("layout:") for line in lines) == 1 and lines[1] == "plan on TinyLM (7 rules):"


def test_check_sends_the_libraries_warnings_to_the_library_log(run_cli, tmp_path):
    """peft's wrapping of a transformers model warns (`is_gradient_checkpointing` is deprecated: a
    FutureWarning) while check builds a LoRA model: into the library log, as a run's library
    output; before, check set no log up and the warning reached the terminal, twice."""
    pytest.importorskip("peft")
    import torch
    from transformers import AutoModelForCausalLM

    from tests.helpers import hf_families, hf_tiny

    torch.manual_seed(0)
    hf_tiny.save(AutoModelForCausalLM.from_config(hf_families.llama(vocab_size=hf_tiny.VOCAB)), tmp_path / "model")
    for part in ("train", "eval"):
        hf_tiny.rows(tmp_path / "rows" / part, n=8)
    (tmp_path / "cfg.yaml").write_text(f"pipeline: {REPO / 'tests' / 'helpers' / 'hf_classifier.py'}\n")
    sets = [f"model.name_or_path={tmp_path / 'model'}", f"source.rows={tmp_path / 'rows'}", "model.seq_len=16"]
    p = run_cli("check", "cfg.yaml", "--plan", *_sets(*sets, "strategy.tp=2", "scaling.num_workers=2", "lora.r=4"))
    assert p.wait(timeout=240) == 0, p.output
    assert p.output.startswith("layout: tp2 on 2 ranks") and "Warning" not in p.output, p.output
    (log,) = (tmp_path / "raylane-home" / "logs").glob("check-*.log")
    assert "FutureWarning" in log.read_text()


@pytest.mark.slow  # ~70 s on a loaded 2-core machine; make test lays a named plan out on a fake process group (tests/unit/test_tensor_parallel.py)
def test_a_plan_by_name_trains_on_the_ranks_as_the_same_plan_made_in_code(run_cli, config, tmp_path):
    """`"colwise"`, `"rowwise"`, `"colwise_rep"` pass the checks and train under torchrun at tp 2
    exactly as ColwiseParallel(), RowwiseParallel(), ColwiseParallel(output_layouts=Replicate())
    (before: torch's `Expect Union[ParallelStyle, ...] <class 'str'> found!` on the ranks)."""
    sets = ["strategy.tp=2", "train.max_steps=3", "optim.name=sgd", "optim.lr=0.5"]
    started = {
        plan: run_cli(
            "--nproc_per_node",
            "2",
            "-m",
            "raylane",
            "train",
            str(config),
            *_sets(*sets, f"model.plan={plan}", f"run.name={plan}"),
            "--summary-json",
            f"{plan}.json",
            launcher=TORCHRUN,
            name=plan,
        )  # fmt: skip
        for plan in ("strings", "objects")
    }
    summaries = {}
    for plan, p in started.items():
        assert p.wait(timeout=300) == 0, p.output
        summaries[plan] = read_json(tmp_path / f"{plan}.json")
    assert summaries["strings"]["strategy"] == "tp2" and summaries["strings"]["status"] == "FINISHED"
    assert summaries["strings"]["metrics"]["loss"] == summaries["objects"]["metrics"]["loss"]
