"""Adapters round-trip through PEFT's format; merging leaves the function unchanged."""

import pytest
import torch
from torch import nn

from slimtune import export
from slimtune.model import lora
from slimtune.config import LoraConfig
from slimtune.model.stack import load_model

pytestmark = pytest.mark.quick  # the PEFT format and merging, cheap


def randomize_adapters(model):
    torch.manual_seed(1)
    for module in lora.adapters(model).values():
        nn.init.normal_(module.lora_B.weight, std=0.05)


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("targets", ["all-linear", ["q_proj", "v_proj"], ["model.layers.0.mlp.*"]])
def test_peft_loads_our_adapter_with_equal_logits(tmp_path, tiny_model_dir, targets):
    from peft import PeftModel

    ours = load_model(tiny_model_dir, torch.float32, torch.device("cpu"))
    lora.apply(ours, LoraConfig(rank=4, alpha=16, targets=targets))
    randomize_adapters(ours)
    folder = export.save_adapter(ours, LoraConfig(rank=4, alpha=16, targets=targets), str(tiny_model_dir),
                                 tmp_path / "adapter")
    base = load_model(tiny_model_dir, torch.float32, torch.device("cpu"))
    theirs = PeftModel.from_pretrained(base, str(folder))
    ids = torch.randint(3, 300, (2, 9))
    torch.testing.assert_close(logits(theirs, ids), logits(ours, ids), atol=1e-5, rtol=1e-5)
    # and the adapter changes the output, so the comparison means something
    plain = load_model(tiny_model_dir, torch.float32, torch.device("cpu"))
    assert (logits(plain, ids) - logits(ours, ids)).abs().max() > 1e-3


def test_we_load_an_adapter_peft_wrote(tmp_path, tiny_model_dir):
    from peft import LoraConfig as PeftLoraConfig, get_peft_model

    base = load_model(tiny_model_dir, torch.float32, torch.device("cpu"))
    theirs = get_peft_model(base, PeftLoraConfig(r=4, lora_alpha=8, target_modules=["k_proj", "down_proj"]))
    torch.manual_seed(2)
    for name, p in theirs.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(p, std=0.05)
    theirs.save_pretrained(str(tmp_path / "peft"))
    ours = load_model(tiny_model_dir, torch.float32, torch.device("cpu"))
    lora.load_peft_adapter(ours, tmp_path / "peft")
    assert len(lora.adapters(ours)) == 4
    ids = torch.randint(3, 300, (2, 9))
    torch.testing.assert_close(logits(ours, ids), logits(theirs, ids), atol=1e-5, rtol=1e-5)


def test_merge_keeps_logits_and_saves_a_plain_hf_folder(tmp_path, tiny_model_dir, tokenizer):
    from transformers import AutoModelForCausalLM

    model = load_model(tiny_model_dir, torch.float64, torch.device("cpu"))
    lora.apply(model, LoraConfig(rank=4, alpha=8))
    randomize_adapters(model)
    ids = torch.randint(3, 300, (2, 9))
    before = logits(model, ids)
    lora.merge(model)
    assert not lora.adapters(model)
    torch.testing.assert_close(logits(model, ids), before, atol=1e-10, rtol=0)
    export.save_model(model, tokenizer, tmp_path / "merged")
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), local_files_only=True,
                                                  dtype=torch.float64)
    torch.testing.assert_close(logits(loaded, ids), before, atol=1e-10, rtol=0)


def test_target_that_matches_nothing_is_refused(tiny_model_dir):
    from slimtune.errors import UserError

    model = load_model(tiny_model_dir, torch.float32, torch.device("cpu"))
    with pytest.raises(UserError, match="lora.targets: 'qkv' matches no linear layer of the blocks; they have "
                                        "down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj.$"):
        lora.apply(model, LoraConfig(targets=["qkv"]))


def test_the_lm_head_takes_no_adapter(tiny_model_dir):
    """lora.targets=[lm_head] wrapped the head, and every engine's loss then raised (resident: 'LM head
    LoRALinear has neither a weight nor weight_tiles()'); the refusal listed lm_head as a choice."""
    from slimtune.errors import UserError

    model = load_model(tiny_model_dir, torch.float32, torch.device("cpu"))
    with pytest.raises(UserError, match="^lora.targets: 'lm_head' names lm_head, outside the decoder blocks, where "
                                        "slimtune puts no adapter; the blocks have down_proj, "):
        lora.apply(model, LoraConfig(targets=["q_proj", "lm_head"]))
    assert not lora.adapters(model)  # refused before any layer was wrapped
    names = lora.apply(model, LoraConfig(targets=["*"]))  # every linear: the blocks' ones, as all-linear
    assert names == lora.select_targets(load_model(tiny_model_dir, torch.float32, torch.device("cpu")), "all-linear")
    assert not isinstance(model.lm_head, lora.LoRALinear)
