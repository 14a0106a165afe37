"""Bounds and config messages (issue 28): a model's config.json is checked in one place before anything is
built from it, sizes that cannot be built are refused at once, and the settings' own messages say what is
true (where a mistyped key came from, which engines take a 4-bit base, settings another engine would read,
devices and card sizes that do not exist)."""

import json
import os
import struct

import pytest
import torch

from conftest import save_tiny_model
from slimtune import config, engines, presets
from slimtune.engines import settings
from slimtune.planning import planner  # noqa: F401  (engines registers every engine)
from slimtune.engines.chunk.partition import Stream, partition
from slimtune.errors import UserError
from slimtune.model.stack import load_model, read_config
from slimtune.engines.roundpipe import cost_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer):
    return save_tiny_model(tmp_path_factory.mktemp("bounds-model"), tokenizer)


def edited(folder, tmp_path, **fields):
    """A copy of config.json (alone) with `fields` changed; None removes the field."""
    config = json.loads((folder / "config.json").read_text())
    config.update(fields)
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    return tmp_path


# ---------------------------------------------------------------- config.json's fields (item 13)

FIELDS = {
    "no heads": ({"num_attention_heads": 0}, "num_attention_heads must be a positive whole number, got 0."),
    "no vocabulary": ({"vocab_size": 0}, "vocab_size must be a positive whole number, got 0."),
    "negative width": ({"hidden_size": -32}, "hidden_size must be a positive whole number, got -32."),
    "text for a count": ({"intermediate_size": "64"}, "intermediate_size must be a positive whole number, got '64'."),
    "true for a count": ({"num_hidden_layers": True}, "num_hidden_layers must be a positive whole number, got True."),
    "no layers given": ({"num_hidden_layers": None}, "has no num_hidden_layers"),
    "zero head width": ({"head_dim": 0}, "head_dim must be a positive whole number, got 0."),
    "kv heads not dividing": ({"num_key_value_heads": 3}, "num_key_value_heads (3) must divide num_attention_heads (4)"),
    "width not by heads": ({"hidden_size": 30, "head_dim": None},
                           "hidden_size (30) must be a multiple of num_attention_heads (4) when head_dim is not given"),
}


@pytest.mark.parametrize("case", FIELDS)
def test_every_reader_of_config_json_names_the_file_and_field(model_dir, tmp_path, case):
    """train, chat, eval and export read it through read_config, plan through presets.model_config, the
    simulator through its cost model: one check, one sentence, whichever reads it."""
    fields, says = FIELDS[case]
    folder = edited(model_dir, tmp_path, **fields)
    for read in (read_config, presets.model_config, lambda f: cost_model.modelled_costs(str(f), "rtx4090")):
        with pytest.raises(UserError) as err:
            read(folder)
        assert str(err.value).startswith(f"{folder / 'config.json'}")
        assert says in str(err.value)


def test_a_checked_config_json_loads_as_before(model_dir):
    assert read_config(model_dir)["num_attention_heads"] == 4
    assert presets.model_config(str(model_dir)).num_hidden_layers == 2


# ---------------------------------------------------------------- depth and size bounds (item 4)

def test_a_config_json_claiming_more_layers_than_its_weights_is_refused_before_a_model_is_built(model_dir, tmp_path):
    """A million claimed layers were built one module at a time (train: past 400 s and 8.7 GB); the
    weight files' headers say at once that they hold two."""
    folder = tmp_path
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((model_dir / name).read_bytes())
    edited(model_dir, folder, num_hidden_layers=10**6)
    says = (f"model folder '{folder}': config.json says num_hidden_layers is 1,000,000 but the weights in "
            "model.safetensors are those of 2 layers; one of them is damaged or another model's.")
    with pytest.raises(UserError) as err:
        load_model(folder, torch.float32, torch.device("cpu"))  # train, chat, eval, export
    assert str(err.value) == says
    with pytest.raises(UserError) as err:
        presets.model_config(str(folder))  # plan, on the same folder
    assert str(err.value) == says


