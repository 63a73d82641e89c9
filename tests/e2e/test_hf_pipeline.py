"""Hugging Face causal LMs under pipeline parallelism (issue 49): a tiny untied Llama made here,
split by raylane.hf's `pp_stages` (its decoder layers, names kept) on 2 gloo ranks under torchrun,
fine-tuned in full and with LoRA against `from_pretrained`'s model in one process
(tests/helpers/hf_pipeline.py). `raylane check --plan` prints the stages for gpt and for the HF
model; a tied HF model or a classifier under strategy.pp is one line, exit 2, before launch."""

from __future__ import annotations

import os

import pytest

from raylane import cli
from tests.conftest import REPO, TORCHRUN, cli_env, read_json

pytest.importorskip("transformers")


def _llama(folder, tied: bool = False):
    import torch
    from transformers import AutoModelForCausalLM

    from tests.helpers import hf_families, hf_tiny

    torch.manual_seed(0)
    config = hf_families.llama(vocab_size=hf_tiny.VOCAB, tie_word_embeddings=tied, num_hidden_layers=4)
    return hf_tiny.save(AutoModelForCausalLM.from_config(config), folder)


def _fine_tunes(run_cli, tmp_path, ranks: int, sets: str = "") -> dict:
    model = _llama(tmp_path / "model")
    p = run_cli(
        *["--nproc_per_node", str(ranks), str(REPO / "tests/helpers/hf_pipeline.py")],
        *[str(model), str(tmp_path / "out.json")],
        launcher=TORCHRUN,
        name=f"hf-pp{ranks}",
        env=cli_env(
            tmp_path,
            PYTHONPATH=os.pathsep.join([str(REPO / "app"), str(REPO)]),
            OMP_NUM_THREADS="1",
            HF_PP_SETS=sets,
        ),
    )
    assert p.wait(300) == 0, p.output
    return read_json(tmp_path / "out.json")


def _matches_one_process(runs: dict, label: str, ranks: int) -> None:
    for name, run in runs.items():
        assert run["strategy"] == label, run
        assert [len(r) for r in run["reads"]] == [1] + [0] * (ranks - 1), (name, run["reads"])
        assert all(abs(ours - one) <= 1e-6 * one for ours, one in run["losses"]), (name, run["losses"])
        assert run["weights"] <= 1e-6, (name, run["weights"])
        assert run["eval"][0] == pytest.approx(run["eval"][1], rel=1e-6), (name, run["eval"])
    assert len(runs["full"]["trained"]) == len(runs["full"]["params"])  # every weight moved
    lora = runs["lora"]["trained"]
    assert lora and all(".lora_" in k for k in lora) and len(lora) < len(runs["lora"]["params"])


def test_a_tiny_llama_fine_tunes_in_full_and_with_lora_under_pp2_as_one_process(run_cli, tmp_path):
    """One torchrun of 2 ranks (15-35 s on 2 busy cores), strategy.pp=2 with 1F1B over 2
    micro-batches: the weights read by rank 0 alone and sent to both stages; 3 SGD steps through
    the Trainer's run_step on {input_ids, labels} batches, each loss within 1e-6 relative of one
    process's (transformers' own loss on the whole batch) and every weight within 1e-6 of the
    largest after; the held-out loss over 5 rows (not a multiple of the micro-batches) within 1e-6;
    under LoRA only the adapter moves. (Without every stage's names gathered on rank 0, stage 1
    keeps uninitialized weights and step 1 is non-finite.)"""
    _matches_one_process(_fine_tunes(run_cli, tmp_path, 2), "pp2", 2)


@pytest.mark.slow  # ~40 s on 4 ranks; make test runs pp=2 alone above
def test_a_tiny_llama_fine_tunes_under_pp2_x_tp2_on_4_ranks_as_one_process(run_cli, tmp_path):
    """The model's own tensor-parallel plan inside each stage (its rules for the modules the
    stage holds), 4 ranks as tp2 x pp2: the same figures, in full and with LoRA."""
    _matches_one_process(_fine_tunes(run_cli, tmp_path, 4, "strategy.tp=2,strategy.name=fsdp"), "tp2×pp2", 4)


def _check(capsys, *argv: str) -> tuple[int, list[str], str]:
    capsys.readouterr()
    code = cli.main(["check", *argv])
    out, err = capsys.readouterr()
    return code, out.splitlines(), err.strip()


