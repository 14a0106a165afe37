"""Load a local Hugging Face causal LM and view it as a Stack: embed -> blocks -> norm -> head.

Every engine runs the model through the Stack, so anything family-specific lives here.
Llama, Mistral, Qwen2 and Qwen3 share one layout (`model.embed_tokens`, `model.layers`,
`model.norm`, `model.rotary_emb`, `lm_head`) and one block: input_layernorm -> self_attn ->
residual add -> post_attention_layernorm -> mlp -> residual add (step/seq_tiles.py runs those
submodules itself, a tile of tokens at a time). Tied or untied embeddings, GQA, attention
bias, rope scaling and sliding-window layers are all handled by the family's own modules.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Callable
from pathlib import Path

import torch
from torch import nn

from slimtune import local_paths
from slimtune.model import config_json
from slimtune.device import memory
from slimtune.errors import UserError

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")

# The fixed order in which a run transforms its model (ARCHITECTURE.md, "The flow of one run").
BUILD_ORDER = ("loaded", "quant", "adapters", "engine")


def read_config(folder: str | Path) -> dict:
    """config.json of a model folder, checked for a supported family."""
    path = Path(folder) / "config.json"
    if Path(folder).is_file():
        raise UserError(f"model '{folder}' is a file; model names a folder holding config.json, the *.safetensors"
                        " weights and the tokenizer files.")
    if not Path(folder).is_dir():
        raise UserError(local_paths.missing("model folder", folder))
    if not path.is_file():
        raise UserError(f"model folder '{folder}' has no config.json.")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise UserError(f"{path} line {err.lineno}: not valid JSON ({err.msg}).") from None
    if not isinstance(config, dict):
        raise UserError(f"{path} must hold a JSON object of model settings.")
    family = config.get("model_type")
    if family is None:
        raise UserError(f"{path} has no model_type; slimtune trains {', '.join(SUPPORTED_FAMILIES)} models.")
    if family not in SUPPORTED_FAMILIES:
        raise UserError(
            f"model_type '{family}' in {path} is not supported; supported: {', '.join(SUPPORTED_FAMILIES)}."
        )
    config_json.check_fields(config, path)  # before anything is built from it
    return config


def load_model(folder: str | Path, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """Weights from safetensors only (never pickle), memory-mapped and loaded once onto `device`.
    check_weights refuses damaged or foreign files from their headers first; a weight transformers
    still could not load (it would initialise it randomly) is refused after loading too."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    config = read_config(folder)
    check_weights(folder, config)
    _refuse_beyond_the_load_device(folder, config, dtype, device)
    hf_logging.disable_progress_bar()  # our own progress bar is the one the user watches
    # transformers logs a table of the weights it could not load: _refuse_partial_load says it in one sentence
    drop_report = lambda record: "LOAD REPORT" not in str(record.msg)  # noqa: E731
    logger = hf_logging.get_logger("transformers.modeling_utils")
    logger.addFilter(drop_report)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            str(folder),
            local_files_only=True,
            use_safetensors=True,
            dtype=dtype,
            device_map={"": device},
            attn_implementation="sdpa",
            output_loading_info=True,
            ignore_mismatched_sizes=True,  # reported by _refuse_partial_load instead of a RuntimeError
        )
    finally:
        logger.removeFilter(drop_report)
    _refuse_partial_load(folder, info)
    model.config.use_cache = False
    return model


