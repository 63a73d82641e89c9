"""A GPT-2-style decoder (nanoGPT's shape) on bytes: next-byte prediction over a text corpus.

The corpus ships with Python itself (the help texts of `pydoc_data`, ~0.5 MB of English about
Python), or any UTF-8 file given as `data.text_path`; nothing is downloaded. The tokenizer is
the identity on UTF-8 bytes (256 ids); a larger `model.vocab_size` only pads the embedding, as
GPT-2 small's 50304 does in the gpt2-124m config, to keep its shape and FLOPs.

The last `HELD_OUT_FRACTION` of the text is held out; `loss` (nats per byte) and
`bits_per_byte` are reported on it."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from raylane import BaseConfig, InputPath, Section

HELD_OUT_FRACTION = 0.1
BYTE_VOCAB = 256


class ModelSection(Section):
    """A GPT-2-style decoder (nanoGPT's shape) over bytes."""

    vocab_size: int = Field(
        BYTE_VOCAB,
        ge=BYTE_VOCAB,
        le=1_000_000,
        description="Rows of the embedding: 256 byte ids, more only pad it (GPT-2 small's 50304 keeps its shape).",
    )
    block_size: int = Field(64, ge=2, le=65_536, description="Tokens per sample (the context length).")
    n_layer: int = Field(2, ge=1, le=1024, description="Transformer blocks.")
    n_head: int = Field(2, ge=1, le=1024, description="Attention heads per block; must divide `n_embd`.")
    n_embd: int = Field(64, ge=1, le=65_536, description="Width of the embedding and of each block.")
    dropout: float = Field(
        0.0, ge=0, lt=1, description="Dropout on the embeddings, in attention and after each MLP (0: none)."
    )
    bias: bool = Field(True, description="Biases in the Linear and LayerNorm layers.")
    tie_embeddings: bool = Field(
        True,
        description="The head shares the token embedding's weights, as in GPT-2. Pipeline parallelism "
        "(`strategy.pp` > 1) needs false: the embedding is on the first stage, the head on the last.",
    )

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelSection:
        if self.n_embd % self.n_head:
            raise ValueError(f"model.n_embd = {self.n_embd} must be a multiple of model.n_head = {self.n_head}")
        return self


class DataSection(Section):
    """The text the model learns."""

    text_path: InputPath | None = Field(
        None, description="A UTF-8 text file. null: Python's own help texts (pydoc_data), installed with Python."
    )


class Config(BaseConfig):
    pipeline: Literal["gpt"] = "gpt"
    model: ModelSection = ModelSection()
    data: DataSection = DataSection()

    def eval_metrics(self) -> tuple[str, ...]:
        return ("loss", "bits_per_byte")

    def gives_tp_plan(self) -> bool:
        return True

    def gives_pp_stages(self) -> bool:
        return True

    @model_validator(mode="after")
    def _splits_into_stages(self) -> Config:
        """A pipeline's stages each take at least one block, and the head and the embedding,
        on the last and the first stage, are two parameters."""
        s, m = self.strategy, self.model
        if s.pp == 1:
            return self
        stages = s.pp * s.stages_per_rank
        if stages > m.n_layer:
            raise ValueError(
                f"strategy.pp = {s.pp}: {stages} pipeline stages for model.n_layer = {m.n_layer} blocks "
                "(each stage takes one or more)"
            )
        if m.tie_embeddings:
            raise ValueError(
                f"model.tie_embeddings = true with strategy.pp = {s.pp}: the embedding (first stage) and the head "
                "(last stage) would be one parameter on two stages; set model.tie_embeddings=false"
            )
        return self

    @model_validator(mode="after")
    def _splits_over_tp(self) -> Config:
        """Tensor parallelism gives each rank whole heads, a share of the vocabulary's rows and,
        with sequence parallelism, of each sample's tokens."""
        tp, m = self.strategy.tp_degree, self.model  # tp: auto tries only the degrees these allow
        for key, value, over in (
            ("model.n_head", m.n_head, True),
            ("model.vocab_size", m.vocab_size, True),
            ("model.block_size", m.block_size, self.strategy.sequence_parallel),
        ):
            if over and value % tp:
                raise ValueError(
                    f"strategy.tp = {tp}: does not divide {key} = {value}, which each rank takes a share of"
                )
        if self.strategy.tensor_parallel and m.dropout:
            raise ValueError(
                f"model.dropout = {m.dropout:g} with strategy.tp = {self.strategy.tp!r}: dropout's masks are not kept alike over "
                "the ranks of a tensor-parallel group yet; use 0"
            )
        return self


def build_model(m: ModelSection):
    import math

    import torch
    from torch import nn

    block = _block_class(m, _attention_class(m))  # one class each per model: its blocks share it

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte = nn.Embedding(m.vocab_size, m.n_embd)
            self.wpe = nn.Embedding(m.block_size, m.n_embd)
            self.drop = nn.Dropout(m.dropout)
            self.blocks = nn.ModuleList(block() for _ in range(m.n_layer))
            self.ln_f = nn.LayerNorm(m.n_embd, bias=m.bias)
            self.lm_head = nn.Linear(m.n_embd, m.vocab_size, bias=False)
            if m.tie_embeddings:
                self.lm_head.weight = self.wte.weight  # tied, as in GPT-2
            self.apply(self._init)
            for name, p in self.named_parameters():
                if name.endswith(("c_proj.weight", "mlp.2.weight")):  # residual outputs
                    nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * m.n_layer))

        @staticmethod
        def _init(module: nn.Module) -> None:
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, 0.0, 0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            pos = torch.arange(idx.shape[1], device=idx.device)
            x = self.drop(self.wte(idx) + self.wpe(pos))
            for b in self.blocks:
                x = b(x)
            return self.lm_head(self.ln_f(x))

    return GPT()


