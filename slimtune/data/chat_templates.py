"""Chat templates: which one applies, rendering, and where the assistant turns are.

The template is data.chat_template (Jinja text or a file path), else the tokenizer's own,
else DEFAULT_CHAT_TEMPLATE (documented in data/dataset.py's module docstring).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from slimtune.errors import UserError

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ '\\n' }}{{ message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% else %}{{ '\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{{ '\\n' }}{% endif %}"
)

_PROBE = "\x00slimtune-probe\x00"  # stands in for content to find where a first assistant turn starts


def resolve_template(tokenizer: Any, template: str | None) -> str:
    if template:
        if os.path.isfile(template):
            return Path(template).read_text(encoding="utf-8")
        if template.endswith((".jinja", ".j2")) or not any(mark in template for mark in ("{{", "{%", "{#")):
            # No Jinja in it: not a template's text (it would render every conversation the same) but a file's name.
            raise UserError(f"data.chat_template file '{template}' does not exist.")
        return template
    own = tokenizer.chat_template
    if isinstance(own, dict):  # named templates; 'default' is the conversational one
        own = own.get("default")
    return own or DEFAULT_CHAT_TEMPLATE


def render(tokenizer: Any, template: str, messages: list[dict], generation: bool, where: str) -> str:
    from jinja2 import TemplateError

    try:
        return tokenizer.apply_chat_template(
            messages, chat_template=template, add_generation_prompt=generation, tokenize=False
        )
    except TemplateError as err:
        raise UserError(f"{where}: the chat template failed ({err}).") from None


def assistant_spans(tokenizer: Any, template: str, messages: list[dict], where) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and its assistant turns as character spans: from the end of the
    prefix with the generation prompt to the end of the turn (content plus end-of-turn marker)."""
    full = render(tokenizer, template, messages, False, where())
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        through = render(tokenizer, template, messages[: i + 1], False, where())
        if i:
            before = render(tokenizer, template, messages[:i], True, where())
        else:  # apply_chat_template refuses an empty prefix; a probe turn shows where content starts
            probe = render(tokenizer, template, [{"role": "assistant", "content": _PROBE}], False, where())
            before = probe.split(_PROBE)[0] if _PROBE in probe else None
        if before is not None and full.startswith(through) and through.startswith(before):
            span = (len(before), len(through))
        else:
            # Templates that rewrite earlier turns break the prefix rule; fall back to the content.
            start = full.find(message["content"], spans[-1][1] if spans else 0)
            if start < 0:
                raise UserError(f"{where()}: the chat template does not write assistant message {i + 1} verbatim.")
            span = (start, start + len(message["content"]))
        spans.append(span)
    return full, spans
