"""The loop's count of padding (raylane.loop.steps.Throughput, MetricsWindow): a pipeline whose
rows hold padding says how many of a batch's tokens are data (Pipeline.real_tokens); each window
logs real tokens/s and its padding share, the result the launch's packing efficiency. Counted
on the host from the batches rank 0 trains on: no collective, no device sync."""

from __future__ import annotations

import torch

from raylane.loop.steps import MetricsWindow, Throughput


def _batch(rows: int, data: int) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.zeros(rows, 10, dtype=torch.long), "data": torch.tensor(data)}


def test_each_window_has_its_own_padding_share_and_the_launch_its_packing_efficiency():
    throughput = Throughput(tokens_per_sample=10, real_tokens=lambda b: b["data"])
    window = MetricsWindow(torch.device("cpu"))
    throughput.count([_batch(4, 30), _batch(4, 10)])  # 40 of 80 tokens are data
    first = window.metrics(8, 0.1, throughput, world_size=2)
    assert first["padding_share"] == 0.5
    assert first["real_tokens_per_s"] == first["tokens_per_s"] * 0.5
    window.reset()
    throughput.count([_batch(2, 20)])  # the next window: all data
    second = window.metrics(2, 0.1, throughput, world_size=2)
    assert second["padding_share"] == 0.0
    assert throughput.share() == 60 / 100  # the launch's, over every window


def test_a_pipeline_without_padding_reports_no_share():
    plain = Throughput(tokens_per_sample=10)
    plain.count([_batch(4, 30)])
    assert plain.share() is None and "padding_share" not in plain.rates(100.0, 1)
    joined = Throughput(tokens_per_sample=10, real_tokens=lambda b: None)  # rows of this kind hold none
    joined.count([_batch(4, 30)])
    assert joined.share() is None
    assert Throughput(tokens_per_sample=10).rates(100.0, 1) == {"tokens_per_s": 1000.0}