def empty_model(folder: str | Path, dtype: torch.dtype) -> nn.Module:
    """The model config.json describes, on the meta device: every tensor its shape and dtype, no
    weight read or allocated. An fsdp rank other than 0 starts from it and is handed its shards of
    rank 0's loaded weights (dist/sharding.fill_from_rank0)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    read_config(folder)
    config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.config.use_cache = False
    return model


SAFE_WEIGHTS, SAFE_INDEX = "model.safetensors", "model.safetensors.index.json"
# from_pretrained loads these instead of SAFE_WEIGHTS whenever one exists (transformers.distributed).
DISTRIBUTED_SHARD = re.compile(r"^shard-[0-9]{5}-model-[0-9]{5}-of-[0-9]{5}\.safetensors$")


def check_weights(folder: str | Path, config: dict) -> None:
    """Refuse, in one sentence naming the file, what from_pretrained would load wrongly or not at
    all: a damaged safetensors file, a missing shard, a pickle, an adapter it would apply, weights
    that are not those of the model config.json describes (it initialises missing ones randomly).
    Reads only the files' headers: a 16 GB folder's weights are still read once, by the load."""
    folder = Path(folder)
    _refuse_foreign_files(folder)
    files = weight_files(folder, config)
    found = read_headers(folder, files)
    where = _named(files)
    check_depth(folder, where, found, config)  # the model config.json describes is built next, block by block
    _compare_weights(folder, where, found, *_described_weights(folder))


def check_depth_of_folder(folder: str | Path, config: dict) -> None:
    """For a reader of config.json alone (the planner): a folder that holds weights too has its
    config.json's depth checked against them (headers only); a folder of config.json alone, none."""
    folder = Path(folder)
    if config.get("transformers_weights") is None and not any((folder / name).is_file()
                                                             for name in (SAFE_WEIGHTS, SAFE_INDEX)):
        return
    files = weight_files(folder, config)
    check_depth(folder, _named(files), read_headers(folder, files), config)


def _named(files: list[str]) -> str:
    return files[0] if len(files) == 1 else f"the {len(files)} shards {SAFE_INDEX} names"


_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def check_depth(folder: str | Path, where: str, found: dict, config: dict) -> None:
    """config.json's layer count against the blocks the weight files hold, from their headers alone:
    a config.json that claims more is said here, before a model of its depth is built to compare each
    weight (a million claimed layers took minutes and gigabytes). Fewer claimed: the comparison names
    the first weight too many."""
    held = {int(match.group(1)) for key in found if (match := _LAYER_INDEX.search(key))}
    claimed = config["num_hidden_layers"]
    if not held:  # not one block: the weights are not of this model, whatever its depth
        raise UserError(f"model folder '{folder}': the weights in {where} hold none of the {claimed:,} layers its "
                        "config.json describes; they are another model's or damaged.")
    if claimed > len(held):
        raise UserError(f"model folder '{folder}': config.json says num_hidden_layers is {claimed:,} but the weights "
                        f"in {where} are those of {len(held):,} layers; one of them is damaged or another model's.")


def _refuse_beyond_the_load_device(folder: str | Path, config: dict, dtype: torch.dtype,
                                   device: torch.device) -> None:
    """A plain bound: from_pretrained makes every weight in `dtype` on `device` (this host's RAM, or
    one card), so weights that together exceed its memory cannot be loaded; said before it starts.
    The weights counted from the files' headers again (a few reads): checked, they are the model's."""
    found = read_headers(Path(folder), weight_files(Path(folder), config))
    numbers = sum(math.prod(shape) for shape, _ in found.values())
    need = numbers * dtype.itemsize
    if device.type == "cuda":
        have, where = torch.cuda.get_device_properties(device).total_memory, f"{device}'s memory"
    else:
        have, where = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this host's RAM"
    if need > have:
        raise UserError(f"model folder '{folder}' holds {numbers:,} weights, {config_json.gib(need)} in {str(dtype).removeprefix('torch.')}, "
                        f"more than {where} ({config_json.gib(have)}): it cannot be loaded here.")


def _refuse_foreign_files(folder: Path) -> None:
    if (folder / "adapter_config.json").exists():
        raise UserError(
            f"model folder '{folder}' holds adapter_config.json, which transformers would apply over the base "
            "weights; point model at the base model's folder (slimtune export --merge writes a merged one)."
        )
    shards = sorted(p.name for p in folder.iterdir() if DISTRIBUTED_SHARD.match(p.name))
    if shards:
        raise UserError(
            f"model folder '{folder}' holds distributed-checkpoint shards ({shards[0]}, ...), which transformers "
            f"would load instead of {SAFE_WEIGHTS}; slimtune loads {SAFE_WEIGHTS} or {SAFE_INDEX} only."
        )


