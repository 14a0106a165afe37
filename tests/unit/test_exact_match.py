"""Exact match (scoring.exact_match, `slimtune eval`'s and the demo's measure) compares the greedy
answer with the reference as written: only the white space around both is stripped (its documented
normalisation), so an answer that differs from its reference in case alone is no match."""

import pytest
import torch

from slimtune.serve import inference, evaluate as scoring

CPU = torch.device("cpu")
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def answered(tiny_model_dir, tokenizer):
    """The tiny model, and a prompt whose greedy answer holds a letter that has another case."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    for prompt in ("question: what is two plus two? answer:", "hello world", "the quick brown fox"):
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        answer = inference.greedy_answers(model, tokenizer, CPU, [ids], NEW_TOKENS)[0].strip()
        if answer.swapcase() != answer:
            return model, tokenizer, ids, answer
    pytest.fail("no prompt's greedy answer has a cased letter")


def test_an_answer_that_differs_only_in_case_is_no_match_and_surrounding_space_is_stripped(answered):
    model, tokenizer, ids, answer = answered

    def rate(reference: str) -> float:
        return scoring.exact_match(model, tokenizer, CPU, [(ids, reference)], max_new_tokens=NEW_TOKENS)

    assert rate(answer) == 1.0
    assert rate(f" \n{answer}\t ") == 1.0  # the documented normalisation: surrounding white space
    recased = {answer.swapcase(), answer.upper(), answer.lower(), answer.capitalize()} - {answer}
    assert recased  # the fixture chose an answer with a cased letter
    assert {reference: rate(reference) for reference in recased} == {reference: 0.0 for reference in recased}


def test_an_empty_prompt_is_answered_empty_beside_the_others_and_not_generated(answered):
    """A prompt field "" with a tokenizer that adds no bos (Qwen's) leaves no token to continue from:
    generation raised on it (a batch of width 0, or an empty row beside others); its answer is empty
    and every other prompt in its batch is answered as alone."""
    model, tokenizer, ids, answer = answered
    answers = inference.greedy_answers(model, tokenizer, CPU, [[], ids, []], NEW_TOKENS, batch_size=2)
    assert answers[0] == answers[2] == "" and answers[1].strip() == answer
    assert inference.greedy_answers(model, tokenizer, CPU, [[]], NEW_TOKENS) == [""]
    assert scoring.exact_match(model, tokenizer, CPU, [([], "4"), (ids, answer)], max_new_tokens=NEW_TOKENS) == 0.5
