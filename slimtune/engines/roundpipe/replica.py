"""A worker's own view of the model: the module tree copied without its tensors.

Workers run stages at the same time, and two of them may run the same block at once (the forward
job of micro-batch M-1 beside the backward job of micro-batch 0). A module's parameters cannot point
at two devices' copies at once, so every worker gets a replica of the module tree: new module
objects whose tensor entries start as the original tensors (nothing is copied), and binding a stage
on a worker replaces entries in the replica's own `_parameters` / `_buffers` tables only. The
original model is never touched by a worker, and no torch.nn class is patched.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from slimtune.device import runtime
from slimtune.model.stack import Stack


class Replica:
    def __init__(self, model: nn.Module):
        memo: dict[int, object] = {}
        for module in model.modules():  # share every tensor: parameters, buffers, plain attributes
            for value in (*module._parameters.values(), *module._buffers.values(), *vars(module).values()):
                if isinstance(value, torch.Tensor):
                    memo[id(value)] = value
        self.model = copy.deepcopy(model, memo)
        self.stack = Stack(self.model)
        copies = dict(self.model.named_modules(remove_duplicate=False))
        self._twin = {id(m): copies[name] for name, m in model.named_modules(remove_duplicate=False)}

    def twin(self, module: nn.Module) -> nn.Module:
        """The replica's counterpart of one of the original model's modules."""
        return self._twin[id(module)]

    def bind(self, tensors: list[runtime.SlotTensor], copies: list[torch.Tensor], with_grads: bool) -> list[nn.Parameter]:
        """Point the replica's entries for `tensors` at their device `copies`; returns the new
        trainable parameters (leaves whose .grad collects the job's gradients) when `with_grads`."""
        trained = []
        for t, x in zip(tensors, copies):
            owner = self.twin(t.owner)
            if t.param is None:
                owner._buffers[t.attr] = x
                continue
            param = nn.Parameter(x, requires_grad=with_grads and t.trainable)
            owner._parameters[t.attr] = param
            if param.requires_grad:
                trained.append(param)
        return trained

    def unbind(self, tensors: list[runtime.SlotTensor]) -> None:
        """Back to the original tensors (the device copies are freed with the last reference)."""
        for t in tensors:
            owner = self.twin(t.owner)
            if t.param is None:
                owner._buffers[t.attr] = t.host
            else:
                owner._parameters[t.attr] = t.param
