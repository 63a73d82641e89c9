"""Hub ids as `model.name_or_path` and `model.tokenizer_path` (raylane.hf.hub): resolved through
the Hugging Face cache as huggingface_hub's own client writes it. The Hub cannot be reached from
here: a local HTTP server stands in for it (tests/helpers/fake_hub.py), its address given to the
client as HF_ENDPOINT would (the client's constants, set here in-process); everything else is
the real client, cache and model."""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from raylane import cli  # noqa: E402
from raylane.config import ConfigError, load_config  # noqa: E402
from raylane.hf.weights import empty_model, load_pretrained  # noqa: E402
from raylane.loop.distributed.fsdp import materialize  # noqa: E402
from tests.helpers.fake_hub import FakeHub  # noqa: E402
from tests.helpers.hf_lm import make_base  # noqa: E402


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache of the test's own, online, the working directory tmp_path."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_PROGRESS_BARS", True, raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.jsonl").write_text(json.dumps({"text": "w3 w4 w5"}) + "\n")
    return tmp_path / "hf-cache"


def _serve(monkeypatch, hub: FakeHub) -> None:
    """The client pointed at `hub`, as HF_ENDPOINT would point it (read at its import)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub.url + "/{repo_id}/resolve/{revision}/{filename}")


def _offline(monkeypatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


def _config(name_or_path: str, **model):
    return load_config(
        # seq_len within the tiny model's 64 positions (checked before start).
        {
            "pipeline": "hf",
            "model": {"name_or_path": name_or_path, "seq_len": 32, **model},
            "data": {"train": "train.jsonl"},
        }
    )


def test_a_hub_id_is_downloaded_once_into_the_cache_and_then_loads_offline(tmp_path, cache, monkeypatch):
    """`org/tiny` (a model and its tokenizer) and `org/tok` (a tokenizer alone): two resolutions
    at once download each file once (the second waits on the cache's lock, then finds it there),
    into the cache's own layout (blobs, snapshots/<commit>, refs/main); then, offline with the hub
    gone, the config check resolves both from the cache and the model raylane builds and loads
    from it has from_pretrained's weights. Before, the id was a relative path: "not a model
    directory"."""
    from huggingface_hub import scan_cache_dir
    from transformers import AutoModelForCausalLM

    from raylane.hf.hub import local_folder

    make_base(tmp_path / "repo", seed=3)
    make_base(tmp_path / "tok-repo", seed=4)
    for weights in [*(tmp_path / "tok-repo").glob("*.safetensors"), tmp_path / "tok-repo" / "config.json"]:
        weights.unlink()
    with FakeHub({"org/tiny": tmp_path / "repo", "org/tok": tmp_path / "tok-repo"}) as hub:
        _serve(monkeypatch, hub)
        found: list[str] = []
        fetch = [  # as two processes of a machine would (the lock is the cache's file lock)
            threading.Thread(target=lambda: found.append(local_folder("org/tiny", "model.name_or_path")))
            for _ in range(2)
        ]
        for thread in fetch:
            thread.start()
        for thread in fetch:
            thread.join(120)
        assert len(found) == 2 and found[0] == found[1]
        assert _config("org/tiny", tokenizer_path="org/tok").model.name_or_path == found[0]
        downloads = dict(hub.downloads)
    assert set(downloads.values()) == {1}, downloads
    assert "org/tiny/model.safetensors" in downloads and "org/tok/tokenizer.json" in downloads
    repos = {r.repo_id: r for r in scan_cache_dir(cache).repos}
    assert set(repos) == {"org/tiny", "org/tok"}
    commit = (cache / "models--org--tiny" / "refs" / "main").read_text()
    snapshot = cache / "models--org--tiny" / "snapshots" / commit
    assert found[0] == str(snapshot)

    _offline(monkeypatch)
    cfg = _config("org/tiny", tokenizer_path="org/tok")  # no hub: a request would fail
    assert cfg.model.name_or_path == str(snapshot)
    assert cfg.model.tokenizer_path == str(next((cache / "models--org--tok" / "snapshots").iterdir()))
    model = materialize(empty_model(cfg.model.name_or_path), torch.device("cpu"))
    load_pretrained(model, cfg.model.name_or_path)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "repo", dtype=torch.float32).state_dict()
    assert all(torch.equal(value, reference[key]) for key, value in model.state_dict().items())


