"""Pipeline parallelism for Hugging Face decoder-only causal LMs (Llama, Qwen2, Mistral, GPT-2 and
their kin, with or without a LoRA adapter): the `Pipeline.pp_stages` of `raylane.hf.pipeline`.

The split is raylane's own (raylane.loop.distributed.pipeline_parallel): each stage is the model deep-copied
with what other stages hold taken out, its decoder layers (`model.layers`, `transformer.h`: the
found blocks) split evenly, the embeddings on the first stage, the final norm and `lm_head` on
the last; parameter names stay the model's, so checkpoints and `save_pretrained` folders do not
depend on the layout. What the model's own forward needs to run as a stage:

- the first stage takes `input_ids`; a later one takes the hidden states it receives as
  `inputs_embeds`, from which transformers' forward builds the positions, the rotary embeddings
  and the causal mask itself, exactly as on one process (the embedding it skips is elsewhere);
- no cache (`use_cache=False`); the last stage sends the logits, not transformers' output object;
- batches are packed causal-LM rows, `{"input_ids", "labels"}` (what `raylane.hf` makes): no
  padding mask crosses stages, so any other key is refused in one line;
- the loss is transformers' own causal-LM loss (labels shifted by one, -100 ignored) on the last
  stage's logits.

A model whose input and output embeddings are one tied parameter cannot be split: the first and
the last stage would each train their own copy. It is refused before launch (`check_stages`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from raylane.loop.distributed.pipeline_parallel import Stages

# The keys of the batches a stage runs: packed rows, with labels the model shifts itself.
_KEYS = ("input_ids", "labels")


def causal_lm_stages() -> Stages:
    """The `Pipeline.pp_stages` of a Hugging Face causal LM (with or without peft's wrapper)."""
    return Stages(names="auto", call=_call, pair=_pair, loss_fn=causal_lm_loss)


def _call(forward: Any, x: Any, *, first: bool) -> Any:
    inputs = {"input_ids": x} if first else {"inputs_embeds": x}
    output = forward(**inputs, use_cache=False)
    return output.logits  # the last stage's: earlier ones end at their last layer's output


def _pair(batch: Any) -> tuple[Any, Any]:
    from raylane.loop.protocols.batches import BatchFormError, describe

    if isinstance(batch, Mapping) and set(batch) == set(_KEYS):
        return batch["input_ids"], batch["labels"]
    raise BatchFormError(
        f"strategy.pp: a Hugging Face model's pipeline stages run packed causal-LM batches of input_ids and "
        f"labels (no attention_mask: no padding crosses stages); this batch is {describe(batch)}"
    )


def causal_lm_loss(logits: Any, labels: Any) -> Any:
    """transformers' causal-LM loss: token i's logits predict label i + 1, -100 ignored, the mean."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    return ForCausalLMLoss(logits, labels, vocab_size=logits.shape[-1])


def check_pp(model: Any, n_stages: int) -> list[list[str]]:
    """Before launch: the stages of `model` (built on the meta device), or ValueError in one line
    naming what cannot be split (fewer layers than stages, tied embeddings)."""
    from raylane.hf.tensor_parallel import pretrained_of
    from raylane.loop.distributed.blocks import find_blocks
    from raylane.loop.distributed.pipeline_split import split_names

    _, pretrained = pretrained_of(model)
    cls = type(pretrained).__name__
    embedding, head = pretrained.get_input_embeddings(), pretrained.get_output_embeddings()
    if head is not None and embedding is not None and head.weight is embedding.weight:
        raise ValueError(
            f"{cls} ties its input embedding and lm_head (config.tie_word_embeddings = true): one parameter on "
            "the first and the last stage, which would train apart; pipeline parallelism needs a model saved with "
            "tie_word_embeddings=false"
        )
    return split_names(model, find_blocks(model), "auto", n_stages)[0]