def test_check_plan_prints_the_stages_and_refuses_what_cannot_split(tmp_path, capsys, no_work):
    """`raylane check --plan` with strategy.pp: each stage's pipeline rank, modules (a run of
    blocks folded) and parameters, built on the meta device: for gpt (4 stages on 2 ranks in a V)
    and for a tiny HF Llama with a LoRA adapter (a user's pipeline on raylane.hf.pipeline). A tied
    HF model, and a classifier, under strategy.pp=2: one line each, exit 2, before launch."""
    sets = ["strategy.pp=2", "model.tie_embeddings=false", "model.n_layer=4", "scaling.num_workers=2"]
    sets += ["strategy.pp_schedule=ZBVZeroBubble"]
    code, out, err = _check(capsys, "gpt-tiny", "--plan", *(x for s in sets for x in ("--set", s)))
    assert code == 0, err
    at = out.index("layout: pp2 on 2 ranks: dp 1 × pp 2")
    assert out[at + 1 : at + 6] == [
        "stages of GPT (4, ZBVZeroBubble):",
        "  stage 0 (pp rank 0): wte, wpe, drop, blocks.0  (70,464 parameters)",
        "  stage 1 (pp rank 1): blocks.1  (49,984 parameters)",
        "  stage 2 (pp rank 1): blocks.2  (49,984 parameters)",
        "  stage 3 (pp rank 0): blocks.3, ln_f, lm_head  (66,496 parameters)",
    ]

    from tests.helpers import hf_tiny

    rows = tmp_path / "rows"
    for part in ("train", "eval"):
        hf_tiny.rows(rows / part, n=8)
    (tmp_path / "cfg.yaml").write_text("pipeline: tests.helpers.hf_classifier\n")
    base = [f"source.rows={rows}", "model.seq_len=16", "strategy.pp=2", "scaling.num_workers=2"]
    sets = [f"model.name_or_path={_llama(tmp_path / 'untied')}", *base, "lora.r=4"]
    code, out, err = _check(capsys, str(tmp_path / "cfg.yaml"), "--plan", *(x for s in sets for x in ("--set", s)))
    assert code == 0, err
    at = out.index("layout: pp2 on 2 ranks: dp 1 × pp 2")
    assert out[at + 1] == "stages of PeftModelForCausalLM (2, 1F1B):"
    assert out[at + 2].startswith(
        "  stage 0 (pp rank 0): base_model.model.model.embed_tokens, base_model.model.model.layers.0-1  ("
    )
    assert out[at + 3].startswith(
        "  stage 1 (pp rank 1): base_model.model.model.layers.2-3, base_model.model.model.norm, "
        "base_model.model.model.rotary_emb, base_model.model.lm_head  ("
    )

    sets = [f"model.name_or_path={_llama(tmp_path / 'tied', tied=True)}", *base]
    code, _, err = _check(capsys, str(tmp_path / "cfg.yaml"), *(x for s in sets for x in ("--set", s)))
    assert (code, err) == (
        2,
        "raylane: invalid config: strategy.pp = 2: LlamaForCausalLM ties its input embedding and lm_head "
        "(config.tie_word_embeddings = true): one parameter on the first and the last stage, which would train "
        "apart; pipeline parallelism needs a model saved with tie_word_embeddings=false",
    )
    sets = [f"model.name_or_path={tmp_path / 'untied'}", *base, "model.task=sequence-classification"]
    code, _, err = _check(capsys, str(tmp_path / "cfg.yaml"), *(x for s in sets for x in ("--set", s)))
    assert (code, err) == (
        2,
        "raylane: invalid config: strategy.pp = 2 with model.task = 'sequence-classification': raylane.hf splits "
        "causal LMs into pipeline stages only; use strategy.pp: 1",
    )


@pytest.mark.slow  # ~2 min on 2 busy cores: four launches; make test proves the same pieces in one torchrun above
def test_raylane_train_fine_tunes_a_user_hf_pipeline_under_pp2_as_one_process(run_cli, tmp_path):
    """`raylane train` of a user's pipeline on raylane.hf.pipeline (the untied tiny Llama as a
    causal LM) at strategy.pp=2 on 2 torchrun ranks, in full and with LoRA: each ends FINISHED at
    the held-out loss of the same fine-tune in one process (SGD, 4 steps), its strategy pp2."""
    from tests.helpers import hf_tiny

    model = _llama(tmp_path / "model")
    for part in ("train", "eval"):
        hf_tiny.rows(tmp_path / "rows" / part, n=16)
    (tmp_path / "cfg.yaml").write_text("pipeline: tests.helpers.hf_classifier\n")
    sets = [f"model.name_or_path={model}", f"source.rows={tmp_path / 'rows'}", "model.seq_len=16"]
    sets += ["train.batch_size=2", "train.max_steps=4", "optim.name=sgd", "mlflow.log_model=false"]
    sets += ["scaling.peak_tflops=1"]
    env = cli_env(tmp_path, PYTHONPATH=os.pathsep.join([str(REPO / "app"), str(REPO)]), OMP_NUM_THREADS="1")
    runs = {}
    for name, extra in {"full": [], "lora": ["lora.r=4", "lora.dropout=0"]}.items():
        for layout, more in {"pp": ["strategy.pp=2"], "one": []}.items():
            run = f"{name}-{layout}"
            argv = ["train", "cfg.yaml", *(x for s in [*sets, *extra, *more, f"run.name={run}"] for x in ("--set", s))]
            argv += ["--summary-json", f"{run}.json"]
            if layout == "pp":
                p = run_cli("--nproc_per_node", "2", "-m", "raylane", *argv, launcher=TORCHRUN, name=run, env=env)
            else:
                p = run_cli(*argv, "--local", name=run, env=env)
            assert p.wait(400) == 0, p.output
            runs[run] = read_json(tmp_path / f"{run}.json")
    for name in ("full", "lora"):
        pp, one = runs[f"{name}-pp"], runs[f"{name}-one"]
        assert (pp["status"], pp["strategy"]) == ("FINISHED", "pp2"), pp
        assert pp["metrics"]["loss"] == pytest.approx(one["metrics"]["loss"], rel=1e-6), (name, pp, one)
