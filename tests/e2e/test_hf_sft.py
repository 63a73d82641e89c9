"""Fine-tuning on conversations with the shipped `hf` pipeline (issue 64): JSON Lines of
`{"messages": [...]}` read by `raylane train` in one process, each conversation rendered by the
tokenizer's own chat template (a tiny Llama with a ChatML template, tests/helpers/hf_chat.py),
the loss on the assistant's turns, the examples packed into `model.seq_len`. A run stopped
mid-epoch and run again trains on the same next examples as an uninterrupted one: its losses from
the checkpoint on are bit-exact. Bad input is one line, exit 2, before anything starts."""

from __future__ import annotations

import json

import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import cli_env, read_json

pytest.importorskip("transformers")


@pytest.fixture
def chat(tmp_path):
    from tests.helpers import hf_chat

    hf_chat.llama(tmp_path / "model")
    for name, n, seed in (("train", 48, 0), ("eval", 12, 1)):
        with open(tmp_path / f"{name}.jsonl", "w") as f:
            for i, messages in enumerate(hf_chat.conversations(n, seed=seed)):
                f.write(json.dumps({"messages": messages}) + "\n")
                if name == "train" and i in (5, 30):  # a question never answered: counted, left out
                    asked = [m for m in messages if m["role"] != "assistant"]
                    f.write(json.dumps({"messages": asked}) + "\n")
    (tmp_path / "sft.yaml").write_text(
        "pipeline: hf\n"
        "model: {name_or_path: model, seq_len: 128}\n"
        "data: {train: train.jsonl, eval: eval.jsonl, format: json, shuffle_rows: 16}\n"
        "train: {batch_size: 2, max_epochs: 1, max_steps: 8, seed: 0}\n"
        "optim: {name: adamw, lr: 0.003}\n"
        "checkpoint: {every_n_steps: 3}\n"
        "mlflow: {log_every_n_steps: 1, log_model: false, system_metrics: false}\n"
        "run: {storage_path: runs}\n"
    )
    return tmp_path


def _losses(summary: dict) -> dict[int, float]:
    history = MlflowClient(summary["tracking_uri"]).get_metric_history(summary["run_id"], "train/loss")
    return {m.step: m.value for m in history}


# Slow (~31 s): make test keeps a packed run resumed bit-exact in the mixture test below (conversations,
# packed), the per-window padding share in tests/unit/test_padding_share.py and the counts in
# tests/unit/test_hf_counts.py.
@pytest.mark.slow
def test_a_run_stopped_mid_epoch_resumes_on_the_same_next_packed_examples(run_cli, chat):
    """One process: an uninterrupted run, and the same run failing at step 5 (a checkpoint at 3)
    then run again: from step 4 on, every step's loss is the uninterrupted run's, bit for bit.
    Both end FINISHED with a held-out loss per answer token."""
    env = cli_env(chat)
    whole = run_cli("train", "sft.yaml", "--local", "--set", "run.name=whole", "--summary-json", "whole.json", env=env)
    assert whole.wait(400) == 0, whole.output
    first = read_json(chat / "whole.json")
    assert first["status"] == "FINISHED" and first["steps"] >= 6, first
    assert 0 < first["metrics"]["loss"] < 10, first["metrics"]
    # The data's share of the row tokens: the summary's packing efficiency, and each window's.
    assert 0.5 < first["packing_efficiency"] <= 1 and first["real_tokens_per_s"] < first["tokens_per_s"], first
    assert "of the tokens were data" in whole.output, whole.output
    counts = first["skipped_rows"]["data.train"]["counts"]  # the long conversations are cut to 128 tokens
    assert counts["without an answer (left out)"] == 2 and counts["cut to model.seq_len"] > 0, first
    line = f"  examples:      data.train: {counts['cut to model.seq_len']} cut to model.seq_len, 2 without an answer (left out)"
    assert line in whole.output.splitlines(), whole.output
    client = MlflowClient(first["tracking_uri"])
    shares = [m.value for m in client.get_metric_history(first["run_id"], "train/padding_share")]
    assert len(shares) == 8 and all(0 <= x < 0.5 for x in shares), shares
    run = client.get_run(first["run_id"]).data.metrics
    assert run["run/packing_efficiency"] == pytest.approx(first["packing_efficiency"]), run

    args = ["train", "sft.yaml", "--local", "--set", "run.name=cut", "--summary-json", "cut.json"]
    cut = run_cli(*args, env=cli_env(chat, RAYLANE_FAULTS="raise@step=5"), name="cut")
    assert cut.wait(400) == 1, cut.output
    again = run_cli(*args, env=cli_env(chat), name="again")
    assert again.wait(400) == 0, again.output
    assert "resumed from step 3" in again.output, again.output
    resumed = read_json(chat / "cut.json")
    assert resumed["status"] == "FINISHED" and resumed["steps"] == first["steps"] == 8, resumed
    ours, theirs = _losses(resumed), _losses(first)
    assert [s for s in theirs if s >= 4] and all(ours[s] == theirs[s] for s in theirs if s >= 4), (ours, theirs)
    assert resumed["metrics"]["loss"] == first["metrics"]["loss"]


