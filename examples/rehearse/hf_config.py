"""A Hugging Face model from its config alone (a folder with config.json, no weights), for
`raylane check --world` (docs/scale.md, Rehearse at full size): the model built by transformers'
`from_config` on the meta device, with raylane.hf's tensor-parallel plan (transformers' own) and
pipeline stages, over a stand-in dataset of packed token rows (zeros: a rehearsal reads shapes,
not text). Not for training: there are no weights to start from and no text to learn.

    python make_configs.py                      # llama-2-7b/ and mixtral-8x7b/config.json
    raylane check llama.yaml --world 256 --nodes 32 --gpu H100
"""

from __future__ import annotations

from pydantic import Field

import raylane


class ModelSection(raylane.Section):
    config_dir: raylane.InputPath = Field(description="A folder holding a transformers config.json (no weights).")
    seq_len: int = Field(4096, ge=2, le=1_048_576, description="Tokens in one packed row.")
    rows: int = Field(1_000_000, ge=1, description="Rows of the stand-in dataset (its length is all a rehearsal reads).")


class Config(raylane.BaseConfig):
    model: ModelSection

    def gives_tp_plan(self) -> bool:
        return True

    def gives_pp_stages(self) -> bool:
        return True


def build(cfg: Config) -> raylane.Pipeline:
    import torch
    from torch.utils.data import Dataset

    from raylane.hf.build import flops_per_token
    from raylane.hf.pipeline_parallel import causal_lm_stages
    from raylane.hf.tensor_parallel import tp_plan
    from raylane.hf.weights import empty_model

    m = cfg.model
    model = empty_model(str(m.config_dir))  # on the meta device: shapes only

    class Rows(Dataset):
        def __len__(self) -> int:
            return m.rows

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            row = torch.zeros(m.seq_len, dtype=torch.long)
            return {"input_ids": row, "labels": row}

    return raylane.Pipeline(
        model=model,
        train_set=Rows(),
        example_input={"input_ids": torch.zeros(1, m.seq_len, dtype=torch.long)},
        tp_plan=tp_plan,
        pp_stages=causal_lm_stages(),
        tokens_per_sample=m.seq_len,
        flops_per_token=flops_per_token(model, m.seq_len),
    )
