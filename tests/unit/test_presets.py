"""Model presets build (on the meta device) to their published sizes; GPU specs parse or are refused."""

import json
import re

import pytest
import torch

from slimtune import presets
from slimtune.errors import UserError
from slimtune.model.stack import SUPPORTED_FAMILIES
from slimtune.presets import GpuProfile, gpu_profile, model_config

PRESETS = presets.preset_names()
EXPECTED_PRESETS = [
    "Llama-3.2-1B", "Llama-3.2-3B", "Llama-3.1-8B", "Llama-3.1-70B", "Mistral-7B",
    "Qwen2.5-0.5B", "Qwen2.5-1.5B", "Qwen2.5-3B", "Qwen2.5-7B", "Qwen2.5-14B", "Qwen2.5-32B",
    "Qwen3-0.6B", "Qwen3-1.7B", "Qwen3-4B", "Qwen3-8B", "Qwen3-14B", "Qwen3-32B",
]  # fmt: skip
CARDS = ["laptop-4gb", "rtx3060", "rtx4090", "a100-40gb", "a100-80gb", "h100", "h200"]


def unique_params(model: torch.nn.Module) -> int:
    # parameters() yields a tied embedding once, which is how model cards count it.
    return sum(p.numel() for p in model.parameters())


def test_preset_names_are_the_promised_ones():
    assert PRESETS == EXPECTED_PRESETS
    for entry in presets.MODEL_PRESETS.values():
        assert entry["source"] and entry["params"] > 0


@pytest.mark.parametrize("name", EXPECTED_PRESETS)
def test_preset_builds_on_meta_to_its_published_size(name):
    from transformers import AutoModelForCausalLM

    cfg = model_config(name)
    assert cfg.model_type in SUPPORTED_FAMILIES
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    expected = presets.MODEL_PRESETS[name]["params"]
    assert unique_params(model) == pytest.approx(expected, rel=0.01)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == cfg.tie_word_embeddings


def test_preset_details_reach_the_config():
    llama = model_config("llama-3.1-8b")  # any case
    assert llama.rope_parameters["rope_type"] == "llama3" and llama.rope_parameters["factor"] == 8.0
    assert llama.rope_parameters["rope_theta"] == 500000.0
    assert model_config("Mistral-7B").sliding_window is None  # v0.3: no sliding window
    assert model_config("Mistral-7B").vocab_size == 32768
    assert model_config("Qwen3-8B").head_dim == 128
    qwen2 = model_config("Qwen2.5-7B")
    assert qwen2.sliding_window is None and set(qwen2.layer_types) == {"full_attention"}


def test_unknown_preset_lists_the_presets():
    with pytest.raises(UserError, match="Llama-3.2-1B, Llama-3.2-3B") as err:
        model_config("Llama-9B")
    assert "'Llama-9B'" in str(err.value)


def test_folder_reads_config_json_only(tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                vocab_size=500).save_pretrained(tmp_path)  # fmt: skip
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]
    cfg = model_config(str(tmp_path))
    assert (cfg.model_type, cfg.hidden_size, cfg.num_hidden_layers) == ("llama", 64, 3)


def test_folder_with_unsupported_family_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 64}))
    with pytest.raises(UserError, match="gpt2.*not supported"):
        model_config(str(tmp_path))


def test_folder_without_config_is_refused(tmp_path):
    with pytest.raises(UserError, match="no config.json"):
        model_config(str(tmp_path))


@pytest.mark.parametrize("name", CARDS)
def test_named_cards(name):
    card = gpu_profile(name.upper())
    assert card.name == name and card.description
    assert card.memory_bytes > 2**31 and card.bf16_tflops > 10
    assert card.memory_gbps > 100 and card.host_link_gbps >= 10


def test_card_aliases_and_sizes_of_record():
    assert gpu_profile("4090") == gpu_profile("RTX-4090") == gpu_profile("rtx 4090") == gpu_profile("rtx4090")
    assert gpu_profile("h100-80gb").name == "h100"
    assert gpu_profile("rtx4090").memory_bytes == 24564 * 2**20  # nvidia-smi total
    assert gpu_profile("a100-80gb").memory_bytes == 81920 * 2**20
    assert gpu_profile("h200").memory_gbps > gpu_profile("h100").memory_gbps


@pytest.mark.parametrize(
    "spec, size",
    [("24GiB", 24 * 2**30), ("24GB", 24 * 2**30), ("8G", 8 * 2**30), ("12.5GiB", int(12.5 * 2**30)),
     ("500MiB", 500 * 2**20), (" 16 gib ", 16 * 2**30)],
)  # fmt: skip
def test_plain_sizes_get_generic_rates(spec, size):
    card = gpu_profile(spec)
    generic = gpu_profile(presets.GENERIC_RATES_FROM)
    assert card.memory_bytes == size
    assert (card.bf16_tflops, card.memory_gbps, card.host_link_gbps) == (
        generic.bf16_tflops, generic.memory_gbps, generic.host_link_gbps)  # fmt: skip
    assert "generic" in card.description


