"""Hugging Face hub ids (`gpt2`, `org/name`) as `model.name_or_path` or `model.tokenizer_path`:
resolved through the Hugging Face cache (`HF_HOME`, `HF_HUB_CACHE`), as `from_pretrained` does,
to the snapshot folder the hub client keeps there.

A folder of that name wins over the id (raylane.paths keeps the id only where no folder is). A
complete snapshot in the cache is used as it is, with no request (a resume sees the same files);
otherwise, where the hub is reachable and `HF_HUB_OFFLINE` is not set, it is downloaded by the
hub client, once per cache: the driver's check downloads it before any worker starts, and
processes of another machine that fetch it at once take the client's lock on each file, one
downloading while the others wait for it (bounded by the client's own timeouts; a holder that
dies releases its lock), then find it cached. A rehearsal (`raylane check --world N`: raylane.config.shapes) fetches only
config.json and the tokenizer's files, and takes a snapshot of those alone. Not cached and not downloadable: one line naming
the key and the value, and how to fetch it beforehand.

The config then holds the snapshot's path. A process on another machine, whose cache lacks that
path, resolves it again by the repository and commit the path names (`models--org--name/
snapshots/<commit>`): every machine loads the same revision."""

from __future__ import annotations

import re
from pathlib import Path

from raylane.config import shapes_only
from raylane.paths import is_hub_id, is_uri

# What a model or a tokenizer needs from a repository: no other weight format (.bin, .h5, GGUF,
# ONNX), which a repository may hold beside its safetensors.
MODEL_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja"]
TOKENIZER_FILES = ["*.json", "*.txt", "*.model", "*.tiktoken", "*.jinja"]
_SNAPSHOT = re.compile(r"models--(?P<repo>[^/]+)/snapshots/(?P<commit>[0-9a-f]{40})/?$")


def local_folder(value: str, key: str, tokenizer: bool = False) -> str:
    """`value` as a local folder: itself when it exists (or is not a hub id, which the caller's
    checks then name), else the cached, or downloaded, snapshot of the hub id; ValueError (one
    line) when there is none. `tokenizer`: only a tokenizer's files are needed."""
    if not value or is_uri(value) or Path(value).exists():
        return value
    repo, revision = _reference(value)
    if repo is None:
        return value
    # A rehearsal (a build of shapes alone) reads config.json and the tokenizer: no weights fetched.
    light = tokenizer or shapes_only()
    found = _cached(repo, revision, tokenizer, light)
    if found is not None:
        return found
    shown = f"{key} = {value!r}"
    how = (
        f"fetch it where the hub is reachable (`hf download {repo}"
        + (f" --revision {revision}" if revision else "")
        + "`, into this machine's Hugging Face cache), or save_pretrained it into a folder and give that"
    )
    if _offline():
        raise ValueError(
            f"{shown}: no such folder, and the hub id {repo!r} is not in the Hugging Face cache "
            f"({_cache()}) while HF_HUB_OFFLINE is set: {how}"
        )
    from huggingface_hub import snapshot_download

    try:
        snapshot_download(
            repo, revision=revision, allow_patterns=TOKENIZER_FILES if light else MODEL_FILES, cache_dir=_cache()
        )
    except Exception as exc:  # noqa: BLE001 - whatever the hub client raises is this one line
        cause = exc.__cause__ or exc  # the request's own error, under the client's "not in the cache"
        reason = (str(cause).strip().splitlines() or [""])[0][:160]
        raise ValueError(
            f"{shown}: no such folder, and the hub id {repo!r} is not in the Hugging Face cache ({_cache()}) "
            f"and cannot be downloaded ({type(cause).__name__}: {reason}): {how}"
        ) from None
    found = _cached(repo, revision, tokenizer, light)
    if found is None:
        wanted = "tokenizer files" if tokenizer else "config.json" if light else "config.json and safetensors weights"
        raise ValueError(f"{shown}: the hub's {repo!r} has no {wanted} (raylane reads no other format): {how}")
    return found


def _reference(value: str) -> tuple[str | None, str | None]:
    """(repository, commit) that `value` names: a hub id (the newest revision), or a snapshot's
    path in another machine's cache (that commit); (None, None) for anything else."""
    if is_hub_id(value):
        return value, None
    match = _SNAPSHOT.search(value)
    if match is None:
        return None, None
    return match["repo"].replace("--", "/"), match["commit"]


def _cached(repo: str, revision: str | None, tokenizer: bool, light: bool) -> str | None:
    """The snapshot folder of the cache when it holds what a model (or a tokenizer; `light`: a
    model without its weights) needs."""
    from huggingface_hub import snapshot_download

    try:
        # `light`: the files it needs (the client calls a snapshot without its weights incomplete).
        patterns = TOKENIZER_FILES if light else None
        folder = snapshot_download(
            repo, revision=revision, local_files_only=True, allow_patterns=patterns, cache_dir=_cache()
        )
    except Exception:  # noqa: BLE001 - not cached, or an incomplete snapshot: not usable
        return None
    return folder if _complete(Path(folder), tokenizer, light) else None


def _complete(folder: Path, tokenizer: bool, light: bool = False) -> bool:
    from raylane.hf.files import weight_files

    has_tokenizer = (folder / "tokenizer.json").is_file() or (folder / "tokenizer_config.json").is_file()
    if tokenizer:
        return has_tokenizer
    return (folder / "config.json").is_file() and (light or bool(weight_files(folder)))


def _cache() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)
