"""Rows -> token ids and labels (raylane.hf.examples), with real tiny fast tokenizers whose real
Jinja chat templates come from two families (tests/helpers/hf_chat.py: ChatML, and Llama-2's
`[INST]`): the labels are checked token by token against each template's own rendering, the
answers located by an oracle that reads each family's syntax off the tokens (a separate way from
the module's incremental rendering)."""

from __future__ import annotations

import numpy as np
import pytest

from raylane.errors import ConfigError, DataError
from raylane.hf.examples import IGNORE, STYLES, Example, check_template, encode, style_of
from tests.helpers import hf_chat, hf_tiny

pytest.importorskip("transformers")

TEMPLATES = ("chatml", "inst")
# Each family's answer: the tokens after its opener, through its end-of-turn token.
OPENER = {"chatml": ["<|im_start|>", "assistant"], "inst": ["[/INST]"]}
END = {"chatml": "<|im_end|>", "inst": "</s>"}

THREE_TURNS = [
    {"role": "system", "content": "w3 w4"},
    {"role": "user", "content": "w5 w6 w7"},
    {"role": "assistant", "content": "w8 w9"},
    {"role": "user", "content": "w10"},
    {"role": "assistant", "content": "w11 w12 w13"},
    {"role": "user", "content": "w14 w15"},
    {"role": "assistant", "content": "w16"},
]


@pytest.fixture(params=TEMPLATES)
def family(request):
    return request.param, hf_chat.chat_tokenizer(request.param)


def answer_mask(tok, template: str, ids: list[int]) -> list[bool]:
    """The oracle: which tokens are an answer's, by the family's syntax read off the tokens."""
    tokens, opener, end = tok.convert_ids_to_tokens(ids), OPENER[template], END[template]
    mask, inside = [], False
    for i, token in enumerate(tokens):
        if not inside and tokens[max(0, i - len(opener) + 1) : i + 1] == opener:
            mask.append(False)
            inside = True
            continue
        mask.append(inside)
        inside = inside and token != end
    return mask


def spans(example: Example) -> list[list[int]]:
    """The runs of labelled tokens, in order."""
    runs: list[list[int]] = []
    for i, (token, label) in enumerate(zip(example.ids, example.labels, strict=True)):
        if label != IGNORE:
            assert label == token
            if i == 0 or example.labels[i - 1] == IGNORE:
                runs.append([])
            runs[-1].append(token)
    return runs


