"""Slice-aware autograd ops for engine chunk (spec chunkft.md 2.2): a backward that makes weight
gradients only for the active slice of each parameter, so no dense `.grad` ever exists.

ChunkFT trains one chunk of the parameter byte stream per optimizer step; a chunk holds, of each
tensor, one contiguous range along one axis (`ActiveSlice`). The wrappers below replace built
Linear, Embedding, LayerNorm and RMSNorm modules in place (`install`), keeping their Parameter
objects under the same names, so state_dict keys and export are unchanged. Each op's backward
- returns the exact full input gradient, so backprop continues down to the lowest active slice
  (every trainable parameter keeps requires_grad=True; the engine runs what lies below that slice's
  block without autograd: chunk/reach.py);
- returns None for its weight and bias, so `p.grad` stays None, and instead adds the active
  slice's gradient, computed from the incoming dY (so any loss scale is already in it), into the
  slice's side buffer (`ActiveSlice.add`, fp32 for 16-bit and fp32 weights, fp64 for fp64), which
  sums exactly over micro-batches until the engine takes it;
- for an empty range computes no weight gradient at all (the spec's only compute saving).
A full-size weight gradient is never formed: Linear multiplies dY by the slice's input columns (or
dY's slice by X), Embedding scatters into the slice's rows only.

The reference release's pitfalls (spec 4) avoided here: RMSNorm's backward is the RMSNorm formula
(no mean subtraction; the reference used LayerNorm's, 28-65 % off at input mean 0.7); a bias has its
own range, independent of its weight's; the Embedding row `padding_idx` gets no gradient; a
parameterised module without a slice-aware op is an error at install, never a silently frozen
tensor; modules are replaced one by one, never the global torch.nn classes.

Ranges are read when the forward runs (the engine sets them before the step; with activation
checkpointing the recomputed forward sees the same ones). The ops read no tensor value and make no
data-dependent shape, so they run under fake tensors (the planner's estimate), and they disable
autocast and pick dtypes explicitly: a Linear computes in its weight's dtype, as autocast's linear
does in a 16-bit model, the norms in at least fp32; every op returns dX in its input's dtype.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from slimtune.errors import UserError

# The Hugging Face RMSNorm classes whose forward SlicedRMSNorm reproduces (weight, variance_epsilon,
# weight * normalised-input-in-its-dtype). Gemma's (1 + weight) variant is not one of them.
RMSNORM_CLASSES = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")


def side_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of a side gradient and of the norms' arithmetic: fp32, or fp64 for fp64."""
    return torch.promote_types(dtype, torch.float32)


