"""Sparse projectors (LSP-Offload, spec lsp-offload.md section 2): P in R^(n x d) with exactly r
non-zeros in every row, at distinct positions, kept as (position, value) pairs: (n, r) each, so
their memory is n * r whatever d is.

Everything a projected weight needs is a product with P or with P^T over the r non-zeros of each row
(one CSR product on the CPU in fp32/fp64, else index_add / index_select term by term: n * r work, never
an n x d or n_o x n_i tensor):
  right(x)    = x @ P      (..., n) -> (..., d)   the forward's U = X P_i, the backward's V = dY P_o
  right_t(a)  = a @ P^T    (..., d) -> (..., n)   what a subspace update adds to an output or input grad
  cross_gram  = A^T B      (d, d)                 Gram matrices for the error and the moment transfer

The error of a pair (P_o, P_i) on a gradient G (n_o x n_i) is e(G) = |P_o P_o^T G P_i P_i^T - G| / |G|.
With C = P_o^T G P_i (d x d) and the Gram matrices A_o = P_o^T P_o, A_i = P_i^T P_i,
    |P_o C P_i^T - G|^2 = |G|^2 - 2 |C|^2 + <C, A_o C A_i>,
so e(G) and its gradient in the projectors' values cost n_o * n_i * r, not n_o * n_i * d (tested
against the dense formula). Fitting learns the values with the positions fixed, so no two
non-zeros of a row ever collide.

Fitting (value_fit.ValueFit) computes that gradient in closed form, not by autograd: with B = G P_i, G^T P_o
(the only two products over G, as sparse CSR products: the positions fix the structure, each step
only permutes the values into it) and D = dL/dC = (2 A_o C A_i - 4 C) / |G|^2,
    dL/dP_o = B D^T + 2 P_o (C A_i C^T) / |G|^2,   dL/dP_i = (G^T P_o) D + 2 P_i (C^T A_o C) / |G|^2,
read at the non-zeros only (n r d numbers). A step costs two passes over G's n_o n_i r non-zero
products and a few d x d products (tested equal to autograd of the identity). Where G comes as its factors
dY^T X over few rows (a probe pass's half batch), the same loss and gradient are computed from the
factors when that is quicker (factored_gradient.py); nothing of G's size is made then.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import is_fake

from slimtune.device import memory


@dataclass
class SparseProjector:
    pos: torch.Tensor  # (n, r) int64: the columns of each row's non-zeros, distinct within a row
    val: torch.Tensor  # (n, r): their values
    d: int  # columns

    @property
    def n(self) -> int:
        return self.pos.shape[0]

    @property
    def r(self) -> int:
        return self.pos.shape[1]

    @classmethod
    def random(cls, n: int, d: int, r: int, generator: torch.Generator, dtype: torch.dtype,
               device: torch.device) -> SparseProjector:
        """r distinct positions per row (drawn without replacement), values +-1/sqrt(r): E[P P^T] = I."""
        if r > d:
            raise ValueError(f"a projector row cannot hold r={r} distinct non-zeros in d={d} columns")
        pos = torch.multinomial(torch.ones(n, d), r, replacement=False, generator=generator)
        return cls(pos.to(device), random_values(n, r, generator, dtype, device), d)

    def right(self, x: torch.Tensor) -> torch.Tensor:
        """x @ P: (..., n) -> (..., d), in x's dtype."""
        val = self.val.to(x.dtype)
        if torch.is_grad_enabled() and (x.requires_grad or val.requires_grad):
            return _SparseProduct.apply(x, val, self.pos, self.d, False)
        return _right(x, self.pos, val, self.d)

    def right_t(self, a: torch.Tensor) -> torch.Tensor:
        """a @ P^T: (..., d) -> (..., n), in a's dtype."""
        val = self.val.to(a.dtype)
        if torch.is_grad_enabled() and (a.requires_grad or val.requires_grad):
            return _SparseProduct.apply(a, val, self.pos, self.d, True)
        return _right_t(a, self.pos, val)

    def dense(self) -> torch.Tensor:
        """P as an (n, d) tensor: for tests, fitting baselines and GaLore-style comparisons only."""
        return self.val.new_zeros(self.n, self.d).scatter(1, self.pos, self.val)


