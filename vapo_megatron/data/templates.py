"""Prompt templates: a prompt record -> prompt token ids, with a Hugging Face tokenizer.

- ``dapo``: DAPO's instruction (DAPO-Math-17k, verl's ``recipe/dapo``). Chat-form rows of
  the published dataset already carry it in their user message, which is used as is; a plain
  ``{prompt, answer}`` row has its problem wrapped in it (``dapo_instruction``). The messages
  then go through the tokenizer's chat template when it has one (with the generation prompt);
  without one the user text is tokenized as a plain string with the tokenizer's usual special
  tokens (a BOS where it adds one), as vLLM does with a text prompt.
- ``chat``: the messages (or the text as one user message) through the chat template, with
  the generation prompt. A tokenizer without a chat template is an error.
- ``raw``: the text as is, without special tokens.

Records are duck-typed: anything with ``messages`` (a message list or None) and ``text``.
"""

from __future__ import annotations

from typing import Any

TEMPLATES = ("dapo", "chat", "raw")
"""Template names encode_prompt accepts."""

DAPO_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be "
    "of the form Answer: $Answer (without quotes) where $Answer is the answer to the problem."
    "\n\n"
)
"""What DAPO-Math-17k's user messages start with, before the problem."""
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'
"""What DAPO-Math-17k's user messages end with, after the problem."""


def dapo_instruction(problem: str) -> str:
    """The problem wrapped in DAPO's instruction, as DAPO-Math-17k's user messages read."""
    return f"{DAPO_PREFIX}{problem}{DAPO_SUFFIX}"


def check_template(template: str, tokenizer: Any) -> None:
    """Raises ValueError for an unknown template name, or 'chat' with no chat template."""
    if template not in TEMPLATES:
        raise ValueError(f"unknown prompt template {template!r}; choose one of {list(TEMPLATES)}")
    if template == "chat" and not _has_chat_template(tokenizer):
        raise ValueError(
            "prompt template 'chat' needs a tokenizer with a chat template, and this one has "
            "none; use template 'dapo' (falls back to plain text) or 'raw'"
        )


def encode_prompt(record: Any, tokenizer: Any, template: str) -> list[int]:
    """Prompt token ids of ``record`` under ``template`` (see the module doc)."""
    check_template(template, tokenizer)
    if template == "raw":
        return list(tokenizer(record.text, add_special_tokens=False)["input_ids"])
    if template == "dapo":
        if record.messages is None:
            messages = [{"role": "user", "content": dapo_instruction(record.text)}]
        else:
            messages = record.messages
        if not _has_chat_template(tokenizer):
            user_text = next(m["content"] for m in reversed(messages) if m["role"] == "user")
            return list(tokenizer(user_text)["input_ids"])
    else:
        messages = record.messages or [{"role": "user", "content": record.text}]
    token_ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return list(token_ids)


def _has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))