def test_a_mixture_resumed_mid_epoch_draws_the_same_next_examples(run_cli, chat):
    """data.mix of the training conversations and 20 others at 0.8 / 0.2, in one process: an
    uninterrupted run, and the same run failing at step 5 then run again, whose every step's loss
    from step 4 on is the uninterrupted run's, bit for bit; the summary says what each source
    gave. A weight of 0 is one line naming its key, before anything starts."""
    from tests.helpers import hf_chat

    with open(chat / "other.jsonl", "w") as f:
        for messages in hf_chat.conversations(20, seed=7):
            f.write(json.dumps({"messages": messages}) + "\n")
    text = (chat / "sft.yaml").read_text().replace("{train: train.jsonl, ", "{")
    mixed = text.replace(
        "data: {", "data: {mix: [{train: train.jsonl, weight: 0.8, name: chat}, {train: other.jsonl, weight: 0.2}], "
    )
    (chat / "mix.yaml").write_text(mixed)
    whole = run_cli(
        "train", "mix.yaml", "--local", "--set", "run.name=mixed", "--summary-json", "m1.json", env=cli_env(chat)
    )
    assert whole.wait(400) == 0, whole.output
    first = read_json(chat / "m1.json")
    counts = first["skipped_rows"]["data.mix"]["counts"]  # 70 drawn at 0.8 / 0.2, and what their rows counted
    assert (counts["from chat"], counts["from source 1"], counts["without an answer (left out)"]) == (56, 14, 2), first
    shown = ", ".join(f"{n} {what}" for what, n in sorted(counts.items()))
    assert f"  examples:      data.mix: {shown}" in whole.output.splitlines(), whole.output
    client = MlflowClient(first["tracking_uri"])  # each window's realised shares: of its own examples
    chat_share, other = ({m.step: m.value for m in client.get_metric_history(first["run_id"], k)} for k in (
        "train/source_share/chat", "train/source_share/source 1"))  # fmt: skip
    assert chat_share and set(chat_share) == set(other), (chat_share, other)
    assert all(chat_share[s] + other[s] == pytest.approx(1) for s in chat_share), (chat_share, other)
    assert 0.6 < sum(chat_share.values()) / len(chat_share) < 0.95, chat_share
    args = ["train", "mix.yaml", "--local", "--set", "run.name=mixcut", "--summary-json", "m2.json"]
    cut = run_cli(*args, env=cli_env(chat, RAYLANE_FAULTS="raise@step=5"), name="mixcut")
    assert cut.wait(400) == 1, cut.output
    again = run_cli(*args, env=cli_env(chat), name="mixagain")
    assert again.wait(400) == 0 and "resumed from step 3" in again.output, again.output
    ours, theirs = _losses(read_json(chat / "m2.json")), _losses(first)
    assert [s for s in theirs if s >= 4] and all(ours[s] == theirs[s] for s in theirs if s >= 4), (ours, theirs)

    (chat / "zero.yaml").write_text(mixed.replace("weight: 0.2", "weight: 0"))
    bad = run_cli("train", "zero.yaml", "--local", env=cli_env(chat), name="zero")
    assert bad.wait(120) == 2, bad.output
    (line,) = [x for x in bad.output.splitlines() if x.strip()]
    assert line.startswith("raylane: invalid config: data.mix.1.weight = 0"), line


