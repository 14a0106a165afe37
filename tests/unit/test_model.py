"""The Stack view reproduces the HF model for every supported family, and packed rows
equal their examples run one by one."""

import pytest
import torch

from conftest import save_tiny_model
from slimtune.errors import UserError
from slimtune.model import Stack, load_model, read_config

FAMILIES = [
    ("llama", {}),
    ("llama", {"tie_word_embeddings": True, "num_key_value_heads": 1, "attention_bias": True,
               "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}),
    ("mistral", {"sliding_window": 4}),
    ("qwen2", {"tie_word_embeddings": True}),
    ("qwen3", {"num_key_value_heads": 1}),
]


@pytest.mark.parametrize("family, overrides", FAMILIES, ids=lambda v: v if isinstance(v, str) else "")
def test_stack_equals_hf_forward(tmp_path, tokenizer, family, overrides):
    folder = save_tiny_model(tmp_path, tokenizer, family, **overrides)
    model = load_model(folder, torch.float64, torch.device("cpu"))
    stack = Stack(model)
    assert stack.tied == bool(overrides.get("tie_word_embeddings", False))
    ids = torch.randint(3, len(tokenizer), (2, 10))
    positions = torch.arange(10).expand(2, 10)
    want = model(input_ids=ids).logits
    got = stack.head(stack.final_hidden(ids, positions))
    torch.testing.assert_close(got, want, atol=1e-10, rtol=0)


@pytest.mark.parametrize("family, overrides", FAMILIES, ids=lambda v: v if isinstance(v, str) else "")
def test_block_halves_compose_to_the_block(tmp_path, tokenizer, family, overrides):
    """attention_half then mlp_half (by token slices too: the MLP is per token) is run_block."""
    model = load_model(save_tiny_model(tmp_path, tokenizer, family, **overrides), torch.float64, torch.device("cpu"))
    stack = Stack(model)
    ids = torch.randint(3, len(tokenizer), (2, 10))
    hidden = stack.embed(ids)
    inputs = stack.prepare(hidden, torch.arange(10).expand(2, 10))
    for index in range(len(stack.blocks)):
        want = stack.run_block(index, hidden, inputs)
        half = stack.attention_half(index, hidden, inputs)
        got = torch.cat([stack.mlp_half(index, half[:, a : a + 3]) for a in range(0, 10, 3)], dim=1)
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
        hidden = want


def test_unsegmented_rows_build_no_mask_and_equal_the_masked_path(tiny_model_dir):
    stack = Stack(load_model(tiny_model_dir, torch.float64, torch.device("cpu")))
    ids = torch.randint(3, stack.config.vocab_size, (2, 9))
    positions = torch.arange(9).expand(2, 9)
    hidden = stack.embed(ids)
    assert stack.prepare(hidden, positions, segmented=False).masks["full_attention"] is None
    torch.testing.assert_close(stack.body_hidden(ids, positions, segmented=False),
                               stack.body_hidden(ids, positions, segmented=True), atol=1e-12, rtol=0)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_packed_row_equals_examples_alone(tmp_path, tokenizer, family):
    model = load_model(save_tiny_model(tmp_path, tokenizer, family), torch.float64, torch.device("cpu"))
    stack = Stack(model)
    first, second = torch.randint(3, len(tokenizer), (1, 5)), torch.randint(3, len(tokenizer), (1, 7))
    packed = torch.cat([first, second], dim=1)
    positions = torch.cat([torch.arange(5), torch.arange(7)]).unsqueeze(0)
    got = stack.final_hidden(packed, positions)
    alone = [stack.final_hidden(x, torch.arange(x.shape[1]).unsqueeze(0)) for x in (first, second)]
    torch.testing.assert_close(got, torch.cat(alone, dim=1), atol=1e-10, rtol=0)
    # without the restart the second example would see the first: the mask matters
    leaky = stack.final_hidden(packed, torch.arange(12).unsqueeze(0))
    assert (leaky[:, 5:] - got[:, 5:]).abs().max() > 1e-4


def test_unsupported_family_is_refused_by_name(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(UserError, match="model_type 'gpt2' .* is not supported; supported: llama"):
        read_config(tmp_path)


def test_pickle_only_weights_are_refused(tmp_path, tokenizer):
    folder = save_tiny_model(tmp_path, tokenizer)
    for f in folder.glob("*.safetensors"):
        f.rename(folder / "pytorch_model.bin")
    with pytest.raises(UserError, match="no \\*.safetensors weights .*found pytorch_model.bin"):
        load_model(folder, torch.float32, torch.device("cpu"))


def test_missing_folder(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        read_config(tmp_path / "nope")


def test_build_order_is_asserted(tiny_model_dir):
    stack = Stack(load_model(tiny_model_dir, torch.float32, torch.device("cpu")))
    stack.advance("adapters")
    with pytest.raises(AssertionError, match="build stage 'quant' after 'adapters'"):
        stack.advance("quant")
