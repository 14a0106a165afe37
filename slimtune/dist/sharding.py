"""dist.strategy=fsdp: every weight of the resident engine sharded across ranks with FSDP2
(`torch.distributed.fsdp.fully_shard`).

Each weight, its gradient and AdamW's moments are held as DTensor shards (dim 0, 1/world each), so
no rank holds a whole copy of any (shard_model). Each decoder block is an FSDP unit: its forward
all-gathers its weights and frees them after, its backward gathers them again and reduce-scatters
the gradients. So is an untied embedding. The final norm, the head and a tied embedding (one
parameter) belong to the root unit, StepRoot, whose forward is the engine's whole forward and loss:
they are gathered for the step and their gradients reduce-scattered after its backward. The slimtune
step calls the blocks and the embedding as modules, so FSDP's own hooks do all this; nothing is
patched.

Mixed precision (precision_policy): under precision=bf16 the weights are gathered and computed in
bf16 and the gradients reduce-scattered in fp32 (dist.param_dtype, dist.reduce_dtype); the shards,
the masters AdamW updates, stay fp32.

A 4-bit base is sharded as its codes and scales (model/quant.py's QuantWeight.hold_as_rows: uint8
rows of whole quantization blocks, which mixed precision leaves uncast). In a launched job only rank 0
has read the weights; the other ranks built the model on the meta device and are sent their shards
after sharding (fill_from_rank0).

Gradients are summed, not averaged, across ranks (divide factor 1): every engine divides its loss
by the trained-token count of the whole step, summed over ranks, so a sum is the global gradient.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from slimtune.dist.ranks import Dist
from slimtune.errors import UserError


def sharded_run(cfg, dist: Dist) -> bool:
    """dist.strategy=fsdp across several ranks: the model is sharded (in one process nothing is)."""
    return cfg.dist.strategy == "fsdp" and dist.active


def gather_dtype(param_dtype: str, precision: str) -> torch.dtype | None:
    """The dtype FSDP gathers (and the step computes with) the weights in; None: their own dtype.
    bf16 only under precision=bf16: elsewhere nothing casts the activations to meet bf16 weights."""
    if param_dtype == "auto":
        return torch.bfloat16 if precision == "bf16" else None
    if param_dtype == "bf16" and precision != "bf16":
        raise UserError(f"dist.param_dtype=bf16 computes with bf16 weights and needs precision=bf16 (it is {precision});"
                        " leave dist.param_dtype=auto.")
    if param_dtype == "fp32" and precision == "fp64":
        raise UserError("dist.param_dtype=fp32 would round the fp64 weights of precision=fp64; leave dist.param_dtype=auto.")
    return torch.bfloat16 if param_dtype == "bf16" else None


def precision_policy(dist_cfg, precision: str):
    """FSDP2's MixedPrecisionPolicy for the run: weights gathered in gather_dtype, gradients reduce-
    scattered in dist.reduce_dtype when that is bf16 (else in their own dtype), the sharded masters
    and AdamW in the weights' own dtype (fp32). Inputs are not cast (cast_forward_inputs=False): the
    step's autocast casts what the matmuls take, as it does on one process."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    gathered = gather_dtype(dist_cfg.param_dtype, precision)
    if dist_cfg.reduce_dtype == "bf16" and gathered is None:
        raise UserError("dist.reduce_dtype=bf16 rounds the gradients of bf16 gathers; it needs dist.param_dtype=bf16"
                        " (the default under precision=bf16).")
    reduced = None if gathered is None else {"fp32": torch.float32, "bf16": torch.bfloat16}[dist_cfg.reduce_dtype]
    return MixedPrecisionPolicy(param_dtype=gathered, reduce_dtype=reduced, cast_forward_inputs=False)


