"""A run's model and engine, put together in one place and one order.

    precision      auto -> bf16 on CUDA, fp32 on the CPU
    weight dtype   what the weights are loaded in (a frozen LoRA base in bf16 under bf16; the engine's
                   own rule where it registered one)
    load device    the host when a 4-bit base is quantized from there, the engine keeps the model
                   on the host, or an fsdp job shards it from there; else the device
    method         4-bit base (quant), then LoRA adapters, or full fine-tuning minus freeze patterns
    placement      the model moved to the device, unless the engine keeps it on the host or an fsdp
                   job's sharding moves it (a unit at a time)
    engine         the registered engine's constructor: Engine(stack, cfg, device, precision)

train.build, the planner's estimate (on fake tensors), the tests and the benchmarks all assemble a
run here; `Stack.advance` asserts the order.
"""

from __future__ import annotations

import fnmatch

import torch
from torch import nn

from slimtune import engines
from slimtune.model import lora, quant
from slimtune.config import RunConfig
from slimtune.dist import sharding
from slimtune.dist.ranks import SINGLE, Dist
from slimtune.engines.base import Engine
from slimtune.errors import UserError
from slimtune.model.stack import Stack, empty_model, load_model

HOST = torch.device("cpu")


def resolve_device(name: str, dist: Dist = SINGLE, flag: bool = False) -> torch.device:
    """The run's device; under torchrun on CUDA the rank's own card, cuda:LOCAL_RANK. `flag`: the user
    gave it as --device (chat, eval), not as the device setting (train), and the sentences say so."""
    setting, spell = ("--device", "--device {}") if flag else ("device", "device={}")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"{setting} is '{name}' but no CUDA device is available; use {spell.format('auto')} or "
                        f"{spell.format('cpu')}.")
    if name.startswith("cuda:") and torch.device(name).index >= torch.cuda.device_count():
        raise UserError(f"{setting} is '{name}' but this machine has {torch.cuda.device_count()} CUDA device(s),"
                        f" numbered from 0.")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and dist.active:
        if dist.local_rank >= torch.cuda.device_count():
            raise UserError(f"rank {dist.rank} has local rank {dist.local_rank}, but this machine has "
                            f"{torch.cuda.device_count()} CUDA device(s): start at most that many processes per node.")
        return torch.device("cuda", dist.local_rank)
    return torch.device(name)


def resolve_precision(name: str, device: torch.device) -> str:
    """auto: bf16 autocast over fp32 weights on CUDA, plain fp32 on the CPU (bf16 is slow there) and on
    a card without bf16 arithmetic of its own (before Ampere: T4, V100), where torch emulates it. A plan
    made with no card here is made for one that has it."""
    if name == "auto":
        if device.type != "cuda":
            return "fp32"
        native = not torch.cuda.is_available() or torch.cuda.is_bf16_supported(including_emulation=False)
        return "bf16" if native else "fp32"
    return name


def weight_dtype(precision: str, method: str) -> torch.dtype:
    """Trained weights stay fp32 under bf16 autocast; a frozen LoRA base is stored in bf16."""
    if precision == "fp64":
        return torch.float64
    if precision == "bf16" and method == "lora":
        return torch.bfloat16
    return torch.float32


def run_weight_dtype(cfg: RunConfig, precision: str) -> torch.dtype:
    """What the run's model is loaded in: the engine's own rule where it has one (an engine that keeps
    the trained state elsewhere may hold bf16 weights), else weight_dtype's."""
    own = engines.get(cfg.engine).weight_dtype
    return (own or weight_dtype)(precision, cfg.method)


def kept_on_host(cfg: RunConfig, dist: Dist = SINGLE) -> bool:
    """Whether the model stays on the host once loaded: the engine keeps it there, or it is sharded
    from there. An fsdp rank never holds the whole model on its card (Llama-3.1-8B's fp32 masters are
    32 GB, a 70B base's 4-bit codes 37 GiB): FSDP2's fully_shard moves one unit at a time to the
    device, cuts it and keeps the rank's shard (in host RAM again under dist.offload=cpu)."""
    return engines.get(cfg.engine).model_on_host or sharding.sharded_run(cfg, dist)