def weight_files(folder: Path, config: dict) -> list[str]:
    """The files from_pretrained(use_safetensors=True) reads: model.safetensors, else every shard
    model.safetensors.index.json names (config.json's transformers_weights picks one itself)."""
    entry = config.get("transformers_weights")
    if entry is None:
        entry = next((name for name in (SAFE_WEIGHTS, SAFE_INDEX) if (folder / name).is_file()), None)
    if entry is None:
        found = sorted(p.name for p in folder.iterdir() if p.suffix in (".safetensors", ".bin", ".pt", ".pth"))
        if any(name.endswith(".safetensors") for name in found):
            raise UserError(f"model folder '{folder}' has no {SAFE_WEIGHTS} or {SAFE_INDEX} "
                            f"(found {', '.join(found)}).")
        extra = f" (found {', '.join(found)}; slimtune loads safetensors only)" if found else ""
        raise UserError(f"model folder '{folder}' has no *.safetensors weights{extra}.")
    if entry not in (SAFE_WEIGHTS, SAFE_INDEX):
        raise UserError(f"{folder / 'config.json'} names transformers_weights {entry!r}; slimtune loads only "
                        f"{SAFE_WEIGHTS} or {SAFE_INDEX}.")
    if not (folder / entry).is_file():
        raise UserError(f"model folder '{folder}' has no {entry}, which its config.json names as its weights.")
    return _index_shards(folder) if entry == SAFE_INDEX else [entry]


def _index_shards(folder: Path) -> list[str]:
    path = folder / SAFE_INDEX
    try:
        index = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UserError(f"model folder '{folder}': {SAFE_INDEX} is not valid JSON ({err}).") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not (isinstance(weight_map, dict) and weight_map and isinstance(index.get("metadata"), dict)
            and all(isinstance(shard, str) for shard in weight_map.values())):
        raise UserError(f"model folder '{folder}': {SAFE_INDEX} is not a safetensors index (it needs a "
                        "'weight_map' from weight names to shard files and a 'metadata' mapping).")
    shards = sorted(set(weight_map.values()))
    for shard in shards:
        if not shard.endswith(".safetensors") or Path(shard).name != shard or shard.startswith("."):
            raise UserError(f"model folder '{folder}': {SAFE_INDEX} names shard {shard!r}, which is not a "
                            ".safetensors file in the folder; slimtune loads safetensors only.")
        if not (folder / shard).is_file():
            raise UserError(f"model folder '{folder}': {SAFE_INDEX} names shard {shard!r}, which is missing.")
    return shards


def stored_float_dtype(folder: str | Path) -> torch.dtype:
    """The dtype a model folder's floating-point weights are stored in (the most numbers in one, from
    the safetensors headers: no tensor data is read); float32 where it holds none."""
    from safetensors import safe_open

    folder = Path(folder)
    counts: dict[torch.dtype, int] = {}
    for name in weight_files(folder, read_config(folder)):
        with safe_open(str(folder / name), framework="pt") as f:
            for key in f.keys():
                piece = f.get_slice(key)
                dtype = _SAFETENSORS_DTYPES.get(piece.get_dtype())
                if dtype is not None:
                    counts[dtype] = counts.get(dtype, 0) + math.prod(piece.get_shape())
    return max(counts, key=counts.get) if counts else torch.float32


_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}


def read_headers(folder: Path, files: list[str]) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every weight's shape and file, from the safetensors headers alone (no tensor data is read);
    safe_open also checks that the header's offsets cover the file exactly, so a truncated file fails."""
    from safetensors import SafetensorError, safe_open

    found: dict[str, tuple[tuple[int, ...], str]] = {}
    for name in files:
        try:
            with safe_open(str(folder / name), framework="pt") as f:
                for key in f.keys():
                    found.setdefault(key, (tuple(f.get_slice(key).get_shape()), name))
        except (SafetensorError, OSError) as err:
            raise UserError(f"model folder '{folder}': {name} is not a readable safetensors file ({_last_line(err)}); "
                            "it is damaged or incomplete: download or save it again.") from None
        except RuntimeError as err:  # safe_open maps the whole file copy-on-write: the host's commit limit applies
            if "mmap" not in str(err):
                raise
            size = config_json.gib((folder / name).stat().st_size)
            raise UserError(f"model folder '{folder}': {name} is {size}, more than this host's memory can map: it "
                            "cannot be loaded here.") from None
    return found


