"""The config of a Hugging Face fine-tune (the shipped `hf` pipeline, and a user's pipeline built on
`raylane.hf.pipeline`), and its checks before anything starts. Importing it imports neither torch
nor transformers: a missing `raylane[hf]` is found with importlib.util.find_spec."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from raylane.config import BaseConfig, Section, shapes_only
from raylane.hf.files import AUTO_CLASSES, WEIGHTS, WEIGHTS_INDEX, weight_files  # noqa: F401 - theirs, used here too
from raylane.hf.lora import LoraSection
from raylane.hf.tasks import class_names, mapping
from raylane.paths import InputPaths, ModelPath

HF_PACKAGES = ("transformers", "tokenizers", "accelerate", "safetensors")


class ModelSection(Section):
    """The pretrained model and what it is fine-tuned for."""

    task: Literal["causal-lm", "sequence-classification"] = Field(
        "causal-lm",
        description="`causal-lm`: next-token prediction; `sequence-classification`: a class per text "
        "(with `data.label_column` and `num_labels`).",
    )
    name_or_path: ModelPath = Field(
        description="A folder written by `save_pretrained` (config.json and safetensors weights), or a Hugging "
        "Face hub id (`org/name`), read from the Hugging Face cache or downloaded into it."
    )
    tokenizer_path: ModelPath | None = Field(
        None, description="The tokenizer's `save_pretrained` folder, or a hub id. null: the model's."
    )
    seq_len: int = Field(
        256,
        ge=2,
        le=1_048_576,
        description="`causal-lm`: tokens in one packed sequence; `sequence-classification`: the longest input "
        "(longer ones are truncated). At most the model's positions (`max_position_embeddings`, `n_positions` "
        "for GPT-2) where its config declares them.",
    )
    num_labels: int = Field(
        2,
        ge=1,
        le=1_000_000,
        description="`sequence-classification`: the number of classes (labels are 0..num_labels-1); a model "
        "saved as a classifier has a head of its own size.",
    )


class MixSource(Section):
    """One source of a mixture (data.mix)."""

    train: InputPaths | None = Field(
        None,
        description="Its files, folders or globs, local or `s3://`, with the columns data.style reads. null: the "
        "`datasets.Dataset` a pipeline's own build(cfg) hands to `raylane.hf.pipeline(cfg, train={name: dataset})` "
        "under this source's `name`.",
    )
    weight: float = Field(gt=0, description="Its share of the examples drawn, relative to the others' weights.")
    name: str | None = Field(
        None,
        min_length=1,
        description="How the summary names it (default: `source N`); a source without `train`: the name of its "
        "dataset.",
    )


class DataSection(Section):
    """The text files a fine-tune reads, streamed and tokenized where they are read."""

    train: InputPaths | None = Field(
        None,
        description="Training files, folders or globs, local or `s3://`. null: the pipeline hands over a "
        "`datasets.Dataset`.",
    )
    eval: InputPaths | None = Field(None, description="Held-out files, folders or globs, with the same columns.")
    mix: list[MixSource] | None = Field(
        None,
        min_length=2,
        description="In place of data.train (`model.task: causal-lm`): sources drawn by weight at the example level "
        "(`[{train: chat/, weight: 0.8}, {train: code/, weight: 0.2}]`), each within one example of its share "
        "everywhere in the draw, the same at any world size and on resume. A source without `train` takes the "
        "`datasets.Dataset` of its `name` handed to `raylane.hf.pipeline(cfg, train={name: dataset})`. The sources "
        "are read whole into memory (docs/hf.md, Mixtures).",
    )
    mix_examples: int | None = Field(
        None, ge=1, description="data.mix: the examples an epoch draws; null: as many as the sources hold together."
    )
    format: Literal["parquet", "csv", "json", "text"] = Field(
        "json", description="The files' format (`json`: JSON Lines; `text`: one row per line)."
    )
    text_column: str = Field("text", min_length=1, description="The column holding the text.")
    label_column: str = Field("label", min_length=1, description="`sequence-classification`: the column of class ids.")
    shuffle_rows: int = Field(4096, ge=1, le=100_000_000, description="Rows in each rank's shuffle buffer.")
    style: Literal["auto", "text", "messages", "prompt_completion"] = Field(
        "auto",
        description="What a row holds (`model.task: causal-lm`): `text`; `messages`, a conversation (a list of "
        "{role, content}) rendered by the tokenizer's chat template; `prompt_completion`, a prompt and its "
        "completion, strings or message lists. `auto`: `messages` when the files have data.messages_column, "
        "`prompt_completion` when they have data.prompt_column and data.completion_column, else `text`.",
    )
    messages_column: str = Field("messages", min_length=1, description="`messages`: the column of conversations.")
    prompt_column: str = Field("prompt", min_length=1, description="`prompt_completion`: the prompts' column.")
    completion_column: str = Field(
        "completion", min_length=1, description="`prompt_completion`: the completions' column."
    )
    loss_on: Literal["answers", "all"] = Field(
        "answers",
        description="`messages` and `prompt_completion`: `answers`, the loss on the assistant's turns (with the "
        "template's end-of-turn token) or the completion only; `all`, on every token.",
    )
    packing: bool | None = Field(
        None,
        description="Examples packed into model.seq_len by best-fit decreasing, each document's attention and "
        "loss kept to itself (per-document position ids). null: on for `messages` and `prompt_completion`, off "
        "for `text` (documents joined end to end and cut, as before).",
    )
    document_mask: bool = Field(
        False,
        description="`text` joined and cut (data.packing off): each document's attention and loss kept to "
        "itself, as packing does.",
    )
    drop_cut: bool = Field(
        False,
        description="An example longer than model.seq_len is cut to it, and counted: `true` drops it instead "
        "(an answer cut away trains on what is left of it).",
    )
    skip_bad_rows: bool | int = Field(
        False,
        ge=0,
        description="Rows with a missing or null text or label, a text that is not a string or a label that is not "
        "a class id: `false` fails the run naming the first one's file, row and column; `true` skips them; N skips "
        "at most N in each of data.train and data.eval (more fails the run before its first step). The rows are "
        "counted before training; the summary's `skipped_rows` and the terminal give the count and the first one.",
    )


class Config(BaseConfig):
    """Subclass it in a pipeline of your own (docs/hf.md)."""

    model: ModelSection
    data: DataSection = DataSection()
    lora: LoraSection | None = Field(
        None,
        description="LoRA (peft) adapters, by default on the model's attention projections: `{r, alpha, "
        "dropout, target_modules}`. null: a full fine-tune.",
    )

    def gives_tp_plan(self) -> bool:
        return True  # the model's own (raylane.hf.tensor_parallel); one without is refused by _hf_is_usable

    def gives_pp_stages(self) -> bool:
        return True  # a causal LM's decoder layers (raylane.hf.pipeline_parallel); other tasks are refused by _hf_is_usable

    def gives_ep_plan(self) -> bool:
        return True  # the model's own (raylane.hf.experts); a dense model is refused by _hf_is_usable

    def eval_metrics(self) -> tuple[str, ...]:
        return ("loss", "accuracy") if self.model.task == "sequence-classification" else ("loss",)

    @model_validator(mode="after")
    def _hf_is_usable(self) -> Config:
        check_installed()
        check_model(self.model)
        if self.lora is not None:
            from raylane.hf.lora import check_lora

            check_lora(self.model.name_or_path, self.lora, AUTO_CLASSES[self.model.task])
        if self.strategy.tp_degree > 1:  # tp: auto is weighed at each degree by the same check
            check_tensor_parallel(self)
        if self.strategy.pp > 1:
            check_pipeline_parallel(self)
        if self.strategy.ep_degree > 1:  # ep: auto picks 1 for a dense model, a degree the experts allow
            from raylane.hf.experts import check_expert_parallel

            check_expert_parallel(self.model.name_or_path, self.strategy.ep_degree)
        check_mix(self)
        for field in ("train", "eval"):
            if getattr(self.data, field) is not None:
                check_columns(self, field)
        for i, source in enumerate(self.data.mix or ()):
            if source.train is not None:  # a dataset's columns are checked when it is handed in
                check_columns(self, "train", source.train, f"data.mix.{i}.train")
        check_style(self)
        return self


def check_tensor_parallel(cfg: Config) -> None:
    """`strategy.tp` > 1: the model (built on the meta device, with its adapter) has a plan of its
    own that raylane can lay out, whole heads on every rank, and no dropout on the adapter's input
    (its masks would differ over the ranks of a group, which see the same tokens)."""
    from raylane.hf.lora import apply_lora
    from raylane.hf.tensor_parallel import check_tp
    from raylane.hf.weights import empty_model

    m, tp = cfg.model, cfg.strategy.tp
    if cfg.lora is not None and cfg.lora.dropout:
        raise ValueError(
            f"lora.dropout = {cfg.lora.dropout:g} with strategy.tp = {tp}: dropout's masks are not kept alike over "
            "the ranks of a tensor-parallel group; use 0"
        )
    overrides: dict[str, Any] = {"num_labels": m.num_labels} if m.task == "sequence-classification" else {}
    model = empty_model(m.name_or_path, m.task, **overrides)
    if cfg.lora is not None:
        model = apply_lora(model, cfg.lora, base=str(m.name_or_path), key=None)
    check_tp(model, cfg.strategy.tp_degree, sequence_parallel=cfg.strategy.sequence_parallel)


def check_pipeline_parallel(cfg: Config) -> None:
    """`strategy.pp` > 1: a causal LM (with its adapter, built on the meta device) that splits into
    `pp x pp_stages_per_rank` stages of its decoder layers, its embeddings untied."""
    from raylane.hf.lora import apply_lora
    from raylane.hf.pipeline_parallel import check_pp
    from raylane.hf.weights import empty_model

    m, s = cfg.model, cfg.strategy
    if m.task != "causal-lm":
        raise ValueError(
            f"strategy.pp = {s.pp} with model.task = {m.task!r}: raylane.hf splits causal LMs into pipeline "
            "stages only; use strategy.pp: 1"
        )
    model = empty_model(m.name_or_path, m.task)
    if cfg.lora is not None:
        model = apply_lora(model, cfg.lora, base=str(m.name_or_path), key=None)
    try:
        check_pp(model, s.pp * s.stages_per_rank)
    except ValueError as exc:
        raise ValueError(f"strategy.pp = {s.pp}: {exc}") from None


def check_installed() -> None:
    missing = [p for p in HF_PACKAGES if importlib.util.find_spec(p) is None]
    if missing:
        raise ValueError(
            f"pipeline 'hf' needs raylane[hf] ({', '.join(missing)} not installed): pip install 'raylane[hf]'"
        )


def check_model(m: ModelSection) -> None:
    """The folder holds a model the task can load and its weights (a build of shapes alone, the
    rehearsal's, needs only its config.json), and the tokenizer's vocabulary fits the model's embedding."""
    from raylane.hf.hub import local_folder

    # A hub id becomes its snapshot in the Hugging Face cache, for every check and reader after this.
    m.name_or_path = local_folder(m.name_or_path, "model.name_or_path")
    if m.tokenizer_path is not None:
        m.tokenizer_path = local_folder(m.tokenizer_path, "model.tokenizer_path", tokenizer=True)
    key = f"model.name_or_path = {m.name_or_path!r}"
    folder = Path(m.name_or_path)
    if not (folder / "config.json").is_file():
        raise ValueError(f"{key}: not a model directory (no config.json; save_pretrained writes one)")
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{key}: config.json cannot be read ({exc})") from None
    weights = bool(weight_files(folder))
    if not weights and not shapes_only():  # a rehearsal builds the model from config.json alone
        raise ValueError(
            f"{key}: no weights (model.safetensors, or model.safetensors.index.json and its shards); a "
            "config.json alone is rehearsed by `raylane check --world N`, not trained"
        )
    _check_task(key, m.task, config.get("model_type"))
    _check_vocabulary(m, config)
    _check_positions(m, folder)
    if m.task == "sequence-classification":
        _check_head(m, config)
    _check_special_tokens(m)
    if not weights:
        return
    from raylane.hf.weights import check_weights

    overrides: dict[str, Any] = {"num_labels": m.num_labels} if m.task == "sequence-classification" else {}
    check_weights(folder, m.task, **overrides)


def _check_task(key: str, task: str, model_type: str | None) -> None:
    if model_type not in mapping(task):
        raise ValueError(f"{key}: a {model_type!r} model, which transformers cannot load for model.task = {task!r}")


def _check_positions(m: ModelSection, folder: Path) -> None:
    """model.seq_len within the positions the model's config declares (a learned position table
    indexes past its end: IndexError on the first forward); a model that declares none (rotary
    or relative positions without a maximum, a state-space model) has no limit."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(folder)
    text = config.get_text_config(decoder=True)
    positions = getattr(text, "max_position_embeddings", None)
    if not isinstance(positions, int) or positions <= 0 or m.seq_len <= positions:
        return
    # The config's own spelling of the figure (n_positions for GPT-2) through its attribute_map.
    name = type(text).attribute_map.get("max_position_embeddings", "max_position_embeddings")
    if text is not config:
        name = next((f"{k}.{name}" for k, v in vars(config).items() if v is text), name)
    raise ValueError(
        f"model.seq_len = {m.seq_len}: more than the model's {positions} positions ({name} in "
        f"{folder / 'config.json'}); set model.seq_len={positions} or lower"
    )


def _check_head(m: ModelSection, config: dict) -> None:
    """A checkpoint saved from a classifier holds its head, of the config's number of labels: a
    model.num_labels of another size cannot load it."""
    saved = [a for a in config.get("architectures") or () if a in class_names("sequence-classification")]
    labels = len(config["id2label"]) if isinstance(config.get("id2label"), dict) else config.get("num_labels")
    if saved and isinstance(labels, int) and labels != m.num_labels:
        raise ValueError(
            f"model.num_labels = {m.num_labels}: the model in {m.name_or_path!r} has a classification head "
            f"of {labels} labels (a {saved[0]}, says its config.json); set model.num_labels={labels}"
        )


def _check_special_tokens(m: ModelSection) -> None:
    """causal-lm ends each packed document with the tokenizer's EOS token (without one, documents
    would run into each other unmarked); sequence-classification pads batches with its pad token,
    else its EOS token (hf.data.pad_id), which the model also reads to find each text's end."""
    from transformers import AutoTokenizer

    where = m.tokenizer_path or m.name_or_path
    key = "model.tokenizer_path" if m.tokenizer_path else "model.name_or_path"
    try:
        tok = AutoTokenizer.from_pretrained(where)
    except (OSError, ValueError, ImportError) as exc:  # what the run's own load would meet
        first = (str(exc).strip().splitlines() or [""])[0]
        raise ValueError(
            f"{key} = {where!r}: transformers cannot load its tokenizer ({type(exc).__name__}: {first})"
        ) from None
    if m.task == "causal-lm" and tok.eos_token_id is None:
        raise ValueError(
            f"{key} = {where!r}: the tokenizer has no EOS token, which model.task = 'causal-lm' ends each "
            "document with; set one (tokenizer.eos_token = ...) and save_pretrained it"
        )
    if m.task == "sequence-classification" and tok.pad_token_id is None and tok.eos_token_id is None:
        raise ValueError(
            f"{key} = {where!r}: the tokenizer has neither a pad nor an EOS token, which model.task = "
            "'sequence-classification' pads batches with; set one (tokenizer.pad_token = ...) and save_pretrained it"
        )