class StepRoot(nn.Module):
    """FSDP's root unit over the whole model (its child): its forward is the function handed in, the
    engine's forward and loss, so the root's own hooks gather what no block holds (the final norm,
    the head, a tied embedding) before it, and reduce-scatter their gradients after its backward."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, run):
        return run()


def shard_model(stack, device: torch.device, dist: Dist, policy, offload: bool = False) -> StepRoot:
    """Every weight sharded over all ranks (a 1-D mesh on the run's device type), gathered as
    `policy` (precision_policy) says: each block its own unit; an untied embedding its own (gathered
    for its lookup, again for its backward); the root (StepRoot) the rest, gathered from the start
    of the step's forward to the end of its backward (the loss reads the head's weight in tiles
    rather than calling the head module, and a tied weight serves the first op and the last).
    `offload`: every shard, its gradient and (made by the optimizer after) AdamW's moments in host RAM
    (FSDP2's CPUOffloadPolicy: a unit's shards are copied to the device for its gather, its gradients
    copied back after their reduce-scatter)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    with unset_fake_temporarily():  # the planner's fake step (fake_ranks): the mesh reads its rank table's values
        mesh = init_device_mesh(device.type, (dist.world_size,))
    units = [*stack.blocks, *([] if stack.tied else [stack.embed])]
    # pin_memory only where there is a device to copy to (pinning raises without one).
    placement = CPUOffloadPolicy(pin_memory=device.type == "cuda") if offload else OffloadPolicy()
    for unit in units:
        fully_shard(unit, mesh=mesh, reshard_after_forward=True, mp_policy=policy, offload_policy=placement)
    root = StepRoot(stack.model)
    # a tied pair: one parameter, FSDP sets it on both modules
    fully_shard(root, mesh=mesh, mp_policy=policy, offload_policy=placement)
    for unit in (*units, root):
        unit.set_gradient_divide_factor(1.0)
        # Plain SUM collectives with the factor applied after (exactly 1): gloo has no PREMUL_SUM.
        unit.set_force_sum_reduction_for_comms(True)
    return root


def ranks_await_weights(model: nn.Module, dist: Dist) -> bool:
    """Whether any rank built its model on the meta device (assembly.load_stack: only rank 0 reads the
    weights) and must be sent them after sharding (fill_from_rank0): a max over ranks, so every rank
    agrees. Where every rank loaded its own weights (the tests' jobs, the planner's fake rank: its
    fake collectives hand back its own value), none is sent."""
    empty = any(t.is_meta for t in (*model.parameters(), *model.buffers()))
    return bool(dist.max_floats([float(empty)], "the check for ranks awaiting weights")[0])