class ActiveSlice:
    """The active range [start, stop) of one parameter along one axis, and the side buffer its
    gradient accumulates in until the engine takes it. Starts empty."""

    def __init__(self, param: nn.Parameter, axis: int):
        if not 0 <= axis < param.dim():
            raise ValueError(f"axis {axis} is not an axis of a {param.dim()}-D parameter.")
        self.param, self.axis = param, axis
        self.start = self.stop = 0
        self.grad: torch.Tensor | None = None
        # Where contributions go instead of `grad` when set: a chunk.downlink.Downlink streaming them
        # to host accumulators as backward makes them (engine chunk, chunk.gradients=host).
        self.sink = None

    def __repr__(self) -> str:
        return f"ActiveSlice(shape={tuple(self.param.shape)}, axis={self.axis}, range=[{self.start}, {self.stop}))"

    def set(self, start: int, stop: int) -> None:
        """Makes [start, stop) the active range; the previous range's gradient must have been taken."""
        if self.grad is not None:
            raise ValueError("The previous range's gradient was not taken; take() it before set().")
        length = self.param.shape[self.axis]
        if not 0 <= start <= stop <= length:
            raise ValueError(f"Range [{start}, {stop}) is not within axis {self.axis} of length {length}.")
        self.start, self.stop = start, stop

    @property
    def empty(self) -> bool:
        return self.start == self.stop

    @property
    def shape(self) -> torch.Size:
        shape = list(self.param.shape)
        shape[self.axis] = self.stop - self.start
        return torch.Size(shape)

    def _check(self, g: torch.Tensor, rows: int | None = None) -> None:
        shape = self.shape if rows is None else self._rows_shape(rows)
        if g.shape != shape:
            raise ValueError(f"Gradient of shape {tuple(g.shape)} for a slice of shape {tuple(shape)}.")

    def _rows_shape(self, rows: int) -> torch.Size:
        shape = list(self.shape)
        shape[self.axis] = rows
        return torch.Size(shape)

    def _buffer(self, like: torch.Tensor) -> torch.Tensor:
        """The side buffer, made zero on first use."""
        if self.grad is None:
            self.grad = like.new_zeros(self.shape, dtype=side_dtype(self.param.dtype))
        return self.grad

    def add(self, g: torch.Tensor) -> None:
        """Accumulates g, the gradient of the active slice, into the side buffer (a copy on first
        use: never the caller's tensor), or hands it to the sink."""
        self._check(g)
        if self.sink is not None:
            self.sink.add(self, 0, g)
        elif self.grad is None:
            self.grad = g.to(dtype=side_dtype(self.param.dtype), copy=True)
        else:
            self.grad.add_(g)

    def rows(self, lo: int, hi: int, like: torch.Tensor) -> torch.Tensor:
        """A buffer to accumulate the gradient of the slice's positions [lo, hi) along its axis in
        (an LM-head tile's rows): a view of the side buffer, or, with a sink, a zeroed tensor that
        `rows_done` then hands over."""
        if self.sink is not None:
            return like.new_zeros(self._rows_shape(hi - lo), dtype=side_dtype(self.param.dtype))
        return self._buffer(like).narrow(self.axis, lo, hi - lo)

    def rows_done(self, lo: int, buffer: torch.Tensor) -> None:
        """The buffer `rows(lo, ...)` gave is complete."""
        if self.sink is not None:
            self._check(buffer, rows=buffer.shape[self.axis])
            self.sink.add(self, lo, buffer)

    def add_indexed(self, ids: torch.Tensor, source: torch.Tensor) -> None:
        """Adds source's rows (n, ...) at the slice's positions ids (n,) along axis 0 (an
        embedding's rows by token id; rows outside the slice masked to zero by the caller)."""
        if self.axis != 0:
            raise ValueError("add_indexed adds rows along axis 0.")
        if self.sink is not None:
            self.sink.add_indexed(self, ids, source)
        else:
            self._buffer(source).index_add_(0, ids, source)

    def take(self) -> torch.Tensor | None:
        """The accumulated gradient (None if nothing was added); the buffer starts again empty."""
        grad, self.grad = self.grad, None
        return grad

    def view(self, t: torch.Tensor) -> torch.Tensor:
        """The active slice of t, a tensor of the parameter's shape."""
        return t.narrow(self.axis, self.start, self.stop - self.start)


def _live_range(s: ActiveSlice | None) -> tuple[int, int] | None:
    """s's range when it has a non-empty one, else None: no gradient to make."""
    return None if s is None or s.empty else (s.start, s.stop)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """(..., n) -> (tokens, n)."""
    return t.reshape(-1, t.shape[-1])


def _token_sum(t: torch.Tensor, rng: tuple[int, int]) -> torch.Tensor:
    """Sum over tokens of t[..., a:b], in at least fp32: the gradient of a per-feature parameter."""
    a, b = rng
    return _rows(t)[:, a:b].sum(0, dtype=side_dtype(t.dtype))


def _check_slices(module: nn.Module, slices: dict[str, ActiveSlice], axes: dict[str, tuple[int, ...]]) -> None:
    """Each slice is of the module's own parameter of that name, along an axis its op supports."""
    for name, s in slices.items():
        if name not in axes or s.param is not getattr(module, name, None):
            raise ValueError(f"{type(module).__name__} has no parameter {name!r} for this slice.")
        if s.axis not in axes[name]:
            raise ValueError(f"{type(module).__name__}.{name} can be sliced along axis {axes[name]}, not {s.axis}.")


# ---------------------------------------------------------------- Linear


def _linear_weight_grad(dy: torch.Tensor, x: torch.Tensor, axis: int, rng: tuple[int, int]) -> torch.Tensor:
    """The slice of dY^T X: input columns W[:, a:b] (axis 1) or output rows W[a:b, :] (axis 0)."""
    a, b = rng
    dy, x = _rows(dy), _rows(x)
    if axis == 1:
        return dy.t() @ x[:, a:b]
    return dy[:, a:b].t() @ x