def _sparse_safetensors(path, tensors: dict[str, tuple[list[int], torch.Tensor | None]]) -> None:
    """A safetensors file whose tensors given as None are holes (a sparse file): a header as large a
    model's as wanted, next to no disk."""
    header, offset = {}, 0
    for name, (shape, data) in tensors.items():
        size = 4 * int(torch.Size(shape).numel())
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        start = f.tell()
        for name, (shape, data) in tensors.items():
            f.seek(start + header[name]["data_offsets"][0])
            if data is not None:
                f.write(data.contiguous().numpy().tobytes())
        f.truncate(start + offset)


def _ram() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def test_weights_larger_than_the_load_device_are_refused_before_loading(model_dir, tmp_path):
    """A plain bound: from_pretrained makes every weight on the load device, so shards whose weights
    together exceed this host's RAM are refused in one sentence before anything is loaded. Sparse files:
    each shard's header names a quarter of the RAM (one MLP matrix each), on next to no disk."""
    from safetensors.torch import load_file

    inner = _ram() // 4 // (4 * 32)  # an fp32 (inner, 32) matrix of a quarter of the RAM
    folder = edited(model_dir, tmp_path, intermediate_size=inner)
    small = load_file(str(model_dir / "model.safetensors"))
    weight_map, rest = {}, {}
    for name, tensor in small.items():
        if ".mlp." in name:
            shape = [inner, 32] if name.endswith(("gate_proj.weight", "up_proj.weight")) else [32, inner]
            shard = f"model-{len(weight_map):05d}.safetensors"
            _sparse_safetensors(folder / shard, {name: (shape, None)})
            weight_map[name] = shard
        else:
            rest[name] = (list(tensor.shape), tensor)
    _sparse_safetensors(folder / "model-rest.safetensors", rest)
    weight_map.update((name, "model-rest.safetensors") for name in rest)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with pytest.raises(UserError, match=f"model folder '{folder}' holds [0-9,]+ weights, [0-9,.]+ GiB in float32, more "
                                        r"than this host's RAM \([0-9.,]+ GiB\): it cannot be loaded here."):
        load_model(folder, torch.float32, torch.device("cpu"))


def test_a_weight_file_larger_than_the_host_can_map_is_one_sentence(model_dir, tmp_path):
    """safe_open maps a file whole (copy-on-write): past the host's commit limit it raised a RuntimeError."""
    from safetensors.torch import load_file

    vocab = 2**40 // (4 * 32)  # a 1 TiB table, tied to the head
    folder = edited(model_dir, tmp_path, vocab_size=vocab, tie_word_embeddings=True)
    tensors = {name: (list(t.shape), t) for name, t in load_file(str(model_dir / "model.safetensors")).items()}
    del tensors["lm_head.weight"]
    tensors["model.embed_tokens.weight"] = ([vocab, 32], None)
    _sparse_safetensors(folder / "model.safetensors", tensors)
    with pytest.raises(UserError, match=f"model folder '{folder}': model.safetensors is 1,024.0 GiB, more than this "
                                        "host's memory can map: it cannot be loaded here.|holds [0-9,]+ weights"):
        load_model(folder, torch.float32, torch.device("cpu"))


def test_plan_refuses_a_model_neither_the_host_nor_the_card_can_hold(model_dir, tmp_path):
    """A config.json alone (no weights) is planned block by block; a model larger than the host's RAM
    and the card is refused with the bound stated, before any plan is weighed."""
    folder = edited(model_dir, tmp_path, vocab_size=2**36)
    machine = planner.Machine.named("8GiB", host_ram="16GiB", disk="1TB")
    with pytest.raises(UserError, match=r"the model has [0-9,]+ weights or more, [0-9,.]+ GiB in 16 bits, more than"
                                        r" the host's RAM \(16.0 GiB\) or the card \(8.0 GiB\) holds"):
        planner.plan(presets.model_config(str(folder)), planner.planning_config("lora"), machine, 1, 32)


