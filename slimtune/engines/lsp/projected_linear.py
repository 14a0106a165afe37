"""ProjectedLinear: a block linear trained in a d x d subspace (LSP-Offload's activation trick, spec
lsp-offload.md 2.2), without ever forming an n_o x n_i gradient.

The weight the module computes with is W + P_o Z P_i^T: W (n_o x n_i) is frozen in the run's weight
dtype (bf16 on a GPU), Z (d x d, fp32) is the trained coordinate, P_o, P_i are sparse projectors
(optim/projectors.py). Then, with U = X P_i and V = dY P_o,
    y  = X W^T + (U Z^T) P_o^T + b
    dX = dY W  + (V Z) P_i^T                    exact, as dense autograd of W + P_o Z P_i^T gives it
    dZ = V^T U = P_o^T (dY^T X) P_i = G_c       the compressed gradient (fp32)
Forward saves U (T x d) instead of X (T x n_i); autograd accumulates dZ into Z.grad (gradient
accumulation over micro-batches for free) and no weight gradient is returned. U and V are made and
kept in Z's dtype (fp32) from the bf16 X and dY: in bf16 they would put a relative error of about
4e-3 into G_c (measured), the only signal the host optimizer gets; the products with W stay bf16.

Why the update lives in Z and not in W (spec open decision 1). Adding each step's P_o delta P_i^T
into bf16 weights rounds it away when it is below half a bf16 ulp (an update of relative size 1e-4
is 1/20 of one), and stochastic rounding keeps the mean but adds a random walk of a few ulps per
thousand steps. Z holds the sum of every update since the projectors last changed, in fp32, so the
effective weight W + P_o Z P_i^T is exact; W takes Z in one rounding (`fold`, stochastic for bf16)
only when the projectors change (a refit) or a checkpoint is written, and Z starts again at zero. That costs d^2
fp32 a matrix on the device and two (T x d) x (d x d) products a pass, instead of an fp32 master
of the weights (4 bytes a weight) or a compensation buffer (2 bytes a weight).

Weight decay (decoupled, AdamW's) multiplies the whole effective weight by (1 - lr wd) each step. Z
takes its part in the host AdamW (Z's group decays); W's part is a per-matrix scale s, so the module
computes with s W + P_o Z P_i^T: s is multiplied by the same factor when the step's Z is applied (the
engine's update pipeline), and the forward pays one multiply-add on the output, s (X W^T) + correction
(dX likewise); dZ does not change. s is a Python float (exact in fp64, known on the host without a
sync) and is 1 without decay, where the forward is the plain one. A fold puts s into W and restarts
it at 1 with Z at 0.

A module in `probe` mode (the projector check and fit) also keeps X and hands the full gradient
dY^T X of its effective weight to `probe` in backward, one matrix at a time, as two halves: that of
the first half of the rows (tokens, example-major: the first half of the batch's examples) and that of
the rest, so the fit can hold out examples it does not fit on (learning.py). Each half comes as its
factors (dY and X of its rows, factored_gradient.Factors), not their n_o x n_i product.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from slimtune.optim.factored_gradient import Factors
from slimtune.optim.projectors import SparseProjector, decompress


class ProjectedLinear(nn.Linear):
    """Replaces an nn.Linear in place, keeping its `weight` and `bias` parameters (so the model's
    state_dict keys, and what export writes, stay the Hugging Face ones). Z and the projectors are
    plain attributes, not registered: the engine owns them."""

    def __init__(self, linear: nn.Linear, index: int, p_o: SparseProjector, p_i: SparseProjector):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.weight.requires_grad_(False)
        self.index = index  # forward order among the projected modules
        self.p_o, self.p_i = p_o, p_i
        z_dtype = torch.promote_types(self.weight.dtype, torch.float32)
        self.z = self.weight.new_zeros((p_o.d, p_i.d), dtype=z_dtype).requires_grad_()
        self.scale = 1.0  # s: W's share of the effective weight s W + P_o Z P_i^T (weight decay)
        self.probe: Callable[[torch.Tensor], None] | None = None
        self.before_forward: Callable[[int], None] | None = None  # the engine applies a pending update
        # Set while the engine knows Z is all zeros (lsp's first fit, before any update): the forward then
        # makes no U = X P_i and no correction, the backward no V Z. A flag, not a test of Z: the planner's
        # fake pass, which has no values, must take the same ops as the real one.
        self.z_is_zero = False

    @property
    def d(self) -> int:
        return self.p_o.d

    def tile_signature(self) -> tuple:
        """What besides its tensors decides this module's ops, and so a tiled block's transient bytes
        (seq_tiles' replay key): probed or not, Z known zero or not, a decay scale to apply or not, dZ wanted or not."""
        return self.probe is not None, self.z_is_zero, self.scale == 1.0, self.z.requires_grad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.before_forward is not None:
            self.before_forward(self.index)
        return _ProjectedMatmul.apply(x, self.weight, self.bias, self.z, self)

    def delta(self) -> torch.Tensor:
        """P_o Z P_i^T (n_o x n_i, Z's dtype): what the trained coordinate adds to W."""
        with torch.no_grad():
            return decompress(self.z.detach(), self.p_o, self.p_i)

    def effective_weight(self, rounding: torch.Generator | None = None) -> torch.Tensor:
        """s W + P_o Z P_i^T in W's dtype: rounded to nearest, or stochastically with `rounding`'s draws
        when W is bf16 (see fold)."""
        with torch.no_grad():
            exact = self.weight.to(self.z.dtype).mul(self.scale).add_(self.delta())
            if rounding is not None and self.weight.dtype == torch.bfloat16:
                return stochastic_bf16(exact, rounding)
            return exact.to(self.weight.dtype)

    def fold(self, rounding: torch.Generator | None = None) -> None:
        """W takes the subspace update and the decay's scale (one rounding); Z restarts at zero, s at 1; the module computes the
        same weight before and after, up to that rounding. A bf16 W is rounded stochastically
        (`rounding`: the draws; the planner's fake step passes None and draws nothing): round to
        nearest would drop, at every fold, each element's change smaller than half an ulp, always the
        same way; stochastic rounding keeps it in expectation."""
        with torch.no_grad():
            self.weight.copy_(self.effective_weight(rounding))
            self.z.zero_()
            self.scale = 1.0


def stochastic_bf16(x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """fp32 x to bf16, rounded up in magnitude with probability equal to the dropped fraction of an ulp:
    uniform noise below the 16 bits bf16 keeps, then truncation. generator None: no draws (zeros,
    same memory: truncation)."""
    bits = x.to(torch.float32).contiguous().view(torch.int32)
    if generator is None:
        noise = torch.zeros_like(bits)
    else:
        noise = torch.randint(0, 1 << 16, bits.shape, generator=generator, dtype=torch.int32, device=bits.device)
    return bits.add_(noise).bitwise_and_(-65536).view(torch.float32).to(torch.bfloat16)


class _ProjectedMatmul(torch.autograd.Function):
    """y = x (s W + P_o Z P_i^T)^T + b; backward gives dX, db and dZ = G_c (module docstring). The
    arithmetic runs in explicit dtypes (W's for the products with W and the corrections, Z's for U,
    V and the d x d products) whatever autocast says: the forward of a bf16 run equals autocast's
    linear in bf16 plus the correction."""

    @staticmethod
    def forward(ctx, x, weight, bias, z, module: ProjectedLinear):
        probing, zero = module.probe is not None, module.z_is_zero
        with torch.autocast(x.device.type, enabled=False):
            ctx.x_dtype = x.dtype
            x = x.to(weight.dtype)
            u = None  # (..., d) in fp32, G_c is made from it: not needed while Z is zero, unless for dZ
            if not zero or (z.requires_grad and not probing):
                u = module.p_i.right(x.to(z.dtype))
            if zero:  # the correction (U Z^T) P_o^T is zero: not made
                y = F.linear(x, weight)
                y = y if module.scale == 1.0 else y.mul_(module.scale)
            else:  # the correction first: its products' terms are gone before X W^T exists
                correction = module.p_o.right_t((u @ z.t()).to(weight.dtype))
                y = _scaled_sum(F.linear(x, weight), module.scale, correction)
            if bias is not None:
                y.add_(bias.to(weight.dtype))
        ctx.module, ctx.scale, ctx.probing, ctx.zero = module, module.scale, probing, zero
        ctx.save_for_backward(u, weight, z, x if probing else None)
        return y

    @staticmethod
    def backward(ctx, dy):
        u, weight, z, x = ctx.saved_tensors
        module = ctx.module
        wants_dz = not ctx.probing and ctx.needs_input_grad[3]
        with torch.autocast(dy.device.type, enabled=False):
            dy = dy.to(weight.dtype)
            v = module.p_o.right(dy.to(z.dtype)) if wants_dz or not ctx.zero else None  # (..., d) in fp32
            dx = db = dz = None
            if ctx.needs_input_grad[0]:
                product = dy @ weight
                if ctx.zero:
                    dx = (product if ctx.scale == 1.0 else product.mul_(ctx.scale)).to(ctx.x_dtype)
                else:
                    dx = _scaled_sum(product, ctx.scale, module.p_i.right_t((v @ z).to(dy.dtype))).to(ctx.x_dtype)
            if ctx.needs_input_grad[2]:
                db = dy.flatten(0, -2).sum(0).to(module.bias.dtype)
            if ctx.probing:
                module.probe(_gradient_halves(dy, x, z.dtype))
            elif wants_dz:
                dz = v.flatten(0, -2).t() @ u.flatten(0, -2)
        return dx, None, db, dz, None


def _scaled_sum(product: torch.Tensor, scale: float, correction: torch.Tensor) -> torch.Tensor:
    """scale * product + correction, into `correction` (made for this sum alone); scale 1: the plain sum."""
    if scale == 1.0:
        return correction.add_(product)
    return correction.add_(product, alpha=scale)


def _gradient_halves(dy: torch.Tensor, x: torch.Tensor, dtype: torch.dtype) -> tuple[Factors, Factors | None]:
    """dY^T X of the first half of the rows and of the rest (None when there is one row), as their
    factors in `dtype` (views when dY and X are in it already): the fit works on the factors where that
    is cheaper, and never pays the two n_o x n_i x t products otherwise (optim/factored_gradient.py)."""
    dy, x = dy.flatten(0, -2).to(dtype), x.flatten(0, -2).to(dtype)
    half = dy.shape[0] // 2
    if half == 0:
        return Factors(dy, x), None
    return Factors(dy[:half], x[:half]), Factors(dy[half:], x[half:])