def _described_weights(folder: Path) -> tuple[dict, list[list[str]], re.Pattern, re.Pattern, str]:
    """The model config.json describes, built on the meta device (no memory): every weight's shape,
    the groups of names sharing one tensor (a tied head), and what transformers ignores when loading."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(folder), local_files_only=True))
    except (ValueError, TypeError, ArithmeticError, RuntimeError, StrictDataclassError) as err:
        raise UserError(f"{folder / 'config.json'} does not describe a model transformers can build "
                        f"({_last_line(err)}).") from None
    state = model.state_dict(keep_vars=True)
    groups: dict[int, list[str]] = {}
    for name, tensor in state.items():
        groups.setdefault(id(tensor), []).append(name)
    # transformers.modeling_utils._adjust_missing_and_unexpected_keys, for our families
    buffers = [name for name, _ in model.named_buffers()]
    unexpected = set(model._keys_to_ignore_on_load_unexpected or ())
    if any(name.endswith("rotary_emb.inv_freq") for name in buffers):
        unexpected.add(r"rotary_emb\.inv_freq")
    if any(name.endswith("position_ids") for name in buffers):
        unexpected.add(r"(^|\.)position_ids$")
    missing = set(model._keys_to_ignore_on_load_missing or ())
    pattern = lambda ps: re.compile("|".join(f"({p})" for p in ps) if ps else r"(?!)")  # noqa: E731
    shapes = {name: tuple(tensor.shape) for name, tensor in state.items()}
    return shapes, list(groups.values()), pattern(missing), pattern(unexpected), model.base_model_prefix


def _compare_weights(folder: Path, where: str, found: dict, shapes: dict, groups: list[list[str]],
                     ignore_missing: re.Pattern, ignore_unexpected: re.Pattern, prefix: str) -> None:
    """Missing (in any name a tied group shares), then differently shaped, then unexpected weights."""
    found = {_model_key(key, shapes, prefix): value for key, value in found.items()}
    missing = [group[0] for group in groups
               if not any(name in found for name in group) and not ignore_missing.search(group[0])]
    if missing:
        raise UserError(f"model folder '{folder}': no weight {missing[0]!r} of the model its config.json "
                        f"describes is in {where} (missing: {len(missing)} of {len(groups)} weights).")
    mismatched = [key for key in shapes if key in found and found[key][0] != shapes[key]]
    if mismatched:
        key = mismatched[0]
        shape, name = found[key]
        raise UserError(f"model folder '{folder}': config.json does not match {name}: weight {key!r} has shape "
                        f"{list(shape)} there but {list(shapes[key])} by config.json "
                        f"(differing: {len(mismatched)} of {len(groups)} weights).")
    unexpected = [key for key in found if key not in shapes and not ignore_unexpected.search(key)]
    if unexpected:
        key = unexpected[0]
        raise UserError(f"model folder '{folder}': {found[key][1]} holds weight {key!r}, which the model its "
                        f"config.json describes does not have (unexpected: {len(unexpected)} weights).")


def _model_key(key: str, shapes: dict, prefix: str) -> str:
    """A checkpoint key as transformers maps it (core_model_loading.rename_source_key): a base
    model's keys gain the prefix, a key with a spurious prefix loses it."""
    bare = key.removeprefix(f"{prefix}.")
    if bare != key and bare in shapes:
        return bare
    return key if key in shapes or f"{prefix}.{key}" not in shapes else f"{prefix}.{key}"


def _refuse_partial_load(folder: str | Path, info: dict) -> None:
    """What check_weights did not foresee but transformers reports: never keep a random weight."""
    for kind in ("missing", "mismatched", "unexpected"):
        keys = sorted(map(str, info.get(f"{kind}_keys") or ()))
        if keys:
            raise UserError(f"model folder '{folder}': its weights do not match its config.json (transformers "
                            f"found {kind} weights loading it: {len(keys)}, first {keys[0]}).")
    if info.get("error_msgs"):
        raise UserError(f"model folder '{folder}': its weights could not be loaded "
                        f"({_last_line(info['error_msgs'][0])}).")