def _attention_class(m: ModelSection) -> type:
    import torch
    import torch.nn.functional as F
    from torch import nn

    class SelfAttention(nn.Module):
        # q, k and v apart (GPT-2 fuses them in one c_attn), so that tensor parallelism gives each
        # rank whole heads of each. A state dict with the fused c_attn still loads (_split_fused:
        # `raylane export`, MLflow's model); a run's checkpoint from before does not resume.
        def __init__(self) -> None:
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj = (nn.Linear(m.n_embd, m.n_embd, bias=m.bias) for _ in range(3))
            self.c_proj = nn.Linear(m.n_embd, m.n_embd, bias=m.bias)
            self.register_load_state_dict_pre_hook(_split_fused)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, _ = x.shape
            # -1 heads: this rank's own under tensor parallelism, all of them otherwise.
            q, k, v = (
                p(x).view(b, t, -1, m.n_embd // m.n_head).transpose(1, 2)
                for p in (self.q_proj, self.k_proj, self.v_proj)
            )
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=m.dropout if self.training else 0.0)
            return self.c_proj(y.transpose(1, 2).reshape(b, t, -1))

    return SelfAttention


def _block_class(m: ModelSection, attention: type) -> type:
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln_1 = nn.LayerNorm(m.n_embd, bias=m.bias)
            self.attn = attention()
            self.ln_2 = nn.LayerNorm(m.n_embd, bias=m.bias)
            self.mlp = nn.Sequential(
                nn.Linear(m.n_embd, 4 * m.n_embd, bias=m.bias),
                nn.GELU(),
                nn.Linear(4 * m.n_embd, m.n_embd, bias=m.bias),
                nn.Dropout(m.dropout),
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp(self.ln_2(x))

    return Block


def _split_fused(module, state: dict, prefix: str, *_: object) -> None:
    """A state dict from before q, k and v were split: its c_attn's rows are q's, k's and v's."""
    for kind in ("weight", "bias"):
        fused = state.pop(f"{prefix}c_attn.{kind}", None)
        if fused is not None:
            for name, part in zip(("q_proj", "k_proj", "v_proj"), fused.chunk(3), strict=True):
                state[f"{prefix}{name}.{kind}"] = part


def tp_plan(model, sequence_parallel: bool) -> dict:
    """Megatron's split (torchtitan's plan for a Llama block): q, k, v and the MLP's first layer
    by columns, the attention's and the MLP's outputs by rows, so each block costs two
    all-reduces; the embedding and the tied head by vocabulary rows. With sequence parallelism,
    the norms and the residual stream hold a share of the tokens, gathered before each
    attention and MLP (all-reduces become a reduce-scatter and an all-gather)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    tokens = Shard(1) if sequence_parallel else Replicate()  # (batch, sequence, width)
    plan = {
        "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=tokens),
        "blocks.*.attn.q_proj": ColwiseParallel(),
        "blocks.*.attn.k_proj": ColwiseParallel(),
        "blocks.*.attn.v_proj": ColwiseParallel(),
        "blocks.*.attn.c_proj": RowwiseParallel(output_layouts=tokens),
        "blocks.*.mlp.0": ColwiseParallel(),
        "blocks.*.mlp.2": RowwiseParallel(output_layouts=tokens),
        "lm_head": ColwiseParallel(input_layouts=tokens, output_layouts=Replicate()),
    }
    if sequence_parallel:
        gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        plan |= {
            "wpe": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0)),  # (sequence, width)
            "blocks.*.ln_1": SequenceParallel(),
            "blocks.*.ln_2": SequenceParallel(),
            "ln_f": SequenceParallel(),
            "blocks.*.attn": gather,
            "blocks.*.mlp": gather,
        }
    return plan


def flops_per_token(model, m: ModelSection) -> float:
    """PaLM's (and nanoGPT's) count, forward plus backward: 6N + 12·L·H·Q·T, with N all the
    parameters but the position embeddings and an untied token embedding (the tied one counts
    once, as the head: a lookup costs no FLOPs)."""
    n = sum(p.numel() for p in model.parameters()) - model.wpe.weight.numel()
    if not m.tie_embeddings:
        n -= model.wte.weight.numel()
    return 6 * n + 12 * m.n_layer * m.n_head * (m.n_embd // m.n_head) * m.block_size


def load_text(path: str | None) -> bytes:
    if path:
        from pathlib import Path

        return Path(path).expanduser().read_bytes()
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    return "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")


def build(cfg: Config):
    import torch
    import torch.nn.functional as F
    from torch.utils.data import Dataset

    from raylane import Pipeline

    m = cfg.model
    data = torch.frombuffer(bytearray(load_text(cfg.data.text_path)), dtype=torch.uint8)
    split = int(len(data) * (1 - HELD_OUT_FRACTION))

    class Windows(Dataset):
        """Non-overlapping windows of block_size bytes; the target is the window shifted by one."""

        def __init__(self, tokens: torch.Tensor) -> None:
            self.tokens = tokens

        def __len__(self) -> int:
            return max(0, (len(self.tokens) - 1) // m.block_size)

        def __getitem__(self, i: int):
            chunk = self.tokens[i * m.block_size : (i + 1) * m.block_size + 1].long()
            return chunk[:-1], chunk[1:]

    def loss_fn(logits, targets):
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    def eval_sums(logits, targets):
        # Summed over the batch of per-sample mean losses; the trainer divides by the samples.
        nats = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum") / m.block_size
        return {"loss": nats, "bits_per_byte": nats / torch.log(torch.tensor(2.0))}

    train_set, held_out = Windows(data[:split]), Windows(data[split:])
    if not len(train_set) or not len(held_out):
        from raylane import ConfigError

        raise ConfigError(f"model.block_size = {m.block_size}: longer than the text ({len(data)} bytes)")
    model = build_model(m)
    return Pipeline(
        model=model,
        train_set=train_set,
        eval_set=held_out,
        loss_fn=loss_fn,
        eval_sums=eval_sums,
        example_input=held_out[0][0][None],
        tokens_per_sample=m.block_size,
        flops_per_token=flops_per_token(model, m),
        tp_plan=tp_plan,
        pp_stages="auto",  # wte, wpe and the first blocks; ...; the last blocks, ln_f and lm_head
    )
