"""One row of a data set -> one example's token ids and labels (-100 where there is no loss), in
the three styles of the `hf` pipeline's causal-lm data (TRL's four formats: `text`; `messages`;
`prompt` + `completion`, plain strings or lists of messages):

- text: the text's tokens (no special tokens added, as raylane.hf.data's plain text) and the
  tokenizer's EOS token when it has one; every token carries a label.
- messages: the conversation rendered by the tokenizer's own chat template. With
  `loss_on='answers'` exactly the tokens of each assistant turn carry labels, with whatever the
  template writes after the answer before the next message: its end-of-turn token (ChatML's
  `<|im_end|>`, Llama 3's `<|eot_id|>`, Llama 2's `</s>`), which the model must learn to emit to
  stop, as TRL's assistant_only_loss teaches it. The generation prompt (`<|im_start|>assistant`)
  does not: the user's side writes it.
- prompt_completion: plain, the prompt's tokens then the completion's and EOS, labels on the
  completion and EOS; conversational, the prompt rendered with the generation prompt, then the
  whole conversation, the completion's labels its tail after the prompt's rendering: the
  template's end-of-turn token included, and no EOS added (the template ends the turn, as TRL).

The answers are found in the template's own tokens, never by searching strings: for each
assistant turn i, the first i messages rendered with the generation prompt are a prefix P of the
whole rendering, and the first i+1 rendered without it a prefix Q; the answer is Q's tokens after
P's. This works with any template; transformers' `return_assistant_tokens_mask` instead needs
`{% generation %}` markers, which few published templates have (TRL ships patched copies of some
for that reason), and where they are, the template's author decides whether the end-of-turn token
is inside. The incremental way needs only that a template render a conversation's start the same
whether or not more follows; it is checked on every row, and a template that breaks it (one that
drops earlier answers' reasoning, or whose generation prompt differs from a rendered answer's
start) is a DataError saying so. A conversation of k answers is rendered 2k+1 times.

A row the template refuses (a Jinja exception: roles that must alternate), a malformed row (not a
list of {role, content} objects, an unknown role, content not a string, a prompt or completion
missing or of mixed kinds) is a DataError naming the row and column. A conversation without an
assistant turn is None: the caller counts it."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from raylane.errors import SKIP_HINT, ConfigError, DataError

STYLES = ("text", "messages", "prompt_completion")
ROLES = ("system", "user", "assistant", "tool")
LOSS_ON = ("answers", "all")
IGNORE = -100  # transformers' label for "no loss here"
FIELDS = ("messages", "prompt", "completion", "text")


def key_of(field: str) -> str:
    """The config key naming a field's column: what a DataError about that column names."""
    return f"data.{field}_column"


def style_of(
    columns: Sequence[str],
    style: str,
    *,
    messages: str = "messages",
    prompt: str = "prompt",
    completion: str = "completion",
    text: str = "text",
    key: str = "data.style",
) -> str:
    """`style` as configured ('auto' or one of STYLES) resolved against the files' columns: auto ->
    'messages' when the messages column is there, 'prompt_completion' when both prompt and
    completion are, else 'text' (whose column the caller checks). A style the columns do not hold
    -> ConfigError, one line naming
    `key`, the value and the columns the files have."""
    have = list(columns)
    needs = {"messages": [messages], "prompt_completion": [prompt, completion], "text": [text]}
    shown = ", ".join(have) or "none"
    if style == "auto":
        for found, wanted in needs.items():
            if all(c in have for c in wanted):
                return found
        return "text"  # its column's own check names data.text_column and what the files have
    if style not in needs:
        raise ConfigError(f"{key} = {style!r}: not a style; choose auto, {', '.join(STYLES)}")
    missing = [c for c in needs[style] if c not in have]
    if missing:
        raise ConfigError(
            f"{key} = {style!r} needs the column{'s' * (len(missing) > 1)} {', '.join(map(repr, missing))}: "
            f"the files have {shown}"
        )
    return style