def _last_line(err) -> str:
    """The informative line of a multi-line library message."""
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    return lines[-1] if lines else type(err).__name__


# What a tokenizer is read from (transformers' fast and slow tokenizers): a folder with none of these has none.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def load_tokenizer(folder: str | Path):
    from transformers import AutoTokenizer

    if (Path(folder) / "config.json").is_file():
        read_config(folder)  # AutoTokenizer reads config.json too: its mistakes are said as the model's loading says them
    if Path(folder).is_dir() and not any((Path(folder) / name).is_file() for name in TOKENIZER_FILES):
        raise UserError(f"model folder '{folder}' has no tokenizer files (none of {', '.join(TOKENIZER_FILES)});"
                        " copy them from the model's repository beside its config.json.")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError) as err:
        raise UserError(f"model folder '{folder}' has no usable tokenizer ({_first_line(err)}).") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


@dataclass
class BlockInputs:
    """What every block needs, prepared once per batch."""

    position_ids: torch.Tensor  # (B, T)
    position_embeddings: tuple[torch.Tensor, torch.Tensor]  # cos, sin: (B, T, head_dim)
    segmented: bool = True  # rows may hold packed examples (position ids that restart)
    build_masks: Callable[[], dict] | None = field(default=None, repr=False)
    derived: dict = field(default_factory=dict, repr=False)  # what tiled blocks derive once per batch
    _masks: dict | None = field(default=None, repr=False)

    @property
    def masks(self) -> dict[str, torch.Tensor | None]:
        """Attention masks by layer type (full_attention / sliding_attention), built on first use:
        blocks run in tiles (step.seq_tiles) derive each tile's mask from position_ids instead and
        never ask, so a long packed row never holds a (T, T) mask."""
        if self._masks is None:
            self._masks = self.build_masks() if self.build_masks is not None else {}
        return self._masks