# ---------------------------------------------------------------- chunk.n_chunks (item 5)

def test_more_chunks_than_the_model_has_slices_are_refused_when_the_settings_load(model_dir):
    """chunk.n_chunks=100000000 ran past 300 s and 4.9 GB with no output: now refused before anything is
    loaded, against the slices the model's config.json allows."""
    with pytest.raises(UserError, match=r"chunk.n_chunks=100,000,000 is more chunks than the model in '.*' can be cut "
                                        r"into: its trainable tensors hold at most [0-9,]+ slices"):
        settings.load(None, ["engine=chunk", "method=full", "chunk.n_chunks=100000000"],
                      base={"model": str(model_dir), "data": "x.jsonl"})
    settings.load(None, ["engine=chunk", "method=full", "chunk.n_chunks=64"],
                  base={"model": str(model_dir), "data": "x"})


def test_the_partition_refuses_more_chunks_than_slices_before_cutting():
    streams = [Stream("embed", (300, 32), 0, 16), Stream("norm", (32,), 0, 16)]  # 332 slices
    with pytest.raises(UserError, match=r"chunk.n_chunks=333 is more chunks than the trainable tensors can be cut "
                                        r"into: they hold 332 slices"):
        partition(streams, 333)
    with pytest.raises(UserError, match="they hold 332 slices"):
        partition(streams, 10**8)  # at once: no list of 10^8 cuts is made
    assert len(partition(streams, 300)) == 300
    # Fewer chunks than slices may still leave one empty, when the equal-byte cuts fall in one large slice.
    uneven = [Stream("wide", (1000, 1), 1, 4), Stream("norm", (10,), 0, 4)]  # 1 slice of 4000 B, 10 of 4 B
    with pytest.raises(UserError, match="chunk.n_chunks=5 leaves chunk 0 empty"):
        partition(uneven, 5)


# ---------------------------------------------------------------- what the settings say (items 18, 19)

def test_a_4bit_base_on_a_full_only_engine_names_the_engines_that_take_it():
    with pytest.raises(UserError) as err:
        settings.load(None, ["engine=chunk", "method=full", "quant.scheme=nf4"], base={"model": "m", "data": "d"})
    said = str(err.value)
    assert "engine=chunk trains full weights only; a 4-bit base needs method=lora, on engine " in said
    named = said.split("on engine ")[1].split(" (")[0].replace(" or ", ", ").split(", ")
    assert "chunk" not in named and "resident" in named
    for engine in named:  # what it advises is accepted
        settings.load(None, [f"engine={engine}", "method=lora", "quant.scheme=nf4"], base={"model": "m", "data": "d"})