def check_template(tok: Any, style: str, conversational: bool, key: str) -> None:
    """ConfigError (one line naming `key` and the tokenizer) when `style` needs a chat template
    (messages; prompt_completion whose values are message lists) and the tokenizer has none."""
    if style == "messages" or (style == "prompt_completion" and conversational):
        if not getattr(tok, "chat_template", None):
            what = "messages" if style == "messages" else "conversational prompts and completions"
            raise ConfigError(
                f"{key} = {style!r}: {what} are rendered by the tokenizer's chat template, and the tokenizer "
                f"{getattr(tok, 'name_or_path', '') or type(tok).__name__!r} has none (give model.tokenizer_path "
                "a tokenizer with one: its tokenizer_config.json's chat_template or a chat_template.jinja)"
            )


@dataclass(frozen=True)
class Example:
    ids: list[int]  # the whole example's tokens
    labels: list[int]  # same length; -100 where no loss
    answer_tokens: int  # tokens that carry a label


@dataclass(frozen=True)
class _Cell:
    """Where a value came from: what a DataError about it names."""

    field: str
    column: str
    row: int

    def error(self, value: Any, why: str, *, skippable: bool = True) -> DataError:
        """A bad row's error; `skippable`: one row's fault (not the template's, which every row meets)."""
        why += SKIP_HINT if skippable else ""
        return DataError(key_of(self.field), column=self.column, row=self.row, rows=[self.row], value=value, why=why)


def encode(
    row: Mapping[str, Any],
    style: str,
    tok: Any,
    *,
    loss_on: str = "answers",
    row_index: int = 0,
    columns: Mapping[str, str] | None = None,
) -> Example | None:
    """One row -> Example. `columns` maps 'messages'/'prompt'/'completion'/'text' to the file's
    column names (each its own name by default). None: a messages row with no assistant turn
    (the caller counts it; not fatal). A malformed row -> DataError naming the column and row."""
    if loss_on not in LOSS_ON:
        raise ValueError(f"loss_on = {loss_on!r}: choose {' or '.join(LOSS_ON)}")
    names = {field: field for field in FIELDS} | dict(columns or {})
    cells = {field: _Cell(field, names[field], row_index) for field in FIELDS}
    if style == "text":
        ids = _tokens(tok, _string(row, cells["text"])) + _eos(tok)
        return Example(ids, list(ids), len(ids))
    if style == "messages":
        cell = cells["messages"]
        return _conversation(tok, _messages(_value(row, cell), cell), loss_on, cell)
    if style == "prompt_completion":
        return _pair(tok, row, cells["prompt"], cells["completion"], loss_on)
    raise ValueError(f"style = {style!r}: one of {', '.join(STYLES)}")


def _conversation(tok: Any, messages: list[dict], loss_on: str, cell: _Cell) -> Example | None:
    answers = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not answers:
        return None
    ids = _render(tok, messages, False, cell, messages)
    if loss_on == "all":
        return Example(ids, list(ids), len(ids))
    labels = [IGNORE] * len(ids)
    for i in answers:
        start = _prefix(tok, messages[:i], True, ids, cell, messages)
        end = len(ids) if i + 1 == len(messages) else _prefix(tok, messages[: i + 1], False, ids, cell, messages)
        if end < start:
            why = _broken(tok, i + 1, "its answer renders shorter than its generation prompt")
            raise cell.error(messages, why, skippable=False)
        labels[start:end] = ids[start:end]
    return Example(ids, labels, len(ids) - labels.count(IGNORE))