# The products, term by term: each of the r terms is made, added in and dropped before the next, all
# of one shape, so under fake tensors (the planner's estimate) the first shows the memory.


def _terms(r: int, like: torch.Tensor, first: int = 0):
    return memory.representative(range(first, r), like, alike_from=0, last_alike=True)


def _right(x: torch.Tensor, pos: torch.Tensor, val: torch.Tensor, d: int) -> torch.Tensor:
    if _through_csr(x):
        return _csr_product(x, pos, val, d, transposed=False)
    out = x.new_zeros(*x.shape[:-1], d)
    for s in _terms(pos.shape[1], x):
        term = x * val[:, s]
        out.index_add_(-1, pos[:, s], term)
        del term
    return out


def _right_t(a: torch.Tensor, pos: torch.Tensor, val: torch.Tensor) -> torch.Tensor:
    if _through_csr(a):
        return _csr_product(a, pos, val, a.shape[-1], transposed=True)
    out = a.index_select(-1, pos[:, 0]) * val[:, 0]
    for s in _terms(pos.shape[1], a, first=1):
        term = a.index_select(-1, pos[:, s]).mul_(val[:, s])
        out.add_(term)
        del term
    return out


def _through_csr(x: torch.Tensor) -> bool:
    """The products go through one MKL sparse product on the CPU in fp32 and fp64: 2-4.7 times quicker than the
    r index_select / index_add terms at SmolLM2's shapes (d 256, 256 rows, one thread: a @ P^T 0.74 against
    3.46 ms at n = 1536, x @ P 1.48 against 1.97; benchmarks/docs/lsp_fit.md). The CPU has no bf16 sparse
    product, and no other device has been measured: those keep the terms. So does the planner's fake step
    (fake CPU tensors standing for a GPU run): it counts the terms' transient, as a GPU run holds it, and
    a CPU run, which holds only the result, never needs more than the plan says."""
    return x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64) and not is_fake(x)