def test_a_mistyped_key_is_placed_where_it_was_given(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model: m\ndata: d.jsonl\nchunk:\n  n_chunks: 4\n  nchunk: 2\n")
    with pytest.raises(UserError) as err:
        settings.load(path)
    assert str(err.value) == f"unknown key 'chunk.nchunk' in {path} line 5 (did you mean 'chunk.n_chunks'?)."
    path.write_text("model: m\ndata: d.jsonl\n")
    with pytest.raises(UserError) as err:
        settings.load(path, ["chunk.nchunks=4"])
    assert str(err.value) == "unknown key 'chunk.nchunks' on the command line (did you mean 'chunk.n_chunks'?)."


# ---------------------------------------------------------------- rough edges

def test_another_engines_settings_the_user_gave_are_said_to_be_ignored_once(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model: m\ndata: d.jsonl\nchunk: {n_chunks: 4}\n")
    heard = []
    cfg = settings.load(path, ["slide.slots=3"], warn=heard.append)
    assert heard == ["chunk.n_chunks and slide.slots are set but engine is resident: ignored."]
    heard.clear()
    settings.load(path, ["engine=chunk", "method=full"], warn=heard.append)  # its own section
    settings.load(path, ["engine=slide", "slide.working_set=chunk", "method=full"],
                  warn=heard.append)  # it reads chunk.*
    settings.load(None, [], base=config.to_dict(cfg), warn=heard.append)  # every section at its value: none given
    settings.load(path, ["plan=auto", "gpu=8GiB"], warn=heard.append)  # the planner chooses the engine later
    assert heard == []


def test_settings_the_method_or_plan_leaves_unread_are_said_to_be_ignored(tmp_path):
    """lora.* under method=full, freeze under method=lora and --gpu without plan=auto were silently
    ignored (found by a newcomer walkthrough); the same settings where they are read say nothing."""
    path = tmp_path / "run.yaml"
    path.write_text("model: m\ndata: d.jsonl\n")
    heard = []
    settings.load(path, ["method=full", "lora.rank=8"], warn=heard.append)
    settings.load(path, ["freeze=[x]"], warn=heard.append)
    settings.load(path, ["gpu=8GiB"], warn=heard.append)
    assert heard == ["lora.rank is set but method is full: ignored.",
                     "freeze is set but method is lora (only the adapters train): ignored.",
                     "gpu (--gpu) is set but plan is manual: ignored; add plan=auto to plan for that card."]
    heard.clear()
    settings.load(path, ["lora.rank=8", "method=full", "freeze=[x]", "method=lora"], warn=heard.append)
    assert heard == ["freeze is set but method is lora (only the adapters train): ignored."]  # lora.rank is read
    heard.clear()  # a file kept for both methods, switched on the command line: its lora section is not a mistake
    path.write_text("model: m\ndata: d.jsonl\nlora: {rank: 8, alpha: 16}\n")
    settings.load(path, ["method=full"], warn=heard.append)
    settings.load(path, ["method=full", "lora.rank=4", "lora.alpha=8"], warn=heard.append)
    assert heard == ["lora.rank and lora.alpha are set but method is full: ignored."]
    heard.clear()  # a whole section typed; and gpu read by settings the engine leaves to the planner
    settings.load(path, ["method=full", "lora={rank: 4}"], warn=heard.append)
    settings.load(path, ["method=full", "engine=chunk", "chunk.n_chunks=0", "gpu=8GiB"], warn=heard.append)
    assert heard == ["lora is set but method is full: ignored."]
    heard.clear()  # a setting another one's value leaves unread (each ran without a word)
    settings.load(path, ["activations.disk_dir=/x", "log.wandb_mode=offline", "log.mlflow_experiment=e"],
                  warn=heard.append)
    settings.load(path, ["activations.checkpoint=disk", "activations.disk_dir=/x", "log.wandb=true",
                         "log.wandb_mode=offline"], warn=heard.append)  # read: nothing said
    settings.load(path, ["activations.seq_tile=256", "activations.cache=small"], warn=heard.append)
    settings.load(path, ["activations.checkpoint=recompute", "activations.seq_tile=256", "activations.last_k=3"],
                  warn=heard.append)
    assert heard == ["activations.disk_dir is set but activations.checkpoint is none, not disk: ignored.",
                     "log.wandb_mode is set but log.wandb is false: ignored.",
                     "log.mlflow_experiment is set but log.mlflow is false: ignored.",
                     "activations.seq_tile and activations.cache are set but activations.checkpoint is none (tiles and"
                     " the cache are checkpointed blocks'): ignored.",
                     "activations.last_k is set but activations.cache is none, not last_k: ignored."]
    heard.clear()  # an engine section's own: a folder for files its other setting keeps in RAM
    settings.load(path, ["engine=slide", "method=full", "slide.moments_dir=/x"], warn=heard.append)
    settings.load(path, ["engine=chunk", "method=full", "chunk.state_dir=/x"], warn=heard.append)
    settings.load(path, ["engine=slide", "method=full", "slide.moments=disk", "slide.moments_dir=/x"],
                  warn=heard.append)  # read: nothing said
    assert heard == ["slide.moments_dir is set but slide.moments is ram, not disk: ignored.",
                     "chunk.state_dir is set but chunk.state is ram, not disk: ignored."]
    heard.clear()  # plan=auto's choice replaces the engine and the options its plans set (was unsaid)
    settings.load(path, ["plan=auto", "gpu=8GiB", "engine=slide", "slide.slots=3", "precision=fp32"],
                  warn=heard.append)
    assert heard == ["engine and precision are set, but plan=auto chooses the engine and its options and may replace"
                     " them (the plan it picks is said when the run starts); leave plan=auto out to train as set."]


def test_freeze_patterns_freeze_what_they_match_and_one_that_matches_nothing_is_refused(model_dir, tmp_path, tokenizer):
    from slimtune import assembly
    from slimtune.model.stack import Stack

    def trainable(*patterns: str, folder=model_dir) -> list[str]:
        cfg = settings.load(None, ["method=full", f"freeze=[{', '.join(patterns)}]"], base={"model": "m", "data": "d"})
        stack = Stack(load_model(folder, torch.float32, torch.device("cpu")))
        assembly.apply_method(cfg, stack)
        return [name for name, p in stack.model.named_parameters() if p.requires_grad]

    every = trainable()
    assert trainable("'*embed_tokens*'") == [n for n in every if "embed_tokens" not in n] != every
    with pytest.raises(UserError) as err:
        trainable("'*embed_tokens*'", "nomatch")  # was silently ignored (found by a newcomer walkthrough)
    assert str(err.value).startswith("freeze pattern 'nomatch' matches no parameter of the model (fnmatch on names")
    with pytest.raises(UserError, match=r"freeze every parameter; nothing would train"):
        trainable("'*'")
    # A tied head is the embedding under a second name: freezing it by that name freezes the one tensor.
    tied = save_tiny_model(tmp_path / "tied", tokenizer, tie_word_embeddings=True)
    assert trainable("lm_head.weight", folder=tied) == trainable("'*embed_tokens*'", folder=tied) != \
        trainable(folder=tied)


def test_listed_roundpipe_workers_must_be_devices_of_this_machine():
    missing = f"cuda:{torch.cuda.device_count()}"  # the first index this machine lacks (cuda:0 without CUDA)
    chosen = ["engine=roundpipe", "method=full"]
    with pytest.raises(UserError, match=f"roundpipe.workers names '{missing}', which this run cannot use"):
        settings.load(None, [*chosen, f"roundpipe.workers=[{missing}]"], base={"model": "m", "data": "d"})
    with pytest.raises(UserError, match="roundpipe.workers names 'cuda:0', which this run cannot use \\(device=cpu\\)"):
        settings.load(None, [*chosen, "roundpipe.workers=[cuda:0]", "device=cpu"], base={"model": "m", "data": "d"})
    with pytest.raises(UserError, match="roundpipe.workers\\[1\\] is 'gpu1', not a CUDA device such as cuda:0"):
        settings.load(None, [*chosen, "roundpipe.workers=[cuda:0, gpu1]"], base={"model": "m", "data": "d"})


@pytest.mark.parametrize("size", ["0GiB", "-8GB", "0.0G", "nanGiB"])
def test_a_card_size_that_is_not_positive_says_so(size):
    with pytest.raises(UserError, match=f"a GPU size must be a positive number of GiB, GB, G, MiB, MB or M, such as "
                                        f"24GiB or 500MiB; got '{size}'."):
        presets.gpu_profile(size)
    with pytest.raises(UserError, match="a GPU size must be a positive number"):  # train's gpu=, said as it loads
        settings.load(None, [f"gpu={size}"], base={"model": "m", "data": "d"})
    with pytest.raises(UserError, match="--host-ram must be a positive size such as 64GiB"):
        planner.Machine.named("8GiB", host_ram=size)