class _SlicedLinearFn(torch.autograd.Function):
    """y = x W^T + b in W's dtype; backward: dX = dY W, the weight and bias slices' gradients."""

    @staticmethod
    def forward(ctx, x, weight, bias, w_slice: ActiveSlice | None, b_slice: ActiveSlice | None):
        with torch.autocast(x.device.type, enabled=False):
            ctx.x_dtype = x.dtype
            x = x.to(weight.dtype)
            y = F.linear(x, weight, None if bias is None else bias.to(weight.dtype))
        ctx.w_slice, ctx.w_range = w_slice, _live_range(w_slice)
        ctx.b_slice, ctx.b_range = b_slice, _live_range(b_slice)
        # X is kept whether or not the weight's range is live: above the active chunk's lowest block
        # (the engine runs the blocks below it without grad: chunk/reach.py) every op keeps what full
        # fine-tuning keeps. Keeping only the active modules' inputs (the other half of the spec's
        # open decision 1) is not taken: an op with no live range needs only W for dX.
        ctx.save_for_backward(x, weight)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx = None
        with torch.autocast(dy.device.type, enabled=False):
            dy = dy.to(weight.dtype)
            if ctx.needs_input_grad[0]:
                dx = (dy @ weight).to(ctx.x_dtype)
            if ctx.w_range:
                ctx.w_slice.add(_linear_weight_grad(dy, x, ctx.w_slice.axis, ctx.w_range))
            if ctx.b_range:
                ctx.b_slice.add(_token_sum(dy, ctx.b_range))
        return dx, None, None, None, None


class SlicedLinear(nn.Linear):
    """An nn.Linear replaced in place: same `weight` and `bias` Parameters, slice-aware backward.
    Weight axis 1 (input columns, the "row" strategy) or 0 (output rows); the bias has its own range."""

    def __init__(self, linear: nn.Linear, slices: dict[str, ActiveSlice]):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        _check_slices(self, slices, {"weight": (0, 1), "bias": (0,)})
        self.slices = slices

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SlicedLinearFn.apply(x, self.weight, self.bias, self.slices.get("weight"), self.slices.get("bias"))


# ---------------------------------------------------------------- Embedding


def _add_embedding_rows(active: ActiveSlice, dy: torch.Tensor, ids: torch.Tensor, rng: tuple[int, int],
                        padding_idx: int | None) -> None:
    """Rows a:b of the embedding gradient: output gradients of the tokens whose id is in [a, b) and
    is not padding_idx, scatter-added by id. Masks instead of boolean indexing: no data-dependent
    shape, so it runs under fake tensors."""
    a, b = rng
    dtype = side_dtype(dy.dtype)
    ids, dy = ids.reshape(-1), _rows(dy)
    keep = (ids >= a) & (ids < b)
    if padding_idx is not None:
        keep &= ids != padding_idx
    active.add_indexed(torch.where(keep, ids - a, 0), dy.to(dtype) * keep[:, None].to(dtype))


class _SlicedEmbeddingFn(torch.autograd.Function):
    """y = weight[ids]; backward: rows a:b of the gradient (no input gradient: ids are indices)."""

    @staticmethod
    def forward(ctx, ids, weight, w_slice: ActiveSlice | None, padding_idx: int | None):
        y = F.embedding(ids, weight, padding_idx)
        ctx.w_slice, ctx.w_range, ctx.padding_idx = w_slice, _live_range(w_slice), padding_idx
        ctx.save_for_backward(ids)  # kept for any range (see _SlicedLinearFn)
        return y

    @staticmethod
    def backward(ctx, dy):
        (ids,) = ctx.saved_tensors
        if ctx.w_range:
            with torch.autocast(dy.device.type, enabled=False):
                _add_embedding_rows(ctx.w_slice, dy, ids, ctx.w_range, ctx.padding_idx)
        return None, None, None, None


class SlicedEmbedding(nn.Embedding):
    """An nn.Embedding replaced in place: same `weight`, sliced by vocabulary rows (axis 0).
    Refuses max_norm (it renormalises the weight in forward), scale_grad_by_freq and sparse."""

    def __init__(self, embedding: nn.Embedding, slices: dict[str, ActiveSlice]):
        for option in ("max_norm", "scale_grad_by_freq", "sparse"):
            if getattr(embedding, option):
                raise ValueError(f"SlicedEmbedding does not support {option}={getattr(embedding, option)!r}.")
        nn.Module.__init__(self)
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.padding_idx, self.max_norm, self.norm_type = embedding.padding_idx, None, embedding.norm_type
        self.scale_grad_by_freq, self.sparse = False, False
        self.weight = embedding.weight
        _check_slices(self, slices, {"weight": (0,)})
        self.slices = slices

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return _SlicedEmbeddingFn.apply(ids, self.weight, self.slices.get("weight"), self.padding_idx)


