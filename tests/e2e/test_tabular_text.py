"""The two generic shipped pipelines on the user's own files, no Python written: `tabular` on a
Parquet file in an S3 bucket (moto's server on loopback), `text` on a local JSON Lines file."""

from __future__ import annotations

import io
import json

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from tests.conftest import cli_env, read_json


def _table(n: int, seed: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 3)) * [1.0, 50.0, 0.01]  # scales far apart: the pipeline standardizes
    label = (x[:, 0] + x[:, 1] / 50 > 0).astype(np.int64)
    return pa.table({"a": x[:, 0], "b": x[:, 1], "c": x[:, 2], "label": label})


def _put(s3: dict[str, str], key: str, table: pa.Table) -> None:
    fs = pafs.S3FileSystem(
        endpoint_override=s3["AWS_ENDPOINT_URL"], access_key="testing", secret_key="testing", region="us-east-1"
    )
    buffer = io.BytesIO()
    pq.write_table(table, buffer, row_group_size=256)
    with fs.open_output_stream(f"raylane/{key}") as out:
        out.write(buffer.getvalue())


def test_tabular_classifies_a_parquet_file_on_s3(run_cli, tmp_path, s3_endpoint):
    _put(s3_endpoint, "tables/train.parquet", _table(1024, 0))
    _put(s3_endpoint, "tables/eval.parquet", _table(256, 1))
    env = cli_env(tmp_path, **s3_endpoint)
    data = [
        "--set",
        "data.train=s3://raylane/tables/train.parquet",
        "--set",
        "data.eval=s3://raylane/tables/eval.parquet",
        "--set",
        "data.features=[a, b, c]",
        "--set",
        "data.target=label",
        "--set",
        "data.num_classes=2",
    ]
    bad = run_cli("check", "tabular", *data, "--set", "data.features=[a, nope]", env=env, name="bad")
    assert bad.wait(60) == 2
    assert "data.train = 's3://raylane/tables/train.parquet': no column 'nope'" in bad.output
    proc = run_cli(
        "train",
        "tabular",
        "--local",
        *data,
        "--set",
        "run.name=tab",
        "--set",
        "train.max_epochs=3",
        "--set",
        "mlflow.enabled=false",
        "--summary-json",
        "s.json",
        env=env,
    )
    assert proc.wait(120) == 0, proc.output
    s = read_json(tmp_path / "s.json")
    assert s["status"] == "FINISHED" and s["epochs"] == 3 and s["steps"] == 3 * 1024 // 64
    assert s["metrics"]["accuracy"] >= 0.9 and s["metrics"]["loss"] < 0.3


def test_text_learns_a_local_jsonl_file(run_cli, tmp_path):
    lines = [json.dumps({"body": f"the cat sat on the mat number {i % 7}. " * 2, "id": i}) for i in range(400)]
    (tmp_path / "train.jsonl").write_text("\n".join(lines[:360]) + "\n")
    (tmp_path / "eval.jsonl").write_text("\n".join(lines[360:]) + "\n")
    proc = run_cli(
        "train",
        "text",
        "--local",
        "--set",
        f"data.train={tmp_path / 'train.jsonl'}",
        "--set",
        f"data.eval={tmp_path / 'eval.jsonl'}",
        "--set",
        "data.format=json",
        "--set",
        "data.text_field=body",
        "--set",
        "model.block_size=32",
        "--set",
        "train.max_epochs=2",
        "--set",
        "run.name=txt",
        "--set",
        "mlflow.enabled=false",
        "--summary-json",
        "s.json",
    )
    assert proc.wait(180) == 0, proc.output
    s = read_json(tmp_path / "s.json")
    assert s["status"] == "FINISHED" and s["epochs"] == 2 and s["tokens_per_s"] > 0
    # From ln(256) = 5.5 nats per byte for a model that knows nothing, to a repetitive text learnt.
    assert s["metrics"]["loss"] < 2.0 and s["metrics"]["bits_per_byte"] < 3.0


def test_tabular_rejects_a_non_numeric_column_before_training(run_cli, tmp_path):
    (tmp_path / "pets.csv").write_text("a,b,label\n0.1,0.2,cat\n0.3,0.4,dog\n")
    proc = run_cli(
        "train",
        "tabular",
        "--local",
        "--set",
        f"data.train={tmp_path / 'pets.csv'}",
        "--set",
        "data.format=csv",
        "--set",
        "data.features=[a, b]",
        "--set",
        "mlflow.enabled=false",
    )
    assert proc.wait(60) == 2, proc.output
    assert proc.output.strip() == (
        f"raylane: invalid config: data.target: {tmp_path / 'pets.csv'} row 1, column "
        "'label' has 'cat'; expected a number (encode categories as numbers)"
    )