def test_profile_json_file(tmp_path):
    path = tmp_path / "probed.json"
    path.write_text(json.dumps({"name": "my-card", "memory_bytes": 8 * 2**30, "bf16_tflops": 40.0, "fp32_tflops": 10.0,
                                "memory_gbps": 450.0, "host_link_gbps": 11.5, "measured_at": "today"}))  # fmt: skip
    assert gpu_profile(str(path)) == GpuProfile("my-card", 8 * 2**30, 40.0, 10.0, 450.0, 11.5, f"profile from {path}",
                                                rates="profile file's")
    path.write_text(json.dumps({"memory_bytes": 8 * 2**30, "bf16_tflops": 40.0, "memory_gbps": 450.0}))
    with pytest.raises(UserError, match="host_link_gbps"):
        gpu_profile(str(path))
    path.write_text("{not json")
    with pytest.raises(UserError, match="not readable JSON"):
        gpu_profile(str(path))


@pytest.mark.parametrize("spec", ["rtx9090", "", "lots"])
def test_garbage_gpu_spec_is_refused(spec):
    with pytest.raises(UserError, match="unknown GPU .*named card .*24GiB.*JSON file"):
        gpu_profile(spec)


def test_a_profile_file_that_is_not_there_or_not_a_number_each_is_one_sentence(tmp_path):
    """A missing profile path was called an unknown card; json reads 1e400 as inf (int() of it raised
    OverflowError) and Infinity as itself; 0.5 bytes made a 0 B card that nothing fits."""
    for spec, said in ((tmp_path / "missing.json", "does not exist"), (tmp_path, "is a folder, not a JSON file")):
        with pytest.raises(UserError, match=f"^GPU profile file '{spec}' {said}; `slimtune probe --out FILE` writes"):
            gpu_profile(str(spec))
    numbers = {"memory_bytes": 8 * 2**30, "bf16_tflops": 40.0, "fp32_tflops": 10.0, "memory_gbps": 450.0,
               "host_link_gbps": 11.5}
    path = tmp_path / "card.json"
    for field, text in (("memory_bytes", "1e400"), ("bf16_tflops", "Infinity"), ("memory_gbps", "NaN"),
                        ("memory_bytes", "0.5")):
        path.write_text(json.dumps(numbers).replace(json.dumps(numbers[field]), text, 1))
        with pytest.raises(UserError, match=f"^GPU profile file .* needs positive finite numbers for: {field}\\.$"):
            gpu_profile(str(path))


@pytest.mark.parametrize("spec, fault", [("64KiB", "a size in MiB, MB, GiB, GB, TiB or TB"),
                                         ("100B", "a size in MiB"), ("1e3GB", "a plain number (no exponent)"),
                                         ("-8GB", "a positive size"), ("lots", "a size")])
def test_a_host_ram_size_says_what_is_wrong_with_it(spec, fault):
    with pytest.raises(UserError, match=f"^--host-ram must be {re.escape(fault)}.* such as 64GiB.*got '{spec}'\\.$"):
        presets.memory_size(spec, "--host-ram")


@pytest.mark.parametrize("spec", ["0GB", "-4GiB", "24 TB"])
def test_a_size_no_card_has_says_what_a_size_must_be(spec):
    with pytest.raises(UserError, match=f"a GPU size must be a positive number of GiB, GB, G, MiB, MB or M.*'{spec}'"):
        gpu_profile(spec)


@pytest.mark.parametrize(
    "spec, memory, disk",
    [("200GB", 200 * 2**30, 200 * 10**9), ("1TB", 2**40, 10**12), ("2T", 2 * 2**40, 2 * 10**12),
     ("500GiB", 500 * 2**30, 500 * 2**30), ("1TiB", 2**40, 2**40), ("512MB", 512 * 2**20, 512 * 10**6)],
)  # fmt: skip
def test_a_disk_counts_gb_and_tb_as_its_maker_does_and_memory_as_gib(spec, memory, disk):
    """Memory is sold in binary units under decimal names (a 64 GB kit holds 64 GiB), disks in decimal
    ones: --disk 200GB is 200 * 10^9 bytes, the same words for RAM 200 GiB."""
    assert presets.memory_size(spec, "--host-ram") == memory
    assert presets.disk_size(spec, "--disk") == disk


@pytest.mark.parametrize("spec", ["0GB", "-1TB", "lots"])
def test_a_disk_size_that_is_not_one_names_the_flag(spec):
    with pytest.raises(UserError, match=f"--disk must be a (positive )?size such as .*'{spec}'"):
        presets.disk_size(spec, "--disk")


@pytest.mark.parametrize("name, generic", [("NVIDIA GeForce RTX 4090", False), ("Mystery Accelerator 9000", True)])
def test_the_device_s_profile_says_when_its_rates_are_a_stand_in(monkeypatch, name, generic):
    """A card outside the presets is planned with rtx4090's rates; plan=auto must not print them as its
    own speed (as on the CPU)."""
    import types

    props = types.SimpleNamespace(name=name, total_memory=8 * 2**30)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    profile = presets.device_profile(torch.device("cuda"))
    assert (profile.name, profile.memory_bytes, profile.generic_rates) == (name, 8 * 2**30, generic)
    assert presets.device_profile(torch.device("cpu")).generic_rates
