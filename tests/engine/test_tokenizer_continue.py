"""A final assistant message (prefill) is continued, not closed: rendered as ``transformers``'
``apply_chat_template(continue_final_message=True)`` renders it, for the tiny checkpoint and SmolLM2."""

from __future__ import annotations

import pytest

from engine.errors import InvalidRequestError
from engine.gguf_loader import open_gguf, read_metadata
from engine.tokenizer import Tokenizer

PREFILLS = [
    [{"role": "user", "content": "Give me JSON"}, {"role": "assistant", "content": "{"}],
    [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Name a colour"},
        {"role": "assistant", "content": "The colour is "},
    ],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": [{"type": "text", "text": "Sure"}]}],
]


@pytest.mark.parametrize("conv", PREFILLS)
def test_tiny_template_continues_like_transformers(tiny_hf_dir, conv):
    from transformers import AutoTokenizer

    ours = Tokenizer.from_hf_folder(tiny_hf_dir)
    ref = AutoTokenizer.from_pretrained(str(tiny_hf_dir))
    text = ours.apply_chat_template(conv, add_generation_prompt=False, continue_final_message=True)
    flat = [{**m, "content": m["content"] if isinstance(m["content"], str) else "Sure"} for m in conv]
    expected = ref.apply_chat_template(flat, tokenize=False, continue_final_message=True)
    assert text == expected
    assert text.rstrip().endswith(flat[-1]["content"].strip())
    closed = ours.apply_chat_template(conv, add_generation_prompt=True)
    assert closed.startswith(text) and len(closed) > len(text)  # the closed turn adds an end of turn
    ids = ours.render_chat(conv, continue_final_message=True)
    assert ids == ours.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("conv", PREFILLS)
def test_smollm2_template_leaves_the_assistant_turn_open(smollm2_path, conv):
    ours = Tokenizer.from_gguf_metadata(read_metadata(open_gguf(smollm2_path)))
    text = ours.apply_chat_template(conv, add_generation_prompt=False, continue_final_message=True)
    final = conv[-1]["content"] if isinstance(conv[-1]["content"], str) else "Sure"
    assert text.rstrip().endswith("<|im_start|>assistant\n" + final.strip())
    assert "<|im_end|>" not in text[text.rindex("<|im_start|>assistant") :]  # the prefill stays open
    assert text.count("<|im_end|>") == text.count("<|im_start|>") - 1  # every earlier turn is closed


@pytest.mark.parametrize(
    "conv", [*PREFILLS, [{"role": "user", "content": "a"}, {"role": "assistant", "content": ' \n {"a": '}]]
)
def test_continued_text_is_the_final_content_the_continued_prompt_ends_with(tiny_hf_dir, conv):
    ours = Tokenizer.from_hf_folder(tiny_hf_dir)
    text = ours.apply_chat_template(conv, add_generation_prompt=False, continue_final_message=True)
    final = conv[-1]["content"] if isinstance(conv[-1]["content"], str) else "Sure"
    continued = ours.continued_text(conv)
    assert text.endswith(continued) and continued in (final.lstrip(), final.strip())


def test_a_final_message_the_template_does_not_render_verbatim_is_refused(tiny_hf_dir):
    ours = Tokenizer.from_hf_folder(tiny_hf_dir)
    with pytest.raises(InvalidRequestError):
        ours.apply_chat_template(
            [{"role": "user", "content": "a"}, {"role": "assistant", "content": "   "}],
            continue_final_message=True,
        )