def _pair(tok: Any, row: Mapping[str, Any], pcell: _Cell, ccell: _Cell, loss_on: str) -> Example:
    prompt, completion = _value(row, pcell), _value(row, ccell)
    if isinstance(prompt, str) and isinstance(completion, str):
        head, tail = _tokens(tok, prompt), _tokens(tok, completion) + _eos(tok)
        ids = head + tail
    elif _is_list(prompt) and _is_list(completion):
        asked, answered = _messages(prompt, pcell), _messages(completion, ccell)
        if not answered:
            raise ccell.error(completion, "the completion has no messages: it is the answer the loss is on")
        ids = _render(tok, asked + answered, False, ccell, completion)
        head_len = _prefix(tok, asked, True, ids, pcell, prompt)
        head, tail = ids[:head_len], ids[head_len:]
    else:
        for cell, value in ((pcell, prompt), (ccell, completion)):
            if not isinstance(value, str) and not _is_list(value):
                raise cell.error(value, f"expected a string or a list of messages, not {_kind(value)}")
        other = "a string" if isinstance(prompt, str) else "a list of messages"
        raise ccell.error(completion, f"the prompt is {other}: the completion must be {other} too")
    labels = ids if loss_on == "all" else [IGNORE] * len(head) + tail
    return Example(ids, list(labels), len(ids) - labels.count(IGNORE))


def _render(tok: Any, messages: list[dict], generation: bool, cell: _Cell, value: Any) -> list[int]:
    """The template's tokens for `messages`; its refusal (a Jinja exception, or a Python one from
    inside the template) as a DataError naming the row."""
    from jinja2 import TemplateError

    try:
        out = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation, return_dict=True)
    except (TemplateError, TypeError, ValueError, KeyError, IndexError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise cell.error(value, f"the chat template of {_name(tok)} refused it: {first}") from exc
    return [int(i) for i in out["input_ids"]]


def _prefix(tok: Any, part: list[dict], generation: bool, ids: list[int], cell: _Cell, value: Any) -> int:
    """The length of `part`'s rendering, checked to be a prefix of the whole rendering `ids`."""
    head = _render(tok, part, generation, cell, value)
    if ids[: len(head)] != head:
        after = "with the generation prompt" if generation else "as the conversation's start"
        why = _broken(tok, len(part), f"rendered {after}, they are not a prefix of the whole's tokens")
        raise cell.error(value, why, skippable=False)
    return len(head)


def _broken(tok: Any, n: int, what: str) -> str:
    return (
        f"the chat template of {_name(tok)} renders the first {n} messages differently from the whole "
        f"conversation ({what}: it rewrites earlier turns, as templates that drop earlier answers' "
        "reasoning do), so the answers' tokens cannot be told from its output"
    )


def _messages(value: Any, cell: _Cell) -> list[dict]:
    """A list of {role, content} objects (a JSON list, or the numpy array Parquet reads one as),
    each checked; keys with a null value (a Parquet struct's absent fields) are left out."""
    if not _is_list(value):
        raise cell.error(value, f"expected a list of {{role, content}} messages, not {_kind(value)}")
    out = []
    for i, message in enumerate(value.tolist() if hasattr(value, "tolist") else value):
        if not isinstance(message, Mapping):
            raise cell.error(message, f"message {i} is {_kind(message)}, not a {{role, content}} object")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise cell.error(message, f"message {i}'s role {role!r} is none of {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise cell.error(message, f"message {i}'s content is {_kind(content)}, not a string")
        out.append({k: v for k, v in message.items() if v is not None})
    return out


def _value(row: Mapping[str, Any], cell: _Cell) -> Any:
    value = row.get(cell.column)
    if value is None or (isinstance(value, float) and math.isnan(value)):
        raise cell.error(None, f"each row needs its {cell.field}")
    return value


def _string(row: Mapping[str, Any], cell: _Cell) -> str:
    value = _value(row, cell)
    if not isinstance(value, str):
        raise cell.error(value, f"expected a string, not {_kind(value)}")
    return value


def _tokens(tok: Any, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def _eos(tok: Any) -> list[int]:
    return [] if tok.eos_token_id is None else [int(tok.eos_token_id)]


def _is_list(value: Any) -> bool:
    return isinstance(value, (list, tuple)) or (hasattr(value, "tolist") and getattr(value, "ndim", 0) == 1)


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)) or (hasattr(value, "dtype") and getattr(value, "ndim", 1) == 0):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, Mapping):
        return "an object"
    if _is_list(value):
        return "a list"
    return "null" if value is None else f"a {type(value).__name__}"


def _name(tok: Any) -> str:
    return repr(getattr(tok, "name_or_path", "") or type(tok).__name__)