class Stack:
    """The one view of a causal LM every engine uses."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.config = model.config
        self.stages: list[str] = ["loaded"]
        # Set by an engine whose every parameter gradient a block's backward makes is added in place
        # into a tensor that exists after the block's first part (no hook counts the parts, no sink
        # sends them): the planner's estimate may then replay a tiled block's later backward tiles
        # (step/seq_tiles.py) instead of running them.
        self.gradients_accumulate_plainly = False
        # Set by an engine under which only a block's parameters take gradients in its backward (no
        # other tensor of it requires grad): a block none of whose parameters requires grad in a step
        # then makes no gradient but its input's, and its later backward tiles may be replayed too
        # (engine chunk: the blocks outside the active chunk). lsp's Z, not a parameter, rules it out there.
        self.only_parameters_take_gradients = False
        # Set while an engine collects a tiled block's gradient parts outside autograd (lsp's projector
        # check: learning.Collector): the first tile a block's backward runs hands the previous block's
        # parts over and starts this block's, so it always runs; later tiles add in place, and may be
        # replayed where gradients_accumulate_plainly is set too.
        self.first_backward_tile_hands_over = False

    # Read through the model each time: quantization replaces the embedding and head modules.
    @property
    def fake(self) -> bool:
        """The planner's model: fake tensors (its estimate's step), no run to speak to or time."""
        from torch._subclasses.fake_tensor import is_fake

        return any(is_fake(p) for p in self.model.parameters())

    @property
    def embed(self) -> nn.Module:
        return self.model.model.embed_tokens

    @property
    def blocks(self) -> nn.ModuleList:
        return self.model.model.layers

    @property
    def norm(self) -> nn.Module:
        return self.model.model.norm

    @property
    def head(self) -> nn.Module:
        return self.model.lm_head

    @property
    def rotary(self) -> nn.Module:
        return self.model.model.rotary_emb

    def advance(self, stage: str) -> None:
        """Record a build stage, refusing one that comes before a stage already applied."""
        last = BUILD_ORDER.index(self.stages[-1])
        assert BUILD_ORDER.index(stage) > last, f"build stage {stage!r} after {self.stages[-1]!r}: order is {BUILD_ORDER}"
        self.stages.append(stage)

    @property
    def tied(self) -> bool:
        head, embed = self.head, self.embed
        if hasattr(head, "qweight"):  # a quantized tied pair shares one set of codes
            return head.qweight is getattr(embed, "qweight", None)
        return head.weight is embed.weight

    def layer_type(self, index: int) -> str:
        types = getattr(self.config, "layer_types", None)
        if types:
            return types[index]
        # Mistral names no layer types: a set sliding_window applies to every layer.
        return "sliding_attention" if getattr(self.config, "sliding_window", None) else "full_attention"

    def prepare(self, hidden: torch.Tensor, position_ids: torch.Tensor, segmented: bool = True) -> BlockInputs:
        """Rotary tables, and attention masks when a block first asks (BlockInputs.masks). Position
        ids that restart at 0 mark packed examples; the family's own mask builders turn them into
        block-diagonal causal masks. segmented=False (every row is 0..T-1, data.Batch.segmented)
        skips that search, which reads tensor values: SDPA then gets no mask (is_causal), so no
        (T, T) tensor is built."""
        shape_only = hidden.new_empty(*hidden.shape[:2], 0)  # what the mask builders read of hidden, in no bytes
        return BlockInputs(position_ids, self.rotary(hidden, position_ids), segmented,
                           functools.partial(self._masks, shape_only, position_ids, segmented))

    def _masks(self, hidden: torch.Tensor, position_ids: torch.Tensor, segmented: bool) -> dict:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        kwargs = dict(
            config=self.config, inputs_embeds=hidden, attention_mask=None, cache=None,
            position_ids=position_ids if segmented else None,
        )
        masks = {"full_attention": create_causal_mask(**kwargs)}
        if any(self.layer_type(i) == "sliding_attention" for i in range(len(self.blocks))):
            masks["sliding_attention"] = create_sliding_window_causal_mask(**kwargs)
        return masks

    def run_block(self, index: int, hidden: torch.Tensor, inputs: BlockInputs) -> torch.Tensor:
        """hidden (B, T, D) -> (B, T, D) through block `index`."""
        return self.blocks[index](
            hidden,
            attention_mask=inputs.masks[self.layer_type(index)],
            position_ids=inputs.position_ids,
            position_embeddings=inputs.position_embeddings,
        )

    def body_hidden(self, input_ids: torch.Tensor, position_ids: torch.Tensor, run_blocks=None,
                    segmented: bool = True) -> torch.Tensor:
        """input_ids (B, T) -> the last block's output (B, T, D), before the final norm (the loss
        normalises only the rows it scores). `run_blocks(stack, hidden, inputs)` replaces the plain
        loop, e.g. by a checkpointed one. segmented: as in `prepare`. Block boundaries are marked for
        the memory meter, forward and (through gradient hooks) backward: memory.mark. So is the
        embedding's backward (a trained embedding), apart from block 0's: its peak (the table's
        gradient) does not grow with depth as block 0's does (with checkpointing, the bf16 copies
        autocast keeps of every block recomputed so far)."""
        memory.mark("embed")
        hidden = self.embed(input_ids)
        memory.mark_on_backward(hidden, "embed backward")
        inputs = self.prepare(hidden, position_ids, segmented)
        if run_blocks is not None:
            return run_blocks(self, hidden, inputs)
        inputs.masks  # made before block 0's segment: every block uses them
        return self.run_blocks(hidden, inputs)

    def run_blocks(self, hidden: torch.Tensor, inputs: BlockInputs, first: int = 0) -> torch.Tensor:
        """hidden (B, T, D) through blocks first.. in turn (hidden: block `first`'s input), each block's
        forward and backward marked as a segment of its own (memory.mark): the estimate by depth needs
        every block's work apart from the loss's and the embedding's, whose peaks grow with depth at
        other rates."""
        for index in range(first, len(self.blocks)):
            memory.mark("forward", index)
            hidden = self.run_block(index, hidden, inputs)
            memory.mark_on_backward(hidden, "backward", index)
        return hidden

    def final_hidden(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """input_ids (B, T) -> normed hidden states (B, T, D), ready for the head."""
        return self.norm(self.body_hidden(input_ids, position_ids))