def load_device(cfg: RunConfig, device: torch.device, dist: Dist = SINGLE) -> torch.device:
    """Where the weights are loaded: a 4-bit base is loaded on the host and quantized onto the device,
    so the dense weights never sit there; a model kept on the host (kept_on_host) is loaded there."""
    return HOST if cfg.quant.scheme != "none" or kept_on_host(cfg, dist) else device


def load_stack(cfg: RunConfig, device: torch.device, precision: str, dist: Dist = SINGLE) -> Stack:
    """The model folder cfg.model, loaded in the run's weight dtype where it belongs. In an fsdp job
    only rank 0 reads the weights; the others build the model on the meta device and are handed their
    shards (sharding.fill_from_rank0), so a machine of 8 ranks holds one loaded copy, not 8."""
    dtype = run_weight_dtype(cfg, precision)
    if sharding.sharded_run(cfg, dist) and not dist.is_main:
        return Stack(empty_model(cfg.model, dtype))
    return Stack(load_model(cfg.model, dtype, load_device(cfg, device, dist)))


def stack_of(model: nn.Module, cfg: RunConfig, device: torch.device, precision: str) -> Stack:
    """An in-memory model (tests, benchmarks) as load_stack would have given it: dtype and place."""
    return Stack(model.to(dtype=run_weight_dtype(cfg, precision), device=load_device(cfg, device)))


def apply_method(cfg: RunConfig, stack: Stack, codes_device: torch.device | None = None) -> None:
    """A 4-bit base (its codes on `codes_device`), then LoRA adapters on the chosen linears, or full
    fine-tuning minus the freeze patterns."""
    if cfg.quant.scheme != "none":
        stack.advance("quant")
        quant.apply(stack.model, cfg.quant, device=codes_device)
    stack.advance("adapters")
    if cfg.method == "lora":
        lora.apply(stack.model, cfg.lora)
        return
    # Every name a parameter goes by: a tied head's weight is the embedding's, named twice (lm_head.weight
    # too), and freezing either name freezes the one tensor.
    named = list(stack.model.named_parameters(remove_duplicate=False))
    unmatched = [p for p in cfg.freeze if not any(fnmatch.fnmatchcase(name, p) for name, _ in named)]
    if unmatched:
        raise UserError(f"freeze pattern '{unmatched[0]}' matches no parameter of the model (fnmatch on names such as"
                        f" '{named[min(1, len(named) - 1)][0]}'; '*embed_tokens*' freezes the embedding).")
    frozen = {id(param) for name, param in named if any(fnmatch.fnmatchcase(name, p) for p in cfg.freeze)}
    for param in stack.model.parameters():
        param.requires_grad_(id(param) not in frozen)
    if not any(p.requires_grad for p in stack.model.parameters()):
        raise UserError(f"freeze patterns {cfg.freeze} freeze every parameter; nothing would train.")


def assemble(cfg: RunConfig, stack: Stack, device: torch.device, precision: str, dist: Dist = SINGLE) -> Engine:
    """Method, placement and engine for a loaded stack; `dist`: the ranks it trains with."""
    spec = engines.get(cfg.engine)
    on_host = kept_on_host(cfg, dist)
    apply_method(cfg, stack, HOST if on_host else device)
    if not on_host:
        place(stack.model, device)
    stack.advance("engine")
    return spec.build(stack, cfg, device, precision, dist)


def place(model: nn.Module, device: torch.device) -> None:
    """Move the model to `device` unless every tensor is there already (fake tensors, which the
    estimate uses, cannot be moved by Module.to and are already on the CPU device)."""
    tensors = [*model.parameters(), *model.buffers()]
    if any(t.device != device for t in tensors):
        model.to(device)