def test_a_snapshot_path_of_another_machines_cache_resolves_to_the_same_commit_in_this_one(
    tmp_path, cache, monkeypatch
):
    """The config carries the driver's snapshot path to every worker; a machine whose cache is
    elsewhere resolves the repository and commit that path names in its own cache."""
    make_base(tmp_path / "repo")
    with FakeHub({"org/tiny": tmp_path / "repo"}) as hub:
        _serve(monkeypatch, hub)
        here = _config("org/tiny").model.name_or_path
    _offline(monkeypatch)
    commit = here.rsplit("/", 1)[1]
    there = f"/elsewhere/hf/hub/models--org--tiny/snapshots/{commit}"
    assert _config(there).model.name_or_path == here


def test_a_relative_folder_named_like_a_hub_id_wins_over_the_id(tmp_path, cache, monkeypatch):
    """In a config file, `org/tiny` is the folder beside the file where there is one (as every
    input path is); the id only where no such folder is."""
    make_base(tmp_path / "project" / "org" / "tiny")
    (tmp_path / "project" / "train.jsonl").write_text(json.dumps({"text": "w3"}) + "\n")
    (tmp_path / "project" / "cfg.yaml").write_text(
        "pipeline: hf\nmodel: {name_or_path: org/tiny, seq_len: 32}\ndata: {train: train.jsonl}\n"
    )
    _offline(monkeypatch)
    assert load_config(tmp_path / "project" / "cfg.yaml").model.name_or_path == str(tmp_path / "project/org/tiny")
    with pytest.raises(ConfigError, match="the hub id 'org/tiny' is not in the Hugging Face cache"):
        _config("org/tiny")  # from the working directory, which has no such folder


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("hub", ["offline", "unreachable"])
def test_a_hub_id_not_in_the_cache_and_not_downloadable_is_refused_in_one_line(
    cache, monkeypatch, capsys, no_work, hub
):
    """Exit 2 before anything starts, one line naming the key, the value and how to fetch it:
    with HF_HUB_OFFLINE set, and online with no hub answering (a closed port)."""
    if hub == "offline":
        _offline(monkeypatch)
        why = "while HF_HUB_OFFLINE is set"
    else:
        url = f"http://127.0.0.1:{_closed_port()}"
        from huggingface_hub import constants

        monkeypatch.setattr(constants, "ENDPOINT", url)
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", url + "/{repo_id}/resolve/{revision}/{filename}")
        why = "and cannot be downloaded ("
    assert cli.main(["check", "hf", "--set", "model.name_or_path=org/absent", "--set", "data.train=train.jsonl"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1, err
    assert err.startswith(
        "raylane: invalid config: model.name_or_path = 'org/absent': no such folder, and the hub id 'org/absent' is not in the "
        f"Hugging Face cache ({cache})"
    ), err
    assert why in err and "fetch it where the hub is reachable (`hf download org/absent`" in err, err


def test_a_rehearsal_of_a_hub_id_fetches_its_config_and_tokenizer_not_its_weights(tmp_path, cache, monkeypatch):
    """Under `raylane check --world N` (raylane.config.shapes) the hub id resolves to a snapshot of
    config.json and the tokenizer, its weights never downloaded; a run's check then fetches them.
    Before, the rehearsal downloaded the safetensors too (a 7B model's 13 GB for a config's shapes)."""
    from raylane.config import for_shapes
    from raylane.hf.hub import local_folder

    make_base(tmp_path / "repo", seed=3)
    with FakeHub({"org/tiny": tmp_path / "repo"}) as hub:
        _serve(monkeypatch, hub)
        with for_shapes():
            light = local_folder("org/tiny", "model.name_or_path")
        assert not any(name.endswith(".safetensors") for name in hub.downloads), dict(hub.downloads)
        assert "org/tiny/config.json" in hub.downloads and "org/tiny/tokenizer.json" in hub.downloads
        assert not list(Path(light).glob("*.safetensors"))
        full = local_folder("org/tiny", "model.name_or_path")
        assert full == light and "org/tiny/model.safetensors" in hub.downloads, dict(hub.downloads)
