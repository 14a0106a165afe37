"""The Stack view reproduces the HF model for every supported family, and packed rows
equal their examples run one by one."""

import shutil

import pytest
import torch

from conftest import save_tiny_model
from slimtune.errors import UserError
from slimtune.model.stack import Stack, load_model, load_tokenizer, read_config

pytestmark = pytest.mark.quick  # loading and the Stack view, cheap

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
    (tmp_path / "config.json").write_text('{"hidden_size": 8}')  # was "model_type 'None' ... is not supported"
    with pytest.raises(UserError, match="config.json has no model_type; slimtune trains llama, mistral"):
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


def test_a_file_given_as_the_model_and_a_folder_without_a_tokenizer_are_each_one_sentence(tmp_path, tiny_model_dir):
    """A file was called a missing folder ("did you mean" itself); a folder without tokenizer files got
    transformers' three-part account of its backends (found by a newcomer walkthrough)."""
    (tmp_path / "afile").write_text("x")
    with pytest.raises(UserError) as err:
        read_config(tmp_path / "afile")
    assert str(err.value) == (f"model '{tmp_path / 'afile'}' is a file; model names a folder holding config.json,"
                              " the *.safetensors weights and the tokenizer files.")
    bare = tmp_path / "bare"
    shutil.copytree(tiny_model_dir, bare)
    for f in bare.glob("tokenizer*"):
        f.unlink()
    with pytest.raises(UserError) as err:
        load_tokenizer(bare)
    assert str(err.value).startswith(f"model folder '{bare}' has no tokenizer files (none of tokenizer.json,")


def test_build_order_is_asserted(tiny_model_dir):
    stack = Stack(load_model(tiny_model_dir, torch.float32, torch.device("cpu")))
    stack.advance("adapters")
    with pytest.raises(AssertionError, match="build stage 'quant' after 'adapters'"):
        stack.advance("quant")


# --- damaged or foreign model files: one sentence naming the folder and the file, never a pickle ---

def _rewrite(folder, change, name="model.safetensors"):
    """Rewrite a safetensors file of `folder` as change(tensors) returns it."""
    from safetensors.torch import load_file, save_file

    path = folder / name
    save_file(change(load_file(str(path))), str(path), metadata={"format": "pt"})


def _edit_config(folder, **fields):
    import json

    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