def words(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def contains(ids: list[int], part: list[int]) -> bool:
    return any(ids[i : i + len(part)] == part for i in range(len(ids) - len(part) + 1))


def test_three_turns_label_exactly_the_assistant_tokens_with_the_end_of_turn_token(family):
    template, tok = family
    example = encode({"messages": THREE_TURNS}, "messages", tok)
    assert example.ids == tok.apply_chat_template(THREE_TURNS, tokenize=True, return_dict=True)["input_ids"]
    labelled = [label != IGNORE for label in example.labels]
    assert labelled == answer_mask(tok, template, example.ids)
    end = tok.convert_tokens_to_ids(END[template])
    answers = [m["content"] for m in THREE_TURNS if m["role"] == "assistant"]
    assert spans(example) == [words(tok, a) + [end] for a in answers]
    assert example.answer_tokens == sum(labelled) == sum(len(words(tok, a)) + 1 for a in answers)
    unlabelled = [t for t, on in zip(example.ids, labelled, strict=True) if not on]
    for m in THREE_TURNS:
        if m["role"] != "assistant":
            assert contains(unlabelled, words(tok, m["content"])), m


def test_random_conversations_label_what_the_oracle_reads_in_both_families(family):
    template, tok = family
    for messages in hf_chat.conversations(40, seed=3):
        example = encode({"messages": messages}, "messages", tok)
        assert example.ids == tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
        assert [label != IGNORE for label in example.labels] == answer_mask(tok, template, example.ids)
        assert len(spans(example)) == sum(m["role"] == "assistant" for m in messages)


def test_plain_prompt_completion_labels_the_completion_and_eos():
    tok = hf_chat.chat_tokenizer("inst")
    example = encode(
        {"q": "w3 w4 w5", "a": "w6 w7"}, "prompt_completion", tok, columns={"prompt": "q", "completion": "a"}
    )
    eos = tok.eos_token_id
    assert example == Example([3, 4, 5, 6, 7, eos], [IGNORE] * 3 + [6, 7, eos], 3)


def test_conversational_prompt_completion_labels_the_completion_through_its_end_of_turn_token(family):
    template, tok = family
    prompt, completion = THREE_TURNS[:4], [{"role": "assistant", "content": "w20 w21 w22"}]
    example = encode({"prompt": prompt, "completion": completion}, "prompt_completion", tok)
    whole = tok.apply_chat_template(prompt + completion, tokenize=True, return_dict=True)["input_ids"]
    asked = tok.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert example.ids == whole
    assert example.labels == [IGNORE] * len(asked) + whole[len(asked) :]
    # The prompt's own answer (w8 w9) is the template's too, but not the completion: no label.
    mask = answer_mask(tok, template, whole)
    last = max(i for i, on in enumerate(mask) if on and not mask[i - 1])
    assert [label != IGNORE for label in example.labels] == [on and i >= last for i, on in enumerate(mask)]
    assert spans(example) == [words(tok, "w20 w21 w22") + [tok.convert_tokens_to_ids(END[template])]]


def test_loss_on_all_labels_every_token_and_text_ends_with_eos():
    tok = hf_chat.chat_tokenizer("chatml")
    rows = {
        "messages": {"messages": THREE_TURNS},
        "prompt_completion": {"prompt": THREE_TURNS[:2], "completion": THREE_TURNS[2:3]},
        "text": {"text": "w3 w9 w4"},
    }
    for style, row in rows.items():
        example = encode(row, style, tok, loss_on="all")
        assert example.labels == example.ids and example.answer_tokens == len(example.ids) > 0, style
    assert encode({"prompt": "w3", "completion": "w4"}, "prompt_completion", tok, loss_on="all").labels == [3, 4, 69]
    assert encode({"text": "w3 w9 w4"}, "text", tok) == Example([3, 9, 4, 69], [3, 9, 4, 69], 4)
    no_eos = hf_tiny.tokenizer(eos=False)
    assert encode({"body": "w3 w9"}, "text", no_eos, columns={"text": "body"}).ids == [3, 9]


def test_a_parquet_list_of_structs_reads_as_the_same_conversation():
    tok = hf_chat.chat_tokenizer("chatml")
    as_read = np.array([{**m, "tool_calls": None} for m in THREE_TURNS], dtype=object)  # pyarrow's struct rows
    assert encode({"messages": as_read}, "messages", tok) == encode({"messages": THREE_TURNS}, "messages", tok)


def test_a_conversation_without_an_answer_is_none():
    tok = hf_chat.chat_tokenizer("chatml")
    assert encode({"messages": THREE_TURNS[:2]}, "messages", tok) is None
    assert encode({"messages": []}, "messages", tok, loss_on="all") is None


@pytest.mark.parametrize(
    ("style", "row", "column", "says"),
    [
        ("messages", {"conv": [{"role": "robot", "content": "w3"}]}, "conv", "message 0's role 'robot' is none of"),
        ("messages", {"conv": "w3 w4"}, "conv", "expected a list of {role, content} messages, not a string"),
        ("messages", {"conv": [{"role": "user", "content": 5}]}, "conv", "message 0's content is a number"),
        ("messages", {"conv": ["w3"]}, "conv", "message 0 is a string, not a {role, content} object"),
        ("messages", {"other": []}, "conv", "each row needs its messages"),
        ("prompt_completion", {"prompt": "w3", "completion": THREE_TURNS[2:3]}, "completion", "must be a string too"),
        (
            "prompt_completion",
            {"prompt": 3, "completion": "w4"},
            "prompt",
            "a string or a list of messages, not a number",
        ),
        ("prompt_completion", {"prompt": THREE_TURNS[1:2], "completion": []}, "completion", "has no messages"),
        ("text", {"text": ["w3"]}, "text", "expected a string, not a list"),
    ],
)
def test_a_malformed_row_is_a_data_error_naming_its_row_and_column(style, row, column, says):
    tok = hf_chat.chat_tokenizer("chatml")
    with pytest.raises(DataError) as caught:
        encode(row, style, tok, row_index=7, columns={"messages": "conv"})
    error = caught.value
    assert (error.row, error.rows, error.column) == (7, [7], column)
    assert says in str(error) and f"column {column!r}" in str(error) and "\n" not in str(error)


def test_a_template_that_refuses_a_row_is_a_data_error_naming_it():
    tok = hf_chat.chat_tokenizer("inst")
    twice = [
        {"role": "user", "content": "w3"},
        {"role": "user", "content": "w4"},
        {"role": "assistant", "content": "w5"},
    ]
    with pytest.raises(DataError, match="refused it: Conversation roles must alternate") as caught:
        encode({"messages": twice}, "messages", tok, row_index=2)
    assert (caught.value.row, caught.value.column, caught.value.key) == (2, "messages", "data.messages_column")


def test_a_template_that_rewrites_earlier_answers_is_refused_in_one_line():
    tok = hf_chat.chat_tokenizer("chatml")
    # Earlier answers shortened to their first word (as templates that drop a past turn's reasoning).
    tok.chat_template = hf_chat.CHATML.replace(
        "message['content'] + '<|im_end|>'",
        "(message['content'].split()[0] if message['role'] == 'assistant' and not loop.last "
        "else message['content']) + '<|im_end|>'",
    )
    assert encode({"messages": THREE_TURNS[:3]}, "messages", tok).answer_tokens == 3  # one answer: nothing rewritten
    with pytest.raises(
        DataError, match="renders the first 3 messages differently from the whole conversation"
    ) as caught:
        encode({"messages": THREE_TURNS}, "messages", tok)
    assert "\n" not in str(caught.value)


def test_style_of_resolves_auto_and_refuses_a_style_the_files_lack():
    assert style_of(["text", "messages"], "auto") == "messages"
    assert style_of(["prompt", "completion", "text"], "auto") == "prompt_completion"
    assert style_of(["prompt", "text"], "auto") == "text"
    assert style_of(["conv"], "auto", messages="conv") == "messages"
    assert style_of(["prompt", "completion"], "prompt_completion") == "prompt_completion"
    with pytest.raises(
        ConfigError, match=r"^data\.style = 'messages' needs the column 'messages': the files have text, label$"
    ):
        style_of(["text", "label"], "messages")
    with pytest.raises(
        ConfigError, match=r"^x\.style = 'prompt_completion' needs the column 'completion': the files have prompt$"
    ):
        style_of(["prompt"], "prompt_completion", key="x.style")
    assert style_of(["body"], "auto") == "text"  # the text column's own check names data.text_column
    with pytest.raises(ConfigError, match="not a style"):
        style_of(["text"], "chat")
    assert set(STYLES) == {"text", "messages", "prompt_completion"}


def test_check_template_refuses_a_tokenizer_without_one_only_where_a_template_is_needed():
    bare = hf_chat.chat_tokenizer(None)
    for style, conversational in (("messages", False), ("prompt_completion", True)):
        with pytest.raises(ConfigError, match=r"^data\.style = .* the tokenizer .* has none") as caught:
            check_template(bare, style, conversational, "data.style")
        assert "\n" not in str(caught.value)
    check_template(bare, "prompt_completion", False, "data.style")
    check_template(bare, "text", False, "data.style")
    check_template(hf_chat.chat_tokenizer("chatml"), "messages", False, "data.style")


def test_the_saved_chat_llama_loads_back_with_its_template_and_trains_on_an_example(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = hf_chat.llama(tmp_path / "chat", template="inst")
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert tok.chat_template == hf_chat.INST and model.config.vocab_size >= len(tok)
    example = encode({"messages": THREE_TURNS}, "messages", tok)
    assert example == encode({"messages": THREE_TURNS}, "messages", hf_chat.chat_tokenizer("inst"))
    loss = model(input_ids=torch.tensor([example.ids]), labels=torch.tensor([example.labels])).loss
    assert torch.isfinite(loss)
    lengths = [len(encode({"messages": m}, "messages", tok).ids) for m in hf_chat.conversations(50, seed=1)]
    assert min(lengths) < 40 < 150 < max(lengths)  # mixed lengths, for packing
    assert list(hf_chat.conversations(3, seed=1)) == list(hf_chat.conversations(3, seed=1))
