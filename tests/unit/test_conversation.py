"""slimtune chat's conversation without a model: the prompt style, the turns kept, the terminal loop."""

import io
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from slimtune.serve import chat as conversation, inference
from slimtune.errors import UserError


def loaded(tokenizer, limit: int | None, data: dict | None = None):
    source = inference.Source(Path("run"), "lora run", Path("base"), data=data or {})
    model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=limit))
    return SimpleNamespace(tokenizer=tokenizer, model=model, source=source, device="cpu", precision="fp32")


def test_auto_style_follows_what_the_run_trained_on_else_the_tokenizer(tokenizer, monkeypatch):
    def source(fmt=None):
        return inference.Source(Path("x"), "model", Path("x"), data={"format": fmt} if fmt else {})

    assert conversation.settle_style(source("prompt_response"), tokenizer) == "plain"
    assert conversation.settle_style(source("text"), tokenizer) == "plain"
    assert conversation.settle_style(source("chat"), tokenizer) == "chat"
    assert conversation.settle_style(source(), tokenizer) == "plain"  # no template of its own
    monkeypatch.setattr(tokenizer, "chat_template", "{{ messages[0]['content'] }}")
    assert conversation.settle_style(source(), tokenizer) == "chat"
    assert conversation.settle_style(source("chat"), tokenizer, "plain") == "plain"
    with pytest.raises(UserError, match="--system needs the chat style"):
        conversation.settle_style(source("prompt_response"), tokenizer, system="be brief")


def test_the_prompt_holds_the_turns_so_far_and_forgets_the_oldest_when_too_long(tokenizer):
    turns = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"},
             {"role": "user", "content": "the quick brown fox"}, {"role": "assistant", "content": "jumps"}]
    talk = conversation.Conversation(loaded(tokenizer, None), "chat", 8, 0.0, system="Be terse.")
    talk.turns = list(turns)
    text = tokenizer.decode(talk.prompt_ids("bye"))
    assert text.endswith("<|system|>\nBe terse.\n<|user|>\nhello\n<|assistant|>\nhi</s><|user|>\nthe quick brown fox\n"
                         "<|assistant|>\njumps</s><|user|>\nbye\n<|assistant|>\n")
    assert talk.turns == turns  # the new message joins them only with its answer
    whole = len(talk.prompt_ids("bye"))
    talk.limit = whole - 1  # one token short: the oldest pair goes
    ids, kept = talk.prompt("bye")
    text = tokenizer.decode(ids)
    assert "hello" not in text and "Be terse." in text and "the quick brown fox" in text
    assert kept == turns[2:] and talk.turns == turns  # forgotten once answered (reply), not before
    plain = conversation.Conversation(loaded(tokenizer, None), "plain", 8, 0.0)
    plain.turns = list(turns)
    assert tokenizer.decode(plain.prompt_ids("bye")) == "bye"  # alone, as written


def test_a_prompt_without_room_for_an_answer_is_one_sentence_and_keeps_the_conversation(tokenizer):
    talk = conversation.Conversation(loaded(tokenizer, 4), "chat", 8, 0.0)
    with pytest.raises(UserError, match="the model takes at most 4"):
        talk.reply("the quick brown fox jumps over the lazy dog", io.StringIO())
    earlier = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]
    talk = conversation.Conversation(loaded(tokenizer, 40), "chat", 8, 0.0)
    talk.turns = list(earlier)
    with pytest.raises(UserError, match="the model takes at most 40"):  # the message alone is too long
        talk.reply("the quick brown fox jumps over the lazy dog " * 4, io.StringIO())
    assert talk.turns == earlier  # a refused message forgets nothing (it erased every earlier turn)


def test_an_empty_message_is_one_sentence_where_the_tokenizer_adds_no_bos(tokenizer, monkeypatch):
    talk = conversation.Conversation(loaded(tokenizer, None), "plain", 8, 0.0)
    monkeypatch.setattr(conversation.data, "encode_prompt", lambda tok, text: [])  # a Qwen-like tokenizer, ""
    with pytest.raises(UserError, match="the message is empty"):
        talk.reply("", io.StringIO())


class FakeTalk:
    style = "chat"

    def __init__(self):
        self.heard, self.resets = [], 0

    def reset(self):
        self.resets += 1

    def reply(self, text, out):
        self.heard.append(text)
        if text == "stop me":
            raise KeyboardInterrupt
        if text == "too long":
            raise UserError("the prompt is 9 tokens and the model takes at most 4; send a shorter message.")
        out.write(f"answer to {text}\n")


@pytest.mark.parametrize("ending", ["exit\nnot read\n", "QUIT\n", ""])
def test_the_terminal_loop_answers_until_exit_or_end_of_input(ending, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"one\n  \nstop me\ntoo long\n/reset\n two \n{ending}"))
    talk, out, err = FakeTalk(), io.StringIO(), io.StringIO()
    conversation.interactive(talk, out, err)
    assert talk.heard == ["one", "stop me", "too long", "two"] and talk.resets == 1
    assert "answer to one\n" in out.getvalue() and "answer to two\n" in out.getvalue()
    assert "(answer stopped)" in err.getvalue() and "slimtune: the prompt is 9 tokens" in err.getvalue()