def _tensors_by_name(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of `model`, by name, in module order (the same on every rank)."""
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def held_for_sending(model: nn.Module, dist: Dist) -> dict[str, torch.Tensor]:
    """Rank 0's parameters and buffers by name, before sharding, as aliases of their storage on the
    host: FSDP moves each unit to the device by swapping a parameter's data, and an alias of the
    Parameter itself would follow it there and keep every unit's whole copy on the card."""
    if not dist.is_main:
        return {}
    return {n: t.detach() for n, t in _tensors_by_name(model).items()}


def fill_from_rank0(root: nn.Module, model: nn.Module, whole: dict[str, torch.Tensor], dist: Dist,
                    device: torch.device, offload: bool) -> None:
    """After shard_model, when ranks_await_weights: a rank whose model was built on the meta device
    allocates its shards and buffers and is sent rank 0's tensors (`whole`, held_for_sending) one at a
    time, in rank 0's order, keeping its shard of each. Rank 0's shards were cut from its own tensors
    by fully_shard. Names, shapes and parameter dtypes are compared on every rank first, and a
    difference ends every rank alike (rather than a broadcast that pairs unlike tensors)."""
    from torch import distributed as tdist

    sent_as = dist.broadcast_object({n: (t.dtype, tuple(t.shape)) for n, t in whole.items()} if dist.is_main
                                    else None, "the weights' layout from rank 0")
    live, parameters = _tensors_by_name(model), dict(model.named_parameters())
    unlike = live.keys() != sent_as.keys() or any(
        tuple(t.shape) != sent_as[n][1] or (n in parameters and t.dtype != sent_as[n][0]) for n, t in live.items())
    if dist.max_floats([float(unlike)], "the check of the weights' layout")[0]:
        raise RuntimeError("a rank built its model unlike rank 0's (names, shapes or dtypes differ); no weights"
                           " were sent.")
    if any(t.is_meta for t in live.values()):
        # FSDP2's deferred initialisation (on the root: every unit's storage reset), shards where they
        # live (host RAM under offload), buffers where the step reads them.
        root.to_empty(device=HOST if offload else device)
        for module in model.modules():
            for name, buffer in module.named_buffers(recurse=False):
                setattr(module, name, buffer.to(device))
        live = _tensors_by_name(model)
    for name, (dtype, shape) in sent_as.items():
        sent = whole[name].to(device) if dist.is_main else torch.empty(shape, dtype=dtype, device=device)
        dist.collective(lambda: tdist.broadcast(sent, src=0, group=dist.device_group), f"{name} from rank 0")
        if not dist.is_main:
            _keep_own_part(live[name], sent, dist)
        del sent


def _keep_own_part(target: torch.Tensor, whole: torch.Tensor, dist: Dist) -> None:
    """This rank's part of `whole` into `target`: a shard's rows as FSDP2 cuts them (torch.chunk on
    dim 0, ranks past the last chunk empty), cut on the device where `whole` arrived, one copy to
    where the shard lives; a buffer whole."""
    with torch.no_grad():
        if not is_sharded(target):
            target.copy_(whole)
            return
        pieces = torch.chunk(whole, dist.world_size, dim=0)
        local = target.to_local()
        if dist.rank < len(pieces):
            local.copy_(pieces[dist.rank])


HOST = torch.device("cpu")
UNTILED = 2**62  # activations.seq_tile that no row reaches: a checkpointed block runs whole


def whole_blocks(activations_cfg):
    """The activations settings a sharded run uses: a checkpointed block runs whole, not in sequence
    tiles (auto tiles included): FSDP gathers a block's weights when the block module is called, and
    a tile calls the block's parts."""
    return dataclasses.replace(activations_cfg, seq_tile=UNTILED, mlp_chunk=0)


def refusal(cfg) -> str | None:
    """Why dist.strategy=fsdp cannot run `cfg` yet, in one sentence (None: it can)."""
    acts = cfg.activations
    if acts.checkpoint != "none" and acts.tile:
        return (f"dist.strategy=fsdp runs a checkpointed block whole, not in sequence tiles (FSDP gathers a block"
                f" when the block module is called, and a tile calls its parts); set activations.seq_tile=0 (it is"
                f" {acts.tile}), or use dist.strategy=ddp.")
    if acts.checkpoint != "none" and acts.cache == "small":
        return ("dist.strategy=fsdp recomputes a block through its module call, and activations.cache=small would hand"
                " back logged op outputs there, FSDP's gathers among them; set activations.cache=none or last_k.")
    return None


def local_bytes(tensors) -> int:
    """Bytes this process holds of `tensors`: a shard's own part only."""
    held = [t.to_local() if is_sharded(t) else t for t in tensors if t is not None]
    return sum(t.numel() * t.element_size() for t in held)


def mark_offloaded(tensors) -> None:
    """Declare the shards of `tensors` host memory (dist.offload=cpu): the meter counts them no more,
    as a GPU's allocator never sees them."""
    from slimtune.device import memory

    for t in tensors:
        if t is not None:
            memory.mark_host_resident(t.to_local() if is_sharded(t) else t)


def is_sharded(tensor: torch.Tensor | None) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def split_by_sharding(groups: list[tuple[list[torch.Tensor], float]]) -> list[tuple[list[torch.Tensor], float]]:
    """Optimizer groups with sharded and whole tensors apart (fused AdamW takes one kind per group)."""
    out = []
    for params, decay in groups:
        for kind in (True, False):
            chosen = [p for p in params if is_sharded(p) == kind]
            if chosen:
                out.append((chosen, decay))
    return out


def total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The global L2 norm of whole and sharded gradients (a sharded norm is gathered: one all-reduce)."""
    sharded = [g for g in grads if is_sharded(g)]
    whole = [g for g in grads if not is_sharded(g)]
    norms = [torch.nn.utils.get_total_norm(whole, foreach=True)] if whole else []
    if sharded:
        norms.append(torch.nn.utils.get_total_norm(sharded, foreach=True).full_tensor())
    return torch.linalg.vector_norm(torch.stack(norms))


def scale_(grads: list[torch.Tensor], coefficient: torch.Tensor) -> None:
    """Multiply every gradient by the clipping coefficient (a shard's local part, in place: the
    coefficient stays a tensor, which the planner's fake step cannot read as a number)."""
    held = [g.to_local() if is_sharded(g) else g for g in grads]
    if held:
        torch._foreach_mul_(held, coefficient.to(held[0].device))


def full(tensor: torch.Tensor, keep: bool = True) -> torch.Tensor | None:
    """The whole tensor on the host: a shard is gathered from every rank first (a collective: every
    rank calls it, in the same order); `keep=False` (a rank that writes nothing) gathers and drops it."""
    if is_sharded(tensor):
        tensor = tensor.full_tensor()
    return tensor.detach().cpu() if keep else None


def copy_into(target: torch.Tensor, source: torch.Tensor) -> None:
    """Copy a whole tensor (a checkpoint's) into `target`; a sharded target keeps its own shard."""
    from torch.distributed.tensor import distribute_tensor

    with torch.no_grad():
        if is_sharded(target):
            # src_data_rank=None: every rank holds the whole source and cuts its own shard, no traffic.
            shard = distribute_tensor(source.to(target.device, target.dtype), target.device_mesh, target.placements,
                                      src_data_rank=None)
            target.to_local().copy_(shard.to_local())
        else:
            target.copy_(source)
