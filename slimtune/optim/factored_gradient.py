"""A projector fit's e(G)^2 and its gradient in the projectors' values when the gradient G = dY^T X
(n_o x n_i) comes as its two factors, dY (t x n_o) and X (t x n_i), t token rows: a probe pass's half
batch (128 rows on 8 x 32-token batches), against n_o, n_i of 192 to 1,536 and d = 256 on SmolLM2-135M.
Then nothing of G's size is ever formed: every product costs t where the fit from G (projectors.py)
costs n_o n_i or d.

With U = X P_i, V = dY P_o (t x d), U' = U A_i, V' = V A_o (A = P^T P, the Gram matrices) and the t x t
Grams K_uu = U U^T, K_uu' = U U'^T, K_vv = V V^T, K_vv' = V V'^T (all symmetric):
    C = V^T U,   |C|^2 = <K_vv, K_uu>,   <C, A_o C A_i> = <K_vv', K_uu'>,   |G|^2 = <dY dY^T, X X^T>,
so e(G)^2 = (|G|^2 - 2 <K_vv, K_uu> + <K_vv', K_uu'>) / |G|^2, projectors.py's d x d identity. Its
gradient (projectors.py: dL/dP_o = B D^T + 2 P_o (C A_i C^T) / |G|^2) at P_o's non-zero (k, s), with
p = pos_o[k, s], is 2 / |G|^2 times
    (B (M - 2 C)^T)[k, p] + (P_o C A_i C^T)[k, p]
  = sum_t dY[t, k] E_o[t, p] + sum_t (V P_o^T)[t, k] F_o[t, p],   E_o = K_uu' V' - 2 K_uu V,  F_o = K_uu' V
(B = dY^T U, M = A_o C A_i = V'^T U', so U M^T = K_uu' V' and U C^T = K_uu V; C A_i C^T = V^T K_uu' V),
and at P_i's likewise with X, U P_i^T, E_i = K_vv' U' - 2 K_vv U and F_i = K_vv' U. A step: six sparse
products through the projectors' non-zeros ((n_o + n_i) r t each pair), four t x t Grams and four
d x t x t products (10 t^2 d multiply-adds in all), and two gathers of n r 2t; tested against
autograd of the identity on the dense G (float64).

Which way is quicker depends on the shapes (factored_is_cheaper): the fit from G pays two passes over
G's n_o n_i r non-zero products and d x d algebra whatever t is, so G itself wins once t nears d.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

@dataclass
class Factors:
    """G = dy^T x (n_o x n_i), not formed: dy (t, n_o) and x (t, n_i), one row a token."""

    dy: torch.Tensor
    x: torch.Tensor

    @property
    def rows(self) -> int:
        return self.dy.shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        return self.dy.shape[1], self.x.shape[1]

    def dense(self) -> torch.Tensor:
        return self.dy.t() @ self.x

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.dy, self.x


# A step's time each way on one CPU thread, fitted by least squares in relative error to 96 timed steps of
# both (SmolLM2's four matrix shapes, d 64 to 512, t 32 to 384, r 4; case lsp_first_fit_routes, load ~1),
# in nanoseconds: from the factors, per t^2 d, per (n_o + n_i) r t and per step; from G, per n_o n_i r,
# per Gram-sized product (the cheaper of d^3 and 16 n r d, summed over the sides) and per step. On a fresh
# run of the case it sent 6 of the 96 the slower way, none more than 25% slower than the other.
FACTORED_NS = (0.224, 0.982, 448_000.0)
FORMED_NS = (0.764, 0.146, 259_000.0)


def factored_is_cheaper(t: int, n_o: int, n_i: int, d: int, r: int) -> bool:
    """Whether a fit step takes less time from the factors than from G, by the fitted times above (shapes
    only: the planner's fake pass takes the same way)."""
    factored = FACTORED_NS[0] * t * t * d + FACTORED_NS[1] * (n_o + n_i) * r * t + FACTORED_NS[2]
    gram = sum(min(d ** 3, 16 * n * r * d) for n in (n_o, n_i))
    return factored < FORMED_NS[0] * n_o * n_i * r + FORMED_NS[1] * gram + FORMED_NS[2]


def rows_dot(b: torch.Tensor, d_c: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """<b[k], D[pos[k, s]]> (n, r) for b (n, m) and D (d, m): D's rows gathered at the non-zeros, n r m
    multiply-adds, not the n d m of the dense b D^T read at the non-zeros (at d = 256, n = 1536: 0.5 ms
    against 2-3 ms, one thread). In place: a fresh (n, r, m) product would cost page faults each step
    (3.5 ms at n = 576, measured)."""
    n, r = pos.shape
    return d_c.index_select(0, pos.flatten()).view(n, r, -1).mul_(b.unsqueeze(1)).sum(-1)


class FactoredGradient:
    """Gradients' factors, made ready for a fit's steps and readings (module docstring), for the fit's
    members `which` (value_fit.py: one matrix, or several of one shape, stacked): dY^T and X^T row-major
    ((k, n_o, t), (k, n_i, t): the sparse products read them so) and |G|^2 (k,). `fit` is the ValueFit
    (its values, its positions and their CSR structures)."""

    def __init__(self, gradients: Factors | list[Factors], fit, which: tuple[int, ...] = (0,)):
        gradients = [gradients] if isinstance(gradients, Factors) else gradients
        self.fit, self.which = fit, which
        self.dyt, self.xt = stacked([g.dy.t() for g in gradients]), stacked([g.x.t() for g in gradients])
        dy, x = stacked([g.dy for g in gradients]), stacked([g.x for g in gradients])
        self.total = ((dy @ dy.mT) * (x @ x.mT)).sum((1, 2))  # |G|^2 = <dY dY^T, X X^T>
        self.like = self.dyt

    def select(self, which: tuple[int, ...]) -> FactoredGradient:
        """The same for some of its members (`which`, a subsequence of self.which)."""
        rows = [self.which.index(b) for b in which]
        chosen = object.__new__(FactoredGradient)
        chosen.fit, chosen.which, chosen.like = self.fit, which, self.like
        chosen.dyt, chosen.xt, chosen.total = (take(t, rows) for t in (self.dyt, self.xt, self.total))
        return chosen

    def _sides(self):
        """For each side, its projected rows (k, d, t) (V^T, U^T), the same back through P (k, n, t)
        (P_o V^T, P_i U^T) and the Gram's (k, d, t) (A_o V^T, A_i U^T)."""
        fit = self.fit
        s, (val_o, val_i) = fit.stack(self.which), fit.current(self.which)
        vt, ut = s.times(s.left, val_o, self.dyt), s.times(s.right, val_i, self.xt)
        qo, qi = s.times(s.rows_o, val_o, vt), s.times(s.rows_i, val_i, ut)
        return (vt, qo, s.times(s.left, val_o, qo)), (ut, qi, s.times(s.right, val_i, qi))

    @staticmethod
    def _grams(side) -> torch.Tensor:
        """[K, K'] (k, t, 2t) of one side: its rows' Gram with themselves and with the Gram-multiplied rows."""
        rows_t, _, gram_t = side
        return rows_t.mT @ torch.cat([rows_t, gram_t], 2)

    def error_sq(self) -> torch.Tensor:
        """e(G)^2 (k,) of the fit's current values."""
        (v, k_v), (u, k_u) = [(side, self._grams(side)) for side in self._sides()]
        t = k_v.shape[1]
        return (self.total - 2 * (k_v[:, :, :t] * k_u[:, :, :t]).sum((1, 2))
                + (k_v[:, :, t:] * k_u[:, :, t:]).sum((1, 2))) / self.total

    def gradient(self) -> None:
        """e(G)^2's gradient in the values, into each member's .grad (module docstring)."""
        fit, which = self.fit, self.which
        s = fit.stack(which)
        o_side, i_side = self._sides()
        k_v, k_u = self._grams(o_side), self._grams(i_side)
        grad_o = s.rows_o.sampled(_flat(torch.cat([self.dyt, o_side[1]], 2)), _flat(_right_side(o_side, k_u)))
        grad_i = s.rows_i.sampled(_flat(torch.cat([self.xt, i_side[1]], 2)), _flat(_right_side(i_side, k_v)))
        fit.store_gradient(0, which, grad_o, self.total)
        fit.store_gradient(1, which, grad_i, self.total)


def stacked(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Members' tensors as one row-major (k, ...) stack (a single row-major one as a view of itself)."""
    return tensors[0].contiguous().unsqueeze(0) if len(tensors) == 1 else torch.stack(tensors)


def take(stack: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Some rows of a stack: a view for one, a copy for several."""
    return stack[rows[0]:rows[0] + 1] if len(rows) == 1 else stack[rows]


def _flat(stacked: torch.Tensor) -> torch.Tensor:
    """(k, rows, m) as the (k rows, m) the block-diagonal sparse products read."""
    return stacked.reshape(-1, stacked.shape[-1])


def _right_side(side, k_other: torch.Tensor) -> torch.Tensor:
    """[E^T, F^T] (k, d, 2t) for one side, from the other side's [K, K']: E^T = W'^T K' - 2 W^T K and
    F^T = W^T K', with W^T, W'^T this side's projected rows and their Gram's (K symmetric)."""
    rows_t, _, gram_t = side
    t = k_other.shape[1]
    both = rows_t @ k_other  # [W^T K, W^T K'] (k, d, 2t): the second half is F^T
    both[:, :, :t].mul_(-2).baddbmm_(gram_t, k_other[:, :, t:])
    return both