def _load(folder):
    return load_model(folder, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("keep", [lambda size: size // 2, lambda size: 10, lambda size: size - 1],
                         ids=["half", "10B", "1Bshort"])
def test_truncated_weights_are_named(tmp_path, tokenizer, keep):
    folder = save_tiny_model(tmp_path, tokenizer)
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[: keep(path.stat().st_size)])
    with pytest.raises(UserError, match=f"model folder '{folder}': model.safetensors is not a readable safetensors"):
        _load(folder)


FOREIGN = {
    "other tensors": (lambda t: {"x": torch.zeros(3)},
                      "the weights in model.safetensors hold none of the 2 layers its config.json describes; they "
                      "are another model's or damaged."),
    "other tensors, the layers kept": (lambda t: {k: v for k, v in t.items() if ".layers." in k},
                                       "no weight 'model.embed_tokens.weight' of the model its config.json describes "
                                       "is in model.safetensors \\(missing: 3 of 21"),
    "one dropped": (lambda t: {k: v for k, v in t.items() if k != "model.layers.1.mlp.up_proj.weight"},
                    "no weight 'model.layers.1.mlp.up_proj.weight' .* is in model.safetensors \\(missing: 1 of 21"),
    "one extra": (lambda t: {**t, "model.layers.9.extra": torch.zeros(2)},
                  "model.safetensors holds weight 'model.layers.9.extra', which the model its config.json describes "
                  "does not have"),
    "one reshaped": (lambda t: {**t, "model.norm.weight": torch.zeros(7)},
                     "config.json does not match model.safetensors: weight 'model.norm.weight' has shape \\[7\\] there "
                     "but \\[32\\] by config.json"),
}


@pytest.mark.parametrize("case", FOREIGN)
def test_foreign_weights_are_refused_not_initialised_randomly(tmp_path, tokenizer, case):
    """transformers loads a file missing weights (initialising them randomly) or holding others."""
    change, says = FOREIGN[case]
    folder = save_tiny_model(tmp_path, tokenizer)
    _rewrite(folder, change)
    with pytest.raises(UserError, match=f"model folder '{folder}': {says}"):
        _load(folder)


CONFIGS = {
    "hidden_size": ({"hidden_size": 64}, "config.json does not match model.safetensors: weight "
                    "'model.embed_tokens.weight' has shape \\[300, 32\\] there but \\[300, 64\\] by config.json "
                    "\\(differing: 21 of 21 weights\\)"),
    "more layers": ({"num_hidden_layers": 3}, "config.json says num_hidden_layers is 3 but the weights in "
                    "model.safetensors are those of 2 layers"),
    "fewer layers": ({"num_hidden_layers": 1}, "model.safetensors holds weight "
                     "'model.layers.1.input_layernorm.weight', which the model its config.json describes does not have"),
    "untied head": ({"tie_word_embeddings": False}, "no weight 'lm_head.weight' of the model"),
    "unbuildable": ({"hidden_size": 33}, "config.json does not describe a model transformers can build "
                    "\\(ValueError: The hidden size \\(33\\) is not a multiple"),
}


@pytest.mark.parametrize("case", CONFIGS)
def test_config_that_does_not_match_the_weights_names_the_mismatch(tmp_path, tokenizer, case):
    fields, says = CONFIGS[case]
    folder = save_tiny_model(tmp_path, tokenizer, tie_word_embeddings=case == "untied head")
    _edit_config(folder, **fields)
    with pytest.raises(UserError, match=says):
        _load(folder)


def _strip_prefix(t):
    return {k.removeprefix("model."): v for k, v in t.items()}


ACCEPTED = {
    "tied head": ({"tie_word_embeddings": True}, None),  # the file holds no lm_head.weight
    "old rotary buffer": ({}, lambda t: {**t, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(4)}),
    "base model keys": ({}, _strip_prefix),  # saved from LlamaModel: transformers adds the prefix
}


@pytest.mark.parametrize("case", ACCEPTED)
def test_what_transformers_loads_whole_is_accepted(tmp_path, tokenizer, case):
    from safetensors import safe_open

    overrides, change = ACCEPTED[case]
    folder = save_tiny_model(tmp_path / "a", tokenizer, **overrides)
    want = _load(folder).state_dict()
    if change:
        _rewrite(folder, change)
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert ("lm_head.weight" in f.keys()) == (case != "tied head")
    got = _load(folder).state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


class _Trap:
    """Unpickling this creates `marker`: proof that a pickle was loaded."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _garbage_weights(folder, trap):
    (folder / "model.safetensors").write_bytes(b"not a safetensors file, just some text" * 10)
    trap("pytorch_model.bin")


def _index_naming_a_pickle(folder, trap):
    """A shard list whose first file is a pickle: transformers would torch.load every shard."""
    import json
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    (folder / "model.safetensors").rename(folder / "model-00002-of-00002.safetensors")
    weight_map = {name: "model-00002-of-00002.safetensors" for name in names[1:]}
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {names[0]: "model-00001-of-00002.bin", **weight_map}}))
    trap("model-00001-of-00002.bin")


def _config_naming_a_pickle(folder, trap):
    _edit_config(folder, transformers_weights="adapter_model.bin")  # the one pickle transformers accepts there
    trap("adapter_model.bin")


def _adapter_beside_the_model(folder, trap):
    import json

    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"],
         "base_model_name_or_path": str(folder)}))
    trap("adapter_model.bin")


PICKLE_ROUTES = {
    "garbage model.safetensors": (_garbage_weights, "model.safetensors is not a readable safetensors file"),
    "index names a .bin": (_index_naming_a_pickle, "model.safetensors.index.json names shard "
                           "'model-00001-of-00002.bin', which is not a .safetensors file"),
    "config names a .bin": (_config_naming_a_pickle, "config.json names transformers_weights 'adapter_model.bin'"),
    "adapter beside": (_adapter_beside_the_model, "holds adapter_config.json, which transformers would apply"),
}


@pytest.mark.parametrize("route", PICKLE_ROUTES)
def test_a_pickle_in_the_model_folder_is_never_loaded(tmp_path, tokenizer, monkeypatch, route):
    import pickle

    damage, says = PICKLE_ROUTES[route]
    folder = save_tiny_model(tmp_path / "m", tokenizer)
    marker = tmp_path / "unpickled"

    def refuse(*args, **kwargs):
        raise AssertionError("a pickle was loaded")

    for module, name in ((torch, "load"), (pickle, "load"), (pickle, "loads")):
        monkeypatch.setattr(module, name, refuse)
    damage(folder, lambda name: (folder / name).write_bytes(pickle.dumps(_Trap(marker))))
    with pytest.raises(UserError) as err:
        _load(folder)
    assert len(str(err.value).splitlines()) == 1
    assert str(err.value).startswith((f"model folder '{folder}'", f"{folder}/config.json"))
    assert says in str(err.value)
    assert not marker.exists()


def _sharded(tmp_path, tokenizer):
    from transformers import AutoModelForCausalLM

    single = save_tiny_model(tmp_path / "single", tokenizer)
    folder = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(str(single)).save_pretrained(folder, max_shard_size="20KB")
    shards = sorted(p.name for p in folder.glob("model-*.safetensors"))
    assert len(shards) > 2 and not (folder / "model.safetensors").exists()
    return single, folder, shards


def test_sharded_checkpoint_loads_as_one_file_does(tmp_path, tokenizer):
    single, folder, _ = _sharded(tmp_path, tokenizer)
    want, got = _load(single).state_dict(), _load(folder).state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def _drop_shard(folder, shards):
    (folder / shards[1]).unlink()


def _truncate_shard(folder, shards):
    path = folder / shards[1]
    path.write_bytes(path.read_bytes()[:100])


def _drop_weight_from_a_shard(folder, shards):
    _rewrite(folder, lambda t: dict(list(t.items())[1:]), shards[0])


def _break_index(folder, shards):
    (folder / "model.safetensors.index.json").write_text('{"weight_map": {}}')


SHARD_DAMAGE = {
    "missing shard": (_drop_shard, "model.safetensors.index.json names shard '{1}', which is missing"),
    "truncated shard": (_truncate_shard, "{1} is not a readable safetensors file"),
    "weight gone": (_drop_weight_from_a_shard, "of the model its config.json describes is in the {n} shards "
                    "model.safetensors.index.json names"),
    "broken index": (_break_index, "model.safetensors.index.json is not a safetensors index"),
}


@pytest.mark.parametrize("case", SHARD_DAMAGE)
def test_damaged_sharded_checkpoint_is_named(tmp_path, tokenizer, case):
    _, folder, shards = _sharded(tmp_path, tokenizer)
    damage, says = SHARD_DAMAGE[case]
    damage(folder, shards)
    with pytest.raises(UserError) as err:
        _load(folder)
    assert str(err.value).startswith(f"model folder '{folder}': ")
    assert says.format(*shards, n=len(shards)) in str(err.value)


def test_the_check_reads_headers_only(tmp_path, tokenizer, monkeypatch):
    """No tensor data is read before the load: a 16 GB folder is read once, not twice."""
    import safetensors

    from slimtune.model.stack import check_weights

    real = safetensors.safe_open

    class HeadersOnly:
        def __init__(self, *args, **kwargs):
            self.file = real(*args, **kwargs)

        def __enter__(self):
            self.file.__enter__()
            return self

        def __exit__(self, *exc):
            return self.file.__exit__(*exc)

        def keys(self):
            return self.file.keys()

        def get_slice(self, name):
            return type("Shape", (), {"get_shape": lambda _, s=self.file.get_slice(name): s.get_shape()})()

    monkeypatch.setattr(safetensors, "safe_open", HeadersOnly)
    _, folder, _ = _sharded(tmp_path, tokenizer)
    check_weights(folder, read_config(folder))


def test_what_the_check_misses_transformers_still_may_not_initialise(tmp_path, tokenizer, monkeypatch, capfd):
    """The loading report is the second guard: a weight left out is refused after loading, in one sentence."""
    import slimtune.model.stack

    folder = save_tiny_model(tmp_path, tokenizer)
    _rewrite(folder, lambda t: {k: v for k, v in t.items() if k != "model.norm.weight"})
    monkeypatch.setattr(slimtune.model.stack, "check_weights", lambda folder, config: None)
    says = "its weights do not match its config.json \\(transformers found missing weights loading it: 1, first model.norm"
    with pytest.raises(UserError, match=f"model folder '{folder}': {says}"):
        _load(folder)
    assert "LOAD REPORT" not in capfd.readouterr().err
