"""The loss mask covers exactly the assistant turns (content and end-of-turn marker)."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from eaglewire.data.chat import TemplateError, tokenize_conversation
from eaglewire.data.conversations import normalize


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return AutoTokenizer.from_pretrained(tokenizer_dir)


def masked_text(tokenizer, tokens) -> str:
    ids = tokens.input_ids[tokens.loss_mask].tolist()
    return tokenizer.decode(ids)


def test_mask_covers_assistant_turns_only(tokenizer):
    messages = [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "It is 4."},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "It is 6."},
    ]
    tokens = tokenize_conversation(tokenizer, tokenizer.chat_template, messages, max_length=512)
    assert masked_text(tokenizer, tokens) == "It is 4.<|im_end|>\nIt is 6.<|im_end|>\n"
    # the default system prompt and the user turns are rendered but not trained
    full = tokenizer.decode(tokens.input_ids.tolist())
    assert "You are a helpful AI assistant named SmolLM" in full and "And 3+3?" in full


def test_truncation_keeps_mask_aligned(tokenizer):
    messages = [{"role": "user", "content": "Count."}, {"role": "assistant", "content": " ".join(map(str, range(200)))}]
    full = tokenize_conversation(tokenizer, tokenizer.chat_template, messages, max_length=10_000)
    cut = tokenize_conversation(tokenizer, tokenizer.chat_template, messages, max_length=40)
    assert len(cut.input_ids) == 40
    assert cut.input_ids.tolist() == full.input_ids[:40].tolist()
    assert cut.loss_mask.tolist() == full.loss_mask[:40].tolist()
    assert cut.loss_mask.any() and not cut.loss_mask[:10].any()


def test_template_that_is_not_prefix_stable_is_refused(tokenizer):
    # renders the last message first: prefixes of the conversation do not render as prefixes
    template = "{% for m in messages|reverse %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    with pytest.raises(TemplateError, match="not prefixes"):
        tokenize_conversation(tokenizer, template, messages, max_length=64)


def test_normalize_formats_and_errors():
    sharegpt = {"conversations": [{"from": "gpt", "value": "orphan"}, {"from": "human", "value": "q"},
                                  {"from": "gpt", "value": "a"}]}
    assert normalize(sharegpt) == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    openai = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                           {"role": "assistant", "content": "a"}]}
    assert [m["role"] for m in normalize(openai)] == ["system", "user", "assistant"]
    for bad, message in [
        ([], "JSON object"),
        ({"text": "x"}, "'conversations' or 'messages'"),
        ({"conversations": []}, "empty"),
        ({"conversations": [{"from": "robot", "value": "x"}]}, "unknown role 'robot'"),
        ({"conversations": [{"from": "human", "value": 3}]}, "must be a string"),
        ({"conversations": [{"from": "human", "value": "q"}]}, "no assistant turn"),
    ]:
        with pytest.raises(ValueError, match=message):
            normalize(bad)