# ---------------------------------------------------------------- RMSNorm


def _rms_normalised(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x -> (x r, r) in at least fp32, r = rsqrt(mean(x^2) + eps), by Hugging Face's ops."""
    h = x.to(side_dtype(x.dtype))
    r = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return h * r, r


class _SlicedRMSNormFn(torch.autograd.Function):
    """y = w * (x r).to(x.dtype), r = rsqrt(mean(x^2) + eps); backward by the RMSNorm formulas:
    with g = dY w and xh = x r, dX = r (g - xh mean(g xh)); dW = sum over tokens of dY xh."""

    @staticmethod
    def forward(ctx, x, weight, w_slice: ActiveSlice | None, eps: float):
        with torch.autocast(x.device.type, enabled=False):
            xh, _ = _rms_normalised(x, eps)
            y = weight * xh.to(x.dtype)
        ctx.w_slice, ctx.w_range, ctx.eps = w_slice, _live_range(w_slice), eps
        ctx.save_for_backward(x, weight)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx = None
        with torch.autocast(dy.device.type, enabled=False):
            xh, r = _rms_normalised(x, ctx.eps)
            dy = dy.to(xh.dtype)
            if ctx.needs_input_grad[0]:
                g = dy * weight.to(xh.dtype)
                dx = (r * (g - xh * (g * xh).mean(-1, keepdim=True))).to(x.dtype)
            if ctx.w_range:
                # the weight multiplies xh as the forward rounded it, to the input's dtype
                ctx.w_slice.add(_token_sum(dy * xh.to(x.dtype).to(xh.dtype), ctx.w_range))
        return dx, None, None, None


class SlicedRMSNorm(nn.Module):
    """A Hugging Face RMSNorm (RMSNORM_CLASSES) replaced in place: same `weight` and
    `variance_epsilon`, the same forward numerics (x cast to fp32, or kept fp64), slice-aware backward."""

    def __init__(self, norm: nn.Module, slices: dict[str, ActiveSlice]):
        name = type(norm).__name__
        weight = getattr(norm, "weight", None)
        if name not in RMSNORM_CLASSES or not isinstance(weight, nn.Parameter) or weight.dim() != 1 \
                or not isinstance(getattr(norm, "variance_epsilon", None), (int, float)):
            raise ValueError(f"SlicedRMSNorm does not know {name}: it reproduces {', '.join(RMSNORM_CLASSES)}"
                             " (a 1-D weight and a float variance_epsilon).")
        nn.Module.__init__(self)
        self.weight, self.variance_epsilon = weight, norm.variance_epsilon
        self.wrapped_class = name
        _check_slices(self, slices, {"weight": (0,)})
        self.slices = slices

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SlicedRMSNormFn.apply(x, self.weight, self.slices.get("weight"), self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, wraps {self.wrapped_class}"


# ---------------------------------------------------------------- LayerNorm


def _layer_normalised(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x -> (x^ = (x - mean) rstd, rstd) over the last dim, in at least fp32."""
    h = x.to(side_dtype(x.dtype))
    centred = h - h.mean(-1, keepdim=True)
    rstd = torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + eps)
    return centred * rstd, rstd


class _SlicedLayerNormFn(torch.autograd.Function):
    """y = x^ w + b (last dim, in at least fp32); backward: with g = dY w,
    dX = rstd (g - mean(g) - x^ mean(g x^)); dW = sum dY x^ and dB = sum dY, each over its own range."""

    @staticmethod
    def forward(ctx, x, weight, bias, w_slice, b_slice, eps: float):
        with torch.autocast(x.device.type, enabled=False):
            dtype = side_dtype(x.dtype)
            y = F.layer_norm(x.to(dtype), x.shape[-1:], weight.to(dtype),
                             None if bias is None else bias.to(dtype), eps)
            out_dtype = torch.promote_types(x.dtype, weight.dtype)
            y = y.to(out_dtype if bias is None else torch.promote_types(out_dtype, bias.dtype))
        ctx.w_slice, ctx.w_range = w_slice, _live_range(w_slice)
        ctx.b_slice, ctx.b_range = b_slice, _live_range(b_slice)
        ctx.eps = eps
        ctx.save_for_backward(x, weight)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx = None
        with torch.autocast(dy.device.type, enabled=False):
            xhat, rstd = _layer_normalised(x, ctx.eps)
            dy = dy.to(xhat.dtype)
            if ctx.needs_input_grad[0]:
                g = dy * weight.to(xhat.dtype)
                dx = rstd * (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True))
                dx = dx.to(x.dtype)
            if ctx.w_range:
                a, b = ctx.w_range
                ctx.w_slice.add(_token_sum(dy[..., a:b] * xhat[..., a:b], (0, b - a)))
            if ctx.b_range:
                ctx.b_slice.add(_token_sum(dy, ctx.b_range))
        return dx, None, None, None, None, None


class SlicedLayerNorm(nn.LayerNorm):
    """An nn.LayerNorm over the last dim replaced in place: same `weight` and `bias` (optional), each
    sliced along axis 0 in its own range. Output in x's dtype promoted with the parameters'."""

    def __init__(self, norm: nn.LayerNorm, slices: dict[str, ActiveSlice]):
        if len(norm.normalized_shape) != 1 or not norm.elementwise_affine:
            raise ValueError(f"SlicedLayerNorm needs an affine LayerNorm over the last dim only, got "
                             f"normalized_shape={tuple(norm.normalized_shape)}, "
                             f"elementwise_affine={norm.elementwise_affine}.")
        nn.Module.__init__(self)
        self.normalized_shape, self.eps = tuple(norm.normalized_shape), norm.eps
        self.elementwise_affine = True
        self.weight, self.bias = norm.weight, norm.bias
        _check_slices(self, slices, {"weight": (0,), "bias": (0,)})
        self.slices = slices

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SlicedLayerNormFn.apply(x, self.weight, self.bias, self.slices.get("weight"),
                                        self.slices.get("bias"), self.eps)


# ---------------------------------------------------------------- install

_SLICED = (SlicedLinear, SlicedEmbedding, SlicedRMSNorm, SlicedLayerNorm)


def _wrapper_for(module: nn.Module, path: str) -> type[nn.Module]:
    """The sliced wrapper of a module holding trainable parameters. Exact types: a subclass may
    compute something else in its forward."""
    kind = type(module)
    if isinstance(module, _SLICED):
        raise ValueError(f"Slice-aware ops are already installed on {path}.")
    if kind is nn.Linear:
        return SlicedLinear
    if kind is nn.Embedding:
        return SlicedEmbedding
    if kind is nn.LayerNorm:
        return SlicedLayerNorm
    if kind.__name__ in RMSNORM_CLASSES:
        return SlicedRMSNorm
    raise UserError(f"engine=chunk has no slice-aware op for module {path} ({kind.__name__}); freeze it"
                    " (freeze patterns) or use another engine.")


def _trainable_here(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters(recurse=False))


def _replace(model: nn.Module, path: str, new: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent), name, new)


def install(model: nn.Module, axis_of: Callable[[str, nn.Parameter], int]) -> dict[str, ActiveSlice]:
    """Replaces, in place, every module of `model` that directly holds trainable parameters by its
    sliced wrapper; a module with no slice-aware op is a UserError. axis_of(name, param) gives each
    parameter's axis, name its first dotted name in model.named_parameters(). A tied parameter (one
    Parameter in several modules) gets one ActiveSlice, with its first name's axis; a module reached
    by several paths, one wrapper. Frozen parameters get no slice. Returns {first name: slice} for
    every trainable parameter, in named_parameters() order."""
    first_name = {id(p): name for name, p in reversed(list(model.named_parameters(remove_duplicate=False)))}
    by_param: dict[int, ActiveSlice] = {}
    wrappers: dict[int, nn.Module] = {}
    for path, module in list(model.named_modules(remove_duplicate=False)):
        if not _trainable_here(module):
            continue
        if not path:
            raise ValueError("install replaces submodules in place; the root module itself holds parameters.")
        if id(module) not in wrappers:
            wrapper = _wrapper_for(module, path)
            slices = {}
            for attr, p in module.named_parameters(recurse=False):
                if p.requires_grad:
                    if id(p) not in by_param:
                        by_param[id(p)] = ActiveSlice(p, axis_of(first_name[id(p)], p))
                    slices[attr] = by_param[id(p)]
            wrappers[id(module)] = wrapper(module, slices)
        _replace(model, path, wrappers[id(module)])
    return {name: by_param[id(p)] for name, p in model.named_parameters() if id(p) in by_param}
