"""The shipped `hf` pipeline, counting each rank's reads of weight files: every weight file
transformers opens to load it (`safe_open` in transformers.modeling_utils: raylane.hf loads with
from_pretrained) appends a line to $RAYLANE_TEST_READS/rank<RANK>. Test-only: the counting is
this module's, not raylane's."""

from __future__ import annotations

import os
from pathlib import Path

from raylane.pipelines import hf


class Config(hf.Config):
    pipeline: str  # this file, not the shipped name


def build(cfg):
    import transformers.modeling_utils

    import raylane.hf

    real = transformers.modeling_utils.safe_open
    reads = Path(os.environ["RAYLANE_TEST_READS"]) / f"rank{os.environ.get('RANK', '0')}"

    def counted(filename, *args, **kwargs):
        with open(reads, "a") as f:
            f.write(f"{filename}\n")
        return real(filename, *args, **kwargs)

    reads.touch()
    transformers.modeling_utils.safe_open = counted
    return raylane.hf.pipeline(cfg)