def _csr_matrix(offsets: torch.Tensor, columns: torch.Tensor, values: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """A sparse CSR tensor of these parts, unchecked (the positions make them valid)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "sparse CSR support is in beta": the products are exact
        return torch.sparse_csr_tensor(offsets, columns, values, shape, check_invariants=False)


def _csr_product(x: torch.Tensor, pos: torch.Tensor, val: torch.Tensor, d: int, transposed: bool) -> torch.Tensor:
    """x @ P ((..., n) -> (..., d)) or, `transposed`, x @ P^T ((..., d) -> (..., n)) with P as a CSR matrix
    read straight from (pos, val): row k's r non-zeros are its CSR row in pos's order (MKL needs no sorted
    columns; the products equal the dense ones, tested), so nothing is made but the row offsets and the
    result. x @ P^T is computed as P x^T written into the result's transpose: row-major, no copy."""
    n, r = pos.shape
    rows = x.reshape(-1, x.shape[-1])
    out = rows.new_empty(rows.shape[0], n if transposed else d)
    offsets = torch.arange(0, n * r + 1, r, device=x.device)
    p = _csr_matrix(offsets, pos.reshape(-1), val.reshape(-1), (n, d))
    if transposed:
        torch.mm(p, rows.t(), out=out.t())
    else:
        torch.mm(rows, p, out=out)
    return out.view(*x.shape[:-1], out.shape[-1])


class _SparseProduct(torch.autograd.Function):
    """x @ P (or a @ P^T) with gradients for x and for P's values, saving only the input: a plain
    autograd graph of the terms would keep all r of them (index_add's backward saves its source),
    r tensors of the input's size while the projectors are fit on a full gradient."""

    @staticmethod
    def forward(ctx, x, val, pos, d: int, transposed: bool):
        ctx.save_for_backward(x, val, pos)
        ctx.d, ctx.transposed = d, transposed
        return _right_t(x, pos, val) if transposed else _right(x, pos, val, d)

    @staticmethod
    def backward(ctx, grad):
        x, val, pos = ctx.saved_tensors
        grad_x = grad_val = None
        if ctx.needs_input_grad[0]:  # (a P^T)' = g P and (x P)' = g P^T
            grad_x = _right(grad, pos, val, ctx.d) if ctx.transposed else _right_t(grad, pos, val)
        if ctx.needs_input_grad[1]:
            # d/d val[k, s] = sum over rows of (n-side tensor)[.., k] * (d-side tensor)[.., pos[k, s]]
            wide, narrow = (grad, x) if ctx.transposed else (x, grad)
            grad_val = torch.zeros_like(val)
            for s in _terms(pos.shape[1], x):
                grad_val[:, s] = (wide * narrow.index_select(-1, pos[:, s])).flatten(0, -2).sum(0)
        return grad_x, grad_val, None, None, None


def random_values(n: int, r: int, generator: torch.Generator, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Random signs over 1/sqrt(r) (each row's values drawn apart: never one constant, spec pitfall 3)."""
    signs = torch.randint(0, 2, (n, r), generator=generator).to(dtype) * 2 - 1
    return (signs / math.sqrt(r)).to(device)


def cross_gram(a: SparseProjector, b: SparseProjector) -> torch.Tensor:
    """A^T B (d_a x d_b) of two projectors with the same rows, from their non-zeros alone."""
    dtype = torch.promote_types(a.val.dtype, b.val.dtype)
    # Row k adds val_a[k, s] * val_b[k, t] at (pos_a[k, s], pos_b[k, t]) for every s, t: one index_add.
    flat = (a.pos.unsqueeze(2) * b.d + b.pos.unsqueeze(1)).reshape(-1)
    products = (a.val.to(dtype).unsqueeze(2) * b.val.to(dtype).unsqueeze(1)).reshape(-1)
    return a.val.new_zeros(a.d * b.d, dtype=dtype).index_add(0, flat, products).view(a.d, b.d)


def compress(g: torch.Tensor, p_o: SparseProjector, p_i: SparseProjector) -> torch.Tensor:
    """C = P_o^T G P_i (d x d) for G (n_o x n_i)."""
    return p_i.right(p_o.right(g.t()).t())


def decompress(c: torch.Tensor, p_o: SparseProjector, p_i: SparseProjector) -> torch.Tensor:
    """P_o C P_i^T (n_o x n_i) for C (d x d): a subspace update as a dense weight update."""
    return p_o.right_t(p_i.right_t(c).t()).t()


def squared_residual(g: torch.Tensor, p_o: SparseProjector, p_i: SparseProjector,
                     g_norm_sq: torch.Tensor | None = None) -> torch.Tensor:
    """|P_o P_o^T G P_i P_i^T - G|^2 through the d x d identity (module docstring)."""
    c = compress(g, p_o, p_i)
    total = g.pow(2).sum() if g_norm_sq is None else g_norm_sq
    return total - 2 * c.pow(2).sum() + (c * (cross_gram(p_o, p_o) @ c @ cross_gram(p_i, p_i))).sum()


def relative_error(g: torch.Tensor, p_o: SparseProjector, p_i: SparseProjector) -> float:
    """e(G) of the pair on G."""
    total = g.pow(2).sum()
    return math.sqrt(max(float(squared_residual(g, p_o, p_i, total) / total), 0.0))


def dense_relative_error(g: torch.Tensor, p_o: SparseProjector, p_i: SparseProjector) -> float:
    """e(G) by its definition, with dense n x n projections: the oracle of relative_error."""
    o, i = p_o.dense().to(g.dtype), p_i.dense().to(g.dtype)
    return float(torch.linalg.matrix_norm(o @ o.T @ g @ i @ i.T - g) / torch.linalg.matrix_norm(g))


def reproject_moments(m: torch.Tensor, v: torch.Tensor, old: tuple[SparseProjector, SparseProjector],
                      new: tuple[SparseProjector, SparseProjector]) -> tuple[torch.Tensor, torch.Tensor]:
    """Adam's moments carried from the old subspace into the new one (spec 2.5):
    M' = (P_o'^T P_o) M (P_i^T P_i'),  V' = (P_o'^T P_o)^2 V (P_i^T P_i')^2 (element-wise squares)."""
    left, right = cross_gram(new[0], old[0]).to(m.dtype), cross_gram(old[1], new[1]).to(m.dtype)
    return left @ m @ right, left.pow(2) @ v @ right.pow(2)


class _Csr:
    """A projector (or its transpose) as the CSR structure its fixed positions give: only the values change
    between products (a fit's steps), so the structure is made once and each product permutes the current
    values into it (`order`). A product with a dense M costs n r M.shape[1]."""

    order: torch.Tensor
    columns: torch.Tensor
    rows: torch.Tensor
    shape: tuple[int, int]

    def times(self, val: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        """This matrix @ m for the projector's values `val` (n, r)."""
        values = val.flatten()[self.order].to(m.dtype)
        if is_fake(m):  # fake tensors run no sparse product (the planner's estimate): its result is its memory
            return m.new_empty(self.shape[0], m.shape[1])
        return _csr_matrix(self.rows, self.columns, values, self.shape) @ m


class Transposed(_Csr):
    """P^T (d x n): P^T @ M (M: n x m, contiguous)."""

    def __init__(self, pos: torch.Tensor, d: int):
        n, r = pos.shape
        rows = torch.arange(n, device=pos.device).repeat_interleave(r)
        cols = pos.flatten()
        self.order = torch.argsort(cols * n + rows)  # P's non-zeros by (column, row): P^T's rows in order
        self.columns = rows[self.order]
        self.rows = torch.zeros(d + 1, dtype=torch.long, device=pos.device)
        counts = torch.zeros(d, dtype=torch.long, device=pos.device).index_add_(0, cols, torch.ones_like(cols))
        self.rows[1:] = counts.cumsum(0)  # (not bincount: fake tensors cannot run it)
        self.shape = (d, n)


class Rows(_Csr):
    """P (n x d) itself: P @ M (M: d x m, contiguous), r non-zeros a row, each row's columns in order."""

    def __init__(self, pos: torch.Tensor, d: int):
        n, r = pos.shape
        within = torch.argsort(pos, dim=1)
        self.order = (torch.arange(n, device=pos.device).unsqueeze(1) * r + within).flatten()
        self.columns = torch.gather(pos, 1, within).flatten()
        self.rows = torch.arange(0, n * r + 1, r, device=pos.device)
        self.shape = (n, d)
        self.inverse = torch.argsort(self.order)  # the CSR's values back in (n, r) order

    def sampled(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """<a[k], b[pos[k, s]]> (n, r) for a (n, m) and b (d, m): a b^T made at P's non-zeros only (a sampled
        dense-dense product, n r m multiply-adds; 2.2-2.4 times quicker than gathering b's rows, m = 256,
        one thread). Under fake tensors the same bytes are made (the pattern's values, the product's, the
        result), and no sparse product is run."""
        n, count = self.shape[0], self.order.numel()
        zeros = a.new_zeros(count)
        if is_fake(a):
            values = a.new_empty(count)
        else:
            pattern = _csr_matrix(self.rows, self.columns, zeros, self.shape)
            values = torch.sparse.sampled_addmm(pattern, a, b.t(), beta=0.0).values()
        return values[self.inverse].view(n, count // n)


def compressed(g: torch.Tensor, left: Transposed, right: Transposed, val_o: torch.Tensor,
               val_i: torch.Tensor) -> torch.Tensor:
    """C = P_o^T G P_i (d x d) through two sparse products (no autograd)."""
    half = left.times(val_o, g)  # P_o^T G (d, n_i)
    return right.times(val_i, half.t().contiguous()).t()  # (P_i^T (P_o^T G)^T)^T


def fast_squared_residual(g: torch.Tensor, p_o: SparseProjector, p_i: SparseProjector,
                          g_norm_sq: torch.Tensor | None = None) -> torch.Tensor:
    """squared_residual without autograd, through the sparse products (the check's measure)."""
    c = compressed(g, Transposed(p_o.pos, p_o.d), Transposed(p_i.pos, p_i.d), p_o.val, p_i.val)
    total = g.pow(2).sum() if g_norm_sq is None else g_norm_sq
    return total - 2 * c.pow(2).sum() + (c * (cross_gram(p_o, p_o).to(c.dtype) @ c @ cross_gram(p_i, p_i).to(c.dtype))).sum()
