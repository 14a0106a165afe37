"""A conversation with a loaded model in the terminal: `slimtune chat`.

Two styles of prompt:
- chat: the turns so far go through the chat template that training used (chat.resolve_template:
  the run's data.chat_template, else the tokenizer's own, else slimtune's default), rendered up to
  the assistant's generation prompt and encoded as training encoded them (data.render_chat_prompt,
  data.encode_prompt). The oldest turns are left out when the conversation outgrows the model's
  positions.
- plain: each message goes to the model alone, as a prompt_response prompt did in training
  (data.encode_prompt): no template, no earlier turns.
`auto` takes plain for a run trained on prompt_response or text data and for a model without a
template of its own, else chat.

Answers stream to the output as they are decoded (transformers' TextStreamer); temperature 0 is
greedy decoding (inference.generation_settings).
"""

from __future__ import annotations

import contextlib
import sys
from typing import TextIO

import torch

from slimtune.data import dataset as data
from slimtune.serve import inference
from slimtune.errors import UserError

STYLES = ("auto", "chat", "plain")
EXIT_WORDS = ("exit", "quit", "/exit", "/quit")
RESET = "/reset"
PROMPT = ">>> "


def settle_style(source: inference.Source, tokenizer, asked: str = "auto", system: str | None = None) -> str:
    """The style `asked` for (auto: as the module docstring says); a system message needs chat."""
    style = asked
    if asked == "auto":
        trained = source.data.get("format")
        plain = trained in ("prompt_response", "text") or (trained != "chat" and not tokenizer.chat_template)
        style = "plain" if plain else "chat"
    if system and style != "chat":
        why = f"trained on {source.data['format']} data" if source.data.get("format") else "has no chat template"
        raise UserError(f"--system needs the chat style, and this model is prompted plainly (it {why}); add "
                        "--template chat to use a template.")
    return style


def refuse_undecodable(text: str, what: str) -> None:
    """Bytes that are not UTF-8 reach Python as lone surrogates (the command line's arguments, and
    input read with errors=surrogateescape), which no tokenizer takes: one sentence naming `what`."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        char = text[err.start]
        found = f"byte {ord(char) - 0xDC00:#04x}" if "\udc80" <= char <= "\udcff" else f"{char!a}"
        raise UserError(f"{what} is not UTF-8 text ({found} at character {err.start + 1}); send it as UTF-8.") from None


def _streamer(tokenizer, out: TextIO):
    """A TextStreamer writing to `out` (flushed at every piece), skipping the prompt."""
    from transformers import TextStreamer

    class Streamer(TextStreamer):
        def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
            out.write(text + ("\n" if stream_end else ""))
            out.flush()

    return Streamer(tokenizer, skip_prompt=True, skip_special_tokens=True)


class Conversation:
    def __init__(self, loaded: inference.Loaded, style: str, max_new_tokens: int, temperature: float,
                 system: str | None = None):
        self.loaded, self.style, self.max_new_tokens, self.temperature = loaded, style, max_new_tokens, temperature
        self.head = [{"role": "system", "content": system}] if system else []
        self.template = loaded.source.data.get("chat_template")
        self.turns: list[dict] = []  # the user and assistant turns so far (chat style)
        self.limit = inference.context_length(loaded.model)

    def reset(self) -> None:
        self.turns = []

    def prompt_ids(self, text: str) -> list[int]:
        """The token ids the model continues for the message `text` (prompt())."""
        return self.prompt(text)[0]

    def prompt(self, text: str) -> tuple[list[int], list[dict]]:
        """(the token ids the model continues for the message `text`, the earlier turns they hold): in
        the chat style the oldest pairs of turns are left out until the prompt leaves room for an
        answer; reply() forgets them once it answers (a message refused keeps every turn)."""
        tok = self.loaded.tokenizer
        if self.style == "plain":
            return data.encode_prompt(tok, text), self.turns
        turns = self.turns + [{"role": "user", "content": text}]
        while True:
            ids = data.encode_prompt(tok, data.render_chat_prompt(tok, self.head + turns, self.template))
            if self.limit is None or len(ids) < self.limit or len(turns) == 1:
                return ids, turns[:-1]
            turns = turns[2:]

    def reply(self, text: str, out: TextIO) -> str:
        """The model's answer to `text`, streamed to `out` as it is decoded; returned whole."""
        model, tok, device = self.loaded.model, self.loaded.tokenizer, self.loaded.device
        ids, kept = self.prompt(text)
        if not ids:  # a tokenizer that adds no bos, and nothing typed: no token to continue from
            raise UserError("the message is empty; type something for the model to answer.")
        room = self.max_new_tokens if self.limit is None else min(self.max_new_tokens, self.limit - len(ids))
        if room <= 0:
            raise UserError(f"the prompt is {len(ids)} tokens and the model takes at most {self.limit}; "
                            "send a shorter message.")
        from slimtune.step.precision import autocast_for

        settings = inference.generation_settings(model, tok, room, self.temperature)
        prompt = torch.tensor([ids], device=device)
        with torch.no_grad(), autocast_for(device, self.loaded.precision):
            out_ids = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                                     generation_config=settings, streamer=_streamer(tok, out))
        answer = tok.decode(out_ids[0, len(ids):], skip_special_tokens=True)
        if self.style == "chat":
            self.turns = kept + [{"role": "user", "content": text}, {"role": "assistant", "content": answer.strip()}]
        return answer


def interactive(talk: Conversation, out: TextIO, err: TextIO) -> None:
    """Read messages from the terminal (or piped input) until exit, Ctrl-D or Ctrl-C at the prompt.
    Ctrl-C while an answer streams stops that answer only."""
    if sys.stdin.isatty():
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401  (line editing and history for input())
    if hasattr(sys.stdin, "reconfigure"):  # bytes that are not UTF-8 are kept in their line and said
        sys.stdin.reconfigure(errors="surrogateescape")  # (a strict locale would end the loop in a traceback)
    err.write(f"{talk.style} style; {RESET} starts over, exit or Ctrl-D leaves.\n")
    while True:
        try:
            text = input(PROMPT).strip()
        except (EOFError, KeyboardInterrupt):
            out.write("\n")
            return
        if not text:
            continue
        if text.lower() in EXIT_WORDS:
            return
        if text == RESET:
            talk.reset()
            err.write("(the conversation starts over)\n")
            continue
        try:
            refuse_undecodable(text, "the message")
            talk.reply(text, out)
        except KeyboardInterrupt:
            out.write("\n")
            err.write("(answer stopped)\n")
        except UserError as error:  # a message too long for the model, or not UTF-8: the session goes on
            err.write(f"slimtune: {error}\n")