def _check_vocabulary(m: ModelSection, config: dict) -> None:
    where = m.tokenizer_path or m.name_or_path
    key = f"model.tokenizer_path = {m.tokenizer_path!r}" if m.tokenizer_path else f"model.name_or_path = {where!r}"
    size = tokenizer_size(where)
    if size is None:
        raise ValueError(
            f"{key}: no tokenizer there (tokenizer.json or tokenizer_config.json; set model.tokenizer_path)"
        )
    vocab = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
    if vocab is not None and size > vocab:
        raise ValueError(
            f"{key}: the tokenizer has {size} tokens, more than the model's vocab_size {vocab} "
            f"(model.name_or_path = {m.name_or_path!r}): not this model's tokenizer"
        )


def tokenizer_size(path: str) -> int | None:
    """Tokens in the tokenizer saved in `path`, added ones included; None when there is none."""
    folder = Path(path)
    if (folder / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    if (folder / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        return len(AutoTokenizer.from_pretrained(path))
    return None


def check_style(cfg: Config) -> None:
    """data.style and what it needs: a causal LM; for `messages`, a tokenizer with a chat template;
    for packed or document-masked rows, a model whose attention keeps documents apart."""
    d, m = cfg.data, cfg.model
    if d.style not in ("auto", "text") and m.task != "causal-lm":
        raise ValueError(f"data.style = {d.style!r}: for model.task causal-lm; a classifier reads data.text_column")
    if d.style not in ("auto", "text") and d.format == "text":
        raise ValueError(f"data.style = {d.style!r}: data.format 'text' holds plain lines; use json or parquet")
    if d.style == "messages" and not shapes_only():
        from transformers import AutoTokenizer

        from raylane.hf.examples import check_template

        key = "model.tokenizer_path" if m.tokenizer_path else "model.name_or_path"
        check_template(AutoTokenizer.from_pretrained(str(m.tokenizer_path or m.name_or_path)), "messages", False, key)
    if m.task == "causal-lm" and (packed(d) or d.document_mask):
        from raylane.hf.packing import packable

        why = packable(m.name_or_path)
        if why is not None:
            setting = "data.packing = True" if packed(d) else "data.document_mask = True"
            raise ValueError(f"{setting}: {why}; set it false")


def packed(d: DataSection) -> bool:
    """Whether examples are packed: data.packing, or by default for the conversational styles."""
    return d.packing if d.packing is not None else d.style in ("messages", "prompt_completion")


def check_mix(cfg: Config) -> None:
    """data.mix: in place of data.train, for a causal LM; each source's files, or a dataset
    handed in under its name (matched when it is: raylane.hf.mixture.handed_datasets)."""
    d = cfg.data
    if d.mix is None:
        if d.mix_examples is not None:
            raise ValueError(f"data.mix_examples = {d.mix_examples}: for data.mix, which is not set")
        return
    if d.train is not None:
        raise ValueError(
            f"data.train = {d.train!r} with data.mix: the mixture's sources are the training data; give one"
        )
    if cfg.model.task != "causal-lm":
        raise ValueError(f"data.mix: for model.task causal-lm, not {cfg.model.task!r}")
    named: dict[str, int] = {}
    for i, source in enumerate(d.mix):
        if source.train is None and source.name is None:
            raise ValueError(
                f"data.mix.{i}: neither train (its files) nor name (the dataset of that name handed to "
                "raylane.hf.pipeline(cfg, train={name: dataset})): give one"
            )
        if source.name is not None and source.name in named:
            raise ValueError(f"data.mix.{i}.name = {source.name!r}: data.mix.{named[source.name]} has that name too")
        if source.name is not None:
            named[source.name] = i


def check_columns(cfg: Config, field: str, paths: Any = None, key: str | None = None) -> None:
    """The first file of data.<field> (or `paths`, named `key`) has the text column (and the label
    column for a classifier), or the columns of the style it resolves."""
    from raylane.loop.data import files

    d = cfg.data
    paths = getattr(d, field) if paths is None else paths
    key = key or f"data.{field}"
    fs, found = files.list_files(paths, d.format, key, True)
    names = files.schema_names(fs, found[0], d.format, key)
    if cfg.model.task == "causal-lm" and d.format != "text":
        from raylane.hf.examples import style_of

        try:
            style = style_of(
                names, d.style, messages=d.messages_column, prompt=d.prompt_column,
                completion=d.completion_column, text=d.text_column, key="data.style",
            )  # fmt: skip
        except ValueError as exc:
            raise ValueError(f"{exc} (in {found[0]}, {key})") from None
        d.style = style  # type: ignore[assignment]  # `auto` resolved once, by the training files: the held-out ones must agree
        if style != "text":
            return
    wanted = [("data.text_column", d.text_column)]
    if cfg.model.task == "sequence-classification":
        wanted.append(("data.label_column", d.label_column))
    for name, column in wanted:
        if column not in names:
            raise ValueError(f"{name} = {column!r}: no such column in {found[0]} ({key}; it has: {', '.join(names)})")