def test_a_tokenizer_without_a_chat_template_is_one_line_before_start(run_cli, chat):
    from tests.helpers import hf_chat

    hf_chat.chat_tokenizer(None).save_pretrained(chat / "plain")
    p = run_cli("train", "sft.yaml", "--local", "--set", "model.tokenizer_path=plain", env=cli_env(chat))
    assert p.wait(120) == 2, p.output
    (line,) = [x for x in p.output.splitlines() if x.strip()]
    assert line.startswith("raylane: invalid config: model.tokenizer_path") and "chat template" in line, line


CHAT_PROBE = """
import sys
from transformers import AutoModelForCausalLM, AutoTokenizer

model, tok = AutoModelForCausalLM.from_pretrained(sys.argv[1]), AutoTokenizer.from_pretrained(sys.argv[1])
prompt = tok.apply_chat_template([{"role": "user", "content": "w5 w6 w7"}], add_generation_prompt=True,
                                 return_dict=True, return_tensors="pt")
out = model.generate(**prompt, max_new_tokens=6, do_sample=False)
print("PROMPT", tok.decode(prompt["input_ids"][0]).replace(chr(10), "|"))
print("ANSWER", len(out[0]) - prompt["input_ids"].shape[1], model.config.use_cache)
"""


@pytest.mark.slow  # ~1 minute on the shared head; make test's 15 minutes are spent
@pytest.mark.shared_ray
def test_a_lora_fine_tune_on_conversations_on_2_ray_workers_under_fsdp_exports_a_model_that_chats(run_cli, chat):
    """The files streamed by Ray Data's tasks (each batch of rows encoded and packed there), the
    LoRA-adapted tiny Llama under FSDP on 2 workers, 4 steps; exported with `raylane export
    --format hf`, the model loads with from_pretrained and answers through the template
    (generate), its cache on again."""
    import subprocess
    import sys

    env = cli_env(chat)
    sets = ["scaling.num_workers=2", "strategy.name=fsdp", "lora.r=4", "lora.dropout=0", "train.max_steps=4"]
    sets += ["data.eval=null", "run.name=ray"]
    p = run_cli("train", "sft.yaml", *(x for s in sets for x in ("--set", s)), "--summary-json", "ray.json", env=env)
    assert p.wait(400) == 0, p.output
    s = read_json(chat / "ray.json")
    assert (s["status"], s["strategy"], s["world_size"], s["steps"]) == ("FINISHED", "fsdp", 2, 4), s
    exported = run_cli("export", s["checkpoint"], "--format", "hf", "--out", "exported", env=env, name="export")
    assert exported.wait(300) == 0, exported.output
    probe = subprocess.run(
        [sys.executable, "-c", CHAT_PROBE, str(chat / "exported")], capture_output=True, text=True, timeout=120
    )
    assert probe.returncode == 0, probe.stderr[-2000:]
    lines = dict(x.split(" ", 1) for x in probe.stdout.splitlines() if x.startswith(("PROMPT", "ANSWER")))
    # The word-level tokenizer decodes with spaces between its tokens (and has no newline token).
    assert lines["PROMPT"] == "<|im_start|> user w5 w6 w7 <|im_end|> <|im_start|> assistant", lines
    generated, cache = lines["ANSWER"].split()
    assert 1 <= int(generated) <= 6 and cache == "True", lines  # an answer (EOS may end it early)
