"""Learning a projector pair's values on a stream of gradients (spec lsp-offload.md 2.5), for one
matrix or for several matrices of one shape at once (a block's q and o, k and v, gate and up).

The loss e(G)^2 and its gradient in the values are projectors.py's closed forms; this module runs
them, with Adam, on each gradient as it arrives, and stops on held-out readings (ValueFit).

Matrices of one shape are fit side by side, each on its own gradients, by stacking: their values are
one (B, n, r) tensor per side, their gradients one (B, n_o, n_i) tensor (or stacked factors), and
every product runs once for all of them. The projectors' non-zeros become one block-diagonal CSR
matrix (member b's rows and columns shifted by b n and b d), so a sparse product computes each
member's rows exactly as that member's own product does; dense products run as batched products and
sums as per-member sums. Nothing couples the members: member b's values, Adam state, readings and
early stop are what its own fit gives, bit for bit on this project's CPUs (tests/unit/test_value_fit.py
holds them to it). What it buys is dispatch: a fit step is some forty small products and copies, and
at SmolLM2's shapes a fifth of its time is the per-operation cost that does not grow with the sizes
(benchmarks/docs/lsp_fit.md); on a GPU nearly all of it is. Each member's Adam parameters are views
of the stacked values, so one fused Adam call steps them all, and a member that stops early (or is
passed a non-finite gradient) is left out of later products and steps: its .grad is None, which
Adam skips, and the others go on as a smaller stack.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch._subclasses.fake_tensor import is_fake

from slimtune.optim import rules
from slimtune.optim.factored_gradient import FactoredGradient, Factors, factored_is_cheaper, stacked, take
from slimtune.optim.factored_gradient import rows_dot as _rows_dot
from slimtune.optim.projectors import Rows, SparseProjector, Transposed, random_values

Gradient = torch.Tensor | Factors


class Stack:
    """The positions of some members of a fit (`which`), stacked for batched products: `pos_o`/`pos_i`
    ((k n, r)) are each row's columns within its member's d, `at_o`/`at_i` the same shifted by b d (the rows
    of a (k d, m) stack they read), and the CSR structures of the block-diagonal P^T and P. With one member
    these are exactly that member's own (its positions tensors, unshifted, uncopied)."""

    def __init__(self, given: tuple[list[torch.Tensor], list[torch.Tensor]], d: int, which: tuple[int, ...]):
        outs, ins = ([side[b] for b in which] for side in given)
        k = len(which)
        self.which, self.k, self.d = which, k, d
        if k == 1:
            self.pos_o, self.pos_i = outs[0], ins[0]
            self.at_o, self.at_i = self.pos_o, self.pos_i
        else:
            self.pos_o, self.pos_i = torch.cat(outs), torch.cat(ins)
            self.at_o = torch.cat([pos + member * d for member, pos in enumerate(outs)])
            self.at_i = torch.cat([pos + member * d for member, pos in enumerate(ins)])
        self.left, self.right = Transposed(self.at_o, k * d), Transposed(self.at_i, k * d)
        self.rows_o, self.rows_i = Rows(self.at_o, k * d), Rows(self.at_i, k * d)

    def times(self, csr, val: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        """The block-diagonal `csr` @ m for stacked m (k, rows, cols): (k, csr rows / k, cols)."""
        return csr.times(val, m.reshape(-1, m.shape[-1])).view(self.k, -1, m.shape[-1])


class ValueFit:
    """Learns one pair's values (or, given lists of pairs, each of several pairs of one shape: module
    docstring) on a stream of gradients, positions fixed (spec 2.5): the values start afresh, random
    signs over sqrt(d / (n r)) (a first fit), or warm, from the pair's current values (a refit: what the
    last fit learned is where this one starts), and each gradient G gets up to `steps` Adam steps on
    e(G)^2 (a non-finite one is passed over), its gradient in closed form (projectors.py's docstring).
    With a held-out gradient H beside G (the same batch's other rows), e(H)^2 is read every CHECK_EVERY
    steps; once two readings in a row have not fallen by FALLING (relative) below the best of that
    gradient's readings before them, the fit is done (`done`: later gradients are passed over) and the
    values keep the best reading's. Each gradient is used as it arrives and dropped: at most one
    n_o x n_i gradient a member, its transpose and a held-out one exist at once.

    Why that start and not the spec's 1/sqrt(r) (E[P P^T] = I, the unbiased compression): P then has
    columns of squared norm n/d, so P P^T G P_i P_i^T is (n_o/d)(n_i/d) times too large and e(G) starts
    at 11-16 on SmolLM2-135M's matrices (d = 64); Adam spends its steps shrinking the values and is at
    1.05-1.2 after 100. From unit columns in expectation (P^T P ~ I) e(G) starts near 1 and the
    held-out error is 0.73-0.81 after 50 steps, where it stops falling (benchmarks/docs/lsp_fit.md)."""

    CHECK_EVERY = 5
    FALLING = 1e-3

    def __init__(self, p_o: SparseProjector | Sequence[SparseProjector], p_i: SparseProjector | Sequence[SparseProjector],
                 lr: float, steps: int, generator: torch.Generator, fresh: bool = True, warm: bool = False,
                 starts: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None):
        """warm=True starts from the pairs' own values (a refit: copies, the pairs are left as they are), so
        the start is the first held-out reading and a fit that cannot beat it ends with those values bit
        for bit; otherwise fresh draws (member by member, P_o's then P_i's), or with fresh=False the shapes
        and no draws (fake tensors: the planner's estimate). `starts`: the members' starting values, made
        by the caller with `start` (then nothing is drawn here), taken over: the fit steps them in place."""
        outs = [p_o] if isinstance(p_o, SparseProjector) else list(p_o)
        ins = [p_i] if isinstance(p_i, SparseProjector) else list(p_i)
        if starts is None:
            starts = [start(o, i, generator, fresh, warm) for o, i in zip(outs, ins)]
        self.members, self.d = len(outs), outs[0].d
        self.given = ([p.pos for p in outs], [p.pos for p in ins])  # each member's positions, as given
        self.r = outs[0].r
        self.stacked = [stacked([s[side] for s in starts]) for side in (0, 1)]  # (B, n, r): member b at [b]
        self.best = [v.clone() for v in self.stacked]  # made now: a fit step holds the same memory every time
        self.grads = [torch.zeros_like(v) for v in self.stacked]
        # Each member's values as views of the stack: Adam's parameters, stepped by one fused call.
        self.params = [(self.stacked[0][b], self.stacked[1][b]) for b in range(self.members)]
        self.optimizer = torch.optim.Adam([p for pair in self.params for p in pair], lr=lr, fused=True)
        for b, pair in enumerate(self.params):
            for side, param in enumerate(pair):
                param.grad = self.grads[side][b]
        rules.init_adamw_state(self.optimizer)  # made now: every step then holds the same memory
        self.stepping = tuple(range(self.members))  # the members whose .grad is set (Adam steps those)
        # One matrix's structures are made now, as they always were (its steps then allocate only their
        # transient: the meter counts a fit's first run and replays it for the others). Those of several
        # members (all, fewer once some have stopped, or each alone) are made within observe_all and live
        # until it returns: part of the gradient's transient, and no lasting memory beyond one fit's.
        self._stacks: dict[tuple[int, ...], Stack] = {}
        self.single = Stack(self.given, self.d, (0,)) if self.members == 1 else None
        # Which products go through the non-zeros (_sparse_is_cheaper), fixed by the shapes: each Gram
        # product P^T (P M) (2 n r d), and each side's P X (n r d, gradient's docstring).
        self.sparse_gram = [_sparse_is_cheaper(2 * p.n * p.r, self.d) for p in (outs[0], ins[0])]
        self.sparse_rows = [_sparse_is_cheaper(p.n * p.r, self.d) for p in (outs[0], ins[0])]
        self.steps = steps
        self.iterations = 0  # Adam steps taken, summed over the members (early stops make it less than offered)
        self.held_out_errors: list[float | None] = [None] * self.members  # e(H) of the values kept, last held-out gradient
        self.misses = [0] * self.members  # held-out readings in a row that did not fall (across gradients)
        self.stopped = [False] * self.members  # the member's held-out error stopped falling: no more steps

    # ------------------------------------------------------------ one pair's view (the single fit's API)

    @property
    def pos_o(self) -> torch.Tensor:
        return self.given[0][0]

    @property
    def pos_i(self) -> torch.Tensor:
        return self.given[1][0]

    @property
    def values(self) -> list[torch.Tensor]:
        """The first member's values (P_o's, P_i's): a single fit's."""
        return list(self.params[0])

    @property
    def held_out_error(self) -> float | None:
        return self.held_out_errors[0]

    @property
    def done(self) -> bool:
        return all(self.stopped)

    def pair(self, member: int = 0) -> tuple[SparseProjector, SparseProjector]:
        """A member's learned pair. Of several members, copies: a view would keep the whole stack alive (and a
        checkpoint of it would write the whole stack)."""
        own = (lambda v: v.detach().clone()) if self.members > 1 else (lambda v: v.detach())
        o, i = self.params[member]
        return (SparseProjector(self.given[0][member], own(o), self.d),
                SparseProjector(self.given[1][member], own(i), self.d))

    def observe(self, g: Gradient, held_out: Gradient | None = None) -> None:
        """A single fit's observe_all."""
        self.observe_all({0: (g, held_out)})

    def prepared(self, g: Gradient) -> _DenseGradient | FactoredGradient:
        return self.prepare_all([g], (0,))

    def gradient(self, g: torch.Tensor, gt: torch.Tensor, total: torch.Tensor, with_loss: bool = True):
        """A single fit's stacked_gradient on G (n_o x n_i), its transpose and |G|^2."""
        loss = self.stacked_gradient([g], [gt], total.reshape(1), (0,), with_loss)
        return None if loss is None else loss[0]

    def error_sq(self, g: torch.Tensor, total: torch.Tensor | None = None) -> torch.Tensor:
        total = g.pow(2).sum() if total is None else total
        return self.stacked_error_sq([g], total.reshape(1), (0,))[0]

    # ------------------------------------------------------------ the members together

    def stack(self, which: tuple[int, ...]) -> Stack:
        if self.single is not None:
            return self.single
        if which not in self._stacks:
            self._stacks[which] = Stack(self.given, self.d, which)
        return self._stacks[which]

    def current(self, which: tuple[int, ...]) -> list[torch.Tensor]:
        """The members' current values (k, n, r) per side: the stack itself, or its rows (a view for one
        member, a copy for several)."""
        if len(which) == self.members:
            return self.stacked
        if len(which) == 1:
            return [v[which[0]:which[0] + 1] for v in self.stacked]
        return [v[list(which)] for v in self.stacked]

    def observe_all(self, given: dict[int, tuple[Gradient, Gradient | None]]) -> None:
        """Up to `steps` steps on each given member's G (member -> (G, H): G or its factors, whichever way a
        step is cheaper, `prepare_all`), with e(H) read on its held-out gradient H, if any, to stop (the class
        docstring). Members that are done are passed over; so, for this gradient, is a member whose G is
        not finite (a diverging batch would poison its values)."""
        which = tuple(b for b in sorted(given) if not self.stopped[b])
        if not which:
            return
        with torch.no_grad():
            grad = self.prepare_all([given[b][0] for b in which], which)
            finite = tuple(b for b, total in zip(which, grad.total) if rules.is_finite(total))
            if not finite:
                return
            grad = grad.select(finite) if finite != which else grad
            held_out = [given[b][1] for b in finite]
            held = None if any(h is None for h in held_out) else _HeldOut(self.prepare_all(held_out, finite), self)
            # Every step holds the same memory (Adam's state exists from the start): under fake tensors
            # (the planner's estimate) one step (and one held-out reading) shows the peak of any number.
            steps = min(self.steps, 1) if is_fake(grad.like) else self.steps
            for k in range(steps):
                if held is not None and k % self.CHECK_EVERY == 0:
                    stalled = held.stalled()
                    if stalled:
                        for b in stalled:
                            self.stopped[b] = True
                        going = tuple(b for b in grad.which if b not in stalled)
                        if not going:
                            break
                        grad, held = grad.select(going), held.select(going)
                self.step(grad)
            if held is not None:
                held.finish()
            del grad
            self._stacks.clear()

    def stacks(self, g: Gradient) -> bool:
        """Whether members' gradients like g are fit together (else one member at a time, each as it comes):
        where they come as factors and the step works on them (factored_is_cheaper), a stack holds t-row
        factors and costs next to no memory. From G itself every member's G, G^T and held-out G would be live
        at once where one member's were (at SmolLM2's shapes 1.7-7% more device memory in the check pass, by
        an ad-hoc planner run of a version that stacked them), for products that are large and few, where
        stacking saves the least."""
        return self.members > 1 and self._from_factors(g)

    def _from_factors(self, g: Gradient) -> bool:
        """Whether a step on g works on its factors: g comes as factors and that is cheaper by the shapes."""
        return isinstance(g, Factors) and factored_is_cheaper(g.rows, *g.shape, self.d, self.r)

    def prepare_all(self, gradients: list[Gradient], which: tuple[int, ...]) -> _DenseGradient | FactoredGradient:
        """The members' gradients made ready for steps and readings, stacked: from their factors where that is
        cheaper by the shapes (factored_gradient.factored_is_cheaper), else from G itself (formed from the
        factors if need be)."""
        if all(isinstance(g, Factors) for g in gradients) and self._from_factors(gradients[0]):
            return FactoredGradient(gradients, self, which)
        return _DenseGradient([g.dense() if isinstance(g, Factors) else g for g in gradients], self, which)

    def step(self, grad: _DenseGradient | FactoredGradient) -> None:
        """One Adam step on e(G)^2 of a prepared gradient, for the members it holds."""
        grad.gradient()
        self._step_only(grad.which)
        self.optimizer.step()
        self.iterations += len(grad.which)

    def _step_only(self, which: tuple[int, ...]) -> None:
        """Adam steps the parameters that have a .grad: the members in `which`."""
        if which == self.stepping:
            return
        for b, pair in enumerate(self.params):
            for side, param in enumerate(pair):
                param.grad = self.grads[side][b] if b in which else None
        self.stepping = which

    def store_gradient(self, side: int, which: tuple[int, ...], grad: torch.Tensor, total: torch.Tensor) -> None:
        """The members' value gradients (k n, r) of one side, times 2 / |G|^2 each, into their .grad."""
        scaled = grad.view(len(which), -1, grad.shape[-1]).mul_((2 / total).view(-1, 1, 1))
        if len(which) == self.members:
            self.grads[side].copy_(scaled)
            return
        for row, b in enumerate(which):
            self.grads[side][b].copy_(scaled[row])

    def stacked_error_sq(self, g: list[torch.Tensor], total: torch.Tensor, which: tuple[int, ...]) -> torch.Tensor:
        """e(G)^2 (k,) of the members' current values on their G (each n_o x n_i), no autograd:
        <C, A_o C A_i> as <A_o C, C A_i>."""
        s, (val_o, val_i) = self.stack(which), self.current(which)
        half = self._over_g(0, which, val_o, g)  # P_o^T G (k, d, n_i)
        c = s.times(s.right, val_i, half.mT.contiguous()).mT  # (P_i^T (P_o^T G)^T)^T
        y, x, _ = self._gram_products(s, c, val_o, val_i)
        return (total - 2 * c.pow(2).sum((1, 2)) + (y * x).sum((1, 2))) / total

    def _over_g(self, side: int, which: tuple[int, ...], val: torch.Tensor, g: list[torch.Tensor]) -> torch.Tensor:
        """P_o^T G (side 0; G: n_o x n_i) or P_i^T G^T (side 1; given G^T) of each member, (k, d, .): one
        product a member through its own CSR structure, not one over a stack of the G, which would copy every
        G (the largest tensors of a fit) once more; these products are large, so stacking them would save
        little dispatch anyway."""
        if len(which) == 1:
            s = self.stack(which)
            return (s.left if side == 0 else s.right).times(val[0], g[0]).unsqueeze(0)
        own = [self.stack((b,)) for b in which]
        return torch.stack([(o.left if side == 0 else o.right).times(v, m) for o, v, m in zip(own, val, g)])

    def stacked_gradient(self, g: list[torch.Tensor], gt: list[torch.Tensor], total: torch.Tensor, which: tuple[int, ...],
                         with_loss: bool = True) -> torch.Tensor | None:
        """e(G)^2 per member (returned, unless with_loss is False: a step reads only the gradient, and the
        held-out readings are what stop a fit) and its gradient in the values (into each member's .grad),
        for the members' G (each n_o x n_i), their G^T and |G|^2 (k,). With X = C A_i, Y = A_o C and M = A_o C A_i,
        projectors.py's gradient at non-zero (k, s) of P_o, p = pos_o[k, s], is
        (2 / |G|^2) (<b[k], (M - 2 C)[p]> + (P_o X C^T)[k, p]) with b = G P_i, and of P_i likewise with
        G^T P_o, M^T, C^T and Y^T (_at_nonzeros). Where P_o X (n_o x d) is cheap through the non-zeros it
        also gives M = P_o^T (P_o X): then no d x d x d product is left but X and Y, each through the
        non-zeros where that is cheaper (_sparse_is_cheaper)."""
        s, (val_o, val_i) = self.stack(which), self.current(which)
        b = self._over_g(1, which, val_i, gt).mT.contiguous()  # G P_i (k, n_o, d), row-major (c and the gathers read it so)
        bo = self._over_g(0, which, val_o, g).mT  # G^T P_o (k, n_i, d)
        c = s.times(s.left, val_o, b)  # C = P_o^T G P_i (k, d, d)
        y, x, a_o = self._gram_products(s, c, val_o, val_i)
        f_o = s.times(s.rows_o, val_o, x) if self.sparse_rows[0] else None  # P_o X (k, n_o, d)
        if f_o is not None:
            m = s.times(s.left, val_o, f_o)
        else:
            m = (_grams(s.pos_o, val_o, s) if a_o is None else a_o) @ x
        loss = (total - 2 * c.pow(2).sum((1, 2)) + (c * m).sum((1, 2))) / total if with_loss else None
        f_i = s.times(s.rows_i, val_i, y.mT.contiguous()) if self.sparse_rows[1] else None  # P_i Y^T (k, n_i, d)
        grad_o = _at_nonzeros(b, m, c, x, f_o, s.pos_o, s.at_o, val_o)
        grad_i = _at_nonzeros(bo, m.mT, c.mT, y.mT, f_i, s.pos_i, s.at_i, val_i)
        self.store_gradient(0, which, grad_o, total)
        self.store_gradient(1, which, grad_i, total)
        return loss

    def _gram_products(self, s: Stack, c: torch.Tensor, val_o: torch.Tensor,
                       val_i: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Y = A_o C and X = C A_i (k, d, d) for the current values, each as P^T (P M) through the non-zeros
        (2 n r d) or with the dense Gram (d^3), as sparse_gram says; and A_o when it was made."""
        a_o = None
        if self.sparse_gram[0]:
            y = s.times(s.left, val_o, s.times(s.rows_o, val_o, c))
        else:
            a_o = _grams(s.pos_o, val_o, s)
            y = a_o @ c
        if self.sparse_gram[1]:  # X^T = A_i C^T
            x = s.times(s.right, val_i, s.times(s.rows_i, val_i, c.mT.contiguous())).mT.contiguous()
        else:
            x = c @ _grams(s.pos_i, val_i, s)
        return y, x, a_o


# A dense d x d product runs near the core's peak; a CSR product through a projector's n r non-zeros runs
# at about an eighth of that rate a multiply-add (MKL, one thread, d = 256: 0.33 ms for d^3 against
# 0.10 ms for n r d at n = 576, 0.24 ms at n = 1536). So the non-zeros win when their multiply-adds are
# under an eighth of the dense ones: never at d = 64 (the d^3 products take 7 us there), at d = 256 for
# SmolLM2's 576-wide sides and not its 1536-wide ones.
SPARSE_RATE_FACTOR = 8


def _sparse_is_cheaper(nonzero_products_per_column: int, d: int) -> bool:
    """True when `nonzero_products_per_column` * d multiply-adds through CSR products cost less than a
    dense d x d x d product (SPARSE_RATE_FACTOR)."""
    return nonzero_products_per_column * SPARSE_RATE_FACTOR < d * d


def start(p_o: SparseProjector, p_i: SparseProjector, generator: torch.Generator, fresh: bool,
          warm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A fit's starting values for the pair (ValueFit's docstring): P_o's drawn first."""
    return _start(p_o, generator, fresh, warm), _start(p_i, generator, fresh, warm)


def _start(p: SparseProjector, generator: torch.Generator, fresh: bool, warm: bool) -> torch.Tensor:
    if warm:
        return p.val.detach().clone()
    if fresh:
        return random_values(p.n, p.r, generator, p.val.dtype, p.val.device).mul_(math.sqrt(p.d / p.n))
    return torch.empty_like(p.val)


def _grams(pos: torch.Tensor, val: torch.Tensor, s: Stack) -> torch.Tensor:
    """P^T P (k, d, d) of each member's projector: row k of member b adds val[k, s] val[k, t] at
    (pos[k, s], pos[k, t]) of its own d x d, one index_add for all (projectors.cross_gram's, shifted)."""
    k, d, r = s.k, s.d, pos.shape[-1]
    pos = pos.view(k, -1, r)
    flat = pos.unsqueeze(3) * d + pos.unsqueeze(2)
    if k > 1:  # (one member needs no shift: four fewer ops a product, which a GPU pays in launches)
        flat = flat + (torch.arange(k, device=pos.device) * (d * d)).view(k, 1, 1, 1)
    flat = flat.reshape(-1)
    products = (val.unsqueeze(3) * val.unsqueeze(2)).reshape(-1)
    return val.new_zeros(k * d * d).index_add(0, flat, products).view(k, d, d)


def _at_nonzeros(b: torch.Tensor, m: torch.Tensor, c: torch.Tensor, x: torch.Tensor, px: torch.Tensor | None,
                 pos: torch.Tensor, at: torch.Tensor, val: torch.Tensor) -> torch.Tensor:
    """(b (M - 2 C)^T + P X C^T)[k, pos[k, s]] at P's non-zeros (k n, r), for the stacked members (b: (k, n, d);
    m, c, x: (k, d, d); `at`: pos shifted to the members' rows of a (k d, .) stack). With px = P X given (the
    large-d route), everything is read through the non-zeros: <b[k], M[p]> + <px[k] - 2 b[k], C[p]> (n r d; px
    is consumed). Without (small d, where the d x d products take microseconds), the dense b (M - 2 C)^T and
    X C^T, read at the non-zeros and at each row's r x r position pairs."""
    k, n, d = b.shape
    r = pos.shape[-1]
    if px is not None:  # the gathers read rows: row-major copies of what arrives as transposed views
        b = b.contiguous().view(k * n, d)
        return _rows_dot(b, m.contiguous().view(k * d, d), at).add_(
            _rows_dot(px.view(k * n, d).sub_(b, alpha=2), c.contiguous().view(k * d, d), at))
    e = (x @ c.mT).reshape(k * d, d)
    through_gram = torch.bmm(val.reshape(k * n, 1, r), e[at.unsqueeze(2), pos.unsqueeze(1)]).squeeze(1)
    return torch.gather((b @ (m - 2 * c).mT).reshape(k * n, d), 1, pos).add_(through_gram)


class _DenseGradient:
    """The members' G themselves (a list: never stacked, see ValueFit._over_g), made ready for a fit's steps
    and readings: their transposes (made at the first step: a held-out gradient is only read) and |G|^2 (k,)."""

    def __init__(self, gradients: list[torch.Tensor], fit: ValueFit, which: tuple[int, ...]):
        self.g, self.fit, self.which, self.like = list(gradients), fit, which, gradients[0]
        self.total = stacked([g.pow(2).sum() for g in self.g])
        self.gt: list[torch.Tensor] | None = None

    def select(self, which: tuple[int, ...]) -> _DenseGradient:
        """The same for some of its members (`which`, a subsequence of self.which)."""
        rows = [self.which.index(b) for b in which]
        chosen = object.__new__(_DenseGradient)
        chosen.g, chosen.fit, chosen.which, chosen.like = [self.g[r] for r in rows], self.fit, which, self.like
        chosen.total = take(self.total, rows)
        chosen.gt = None if self.gt is None else [self.gt[r] for r in rows]
        return chosen

    def error_sq(self) -> torch.Tensor:
        return self.fit.stacked_error_sq(self.g, self.total, self.which)

    def gradient(self) -> None:
        if self.gt is None:  # G^T P_o and G P_i both run as P^T @ (a contiguous matrix)
            self.gt = [g.t().contiguous() for g in self.g]
        self.fit.stacked_gradient(self.g, self.gt, self.total, self.which, with_loss=False)


class _HeldOut:
    """The held-out readings of one gradient's steps, per member: e(H)^2 every CHECK_EVERY steps; a reading
    that does not fall by FALLING below the best before it (on this gradient: the first sets it) is a
    miss, counted on in the fit across gradients; stalled at two in a row. A stalled member keeps the
    values of its lowest reading; finish() leaves those of the others' (the end's included)."""

    def __init__(self, h: _DenseGradient | FactoredGradient, fit: ValueFit):
        self.h, self.fit = h, fit  # h: the held-out gradients, prepared
        self.best_error = {b: math.inf for b in h.which}

    def select(self, which: tuple[int, ...]) -> _HeldOut:
        chosen = _HeldOut(self.h.select(which), self.fit)
        chosen.best_error = {b: self.best_error[b] for b in which}
        return chosen

    def stalled(self) -> list[int]:
        """Reads e(H)^2 of every member; returns those that stalled, their values set back to their best."""
        errors = self.h.error_sq()
        if is_fake(errors):  # the planner's estimate: the reading's memory, no value
            return []
        fit, stalled = self.fit, []
        for b, error in zip(self.h.which, errors.tolist()):
            first = self.best_error[b] == math.inf
            falling = error < self.best_error[b] * (1 - fit.FALLING)
            if error < self.best_error[b]:
                self._keep(b, error)
            if not first:
                fit.misses[b] = 0 if falling else fit.misses[b] + 1
            if fit.misses[b] >= 2 or not math.isfinite(error):
                self._end(b, error)
                stalled.append(b)
        return stalled

    def finish(self) -> None:
        if is_fake(self.h.like):
            return
        for b, error in zip(self.h.which, self.h.error_sq().tolist()):
            self._end(b, error)

    def _keep(self, b: int, error: float) -> None:
        self.best_error[b] = error
        for best, value in zip(self.fit.best, self.fit.stacked):
            best[b].copy_(value[b])

    def _end(self, b: int, error: float) -> None:
        """Member b's values at the end of this gradient: its best reading's, where the last steps did not help."""
        if not error < self.best_error[b]:
            for best, value in zip(self.fit.best, self.fit.stacked):
                value[b].copy_(best[b])
            error = self.best_error[b]
        self.fit.held_out_errors[b] = math.sqrt(max(error, 0.0))
