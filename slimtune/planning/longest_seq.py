"""The longest sequence a plan fits, found from a few estimates instead of a bisection of many.

A step's device peak, host RAM and disk grow with the sequence length T. Where every block runs in
tiles of tokens, each of them is affine in T between tile boundaries (whole K and V, the block's
input and output, the checkpoints: T times a width; one tile's intermediates: a constant), as each
is affine in the depth (estimate._by_depth). So two lengths' estimates give a line per resource, and
the line's crossing with the machine's limit is the answer. Each guess is the estimate at the floor
of a crossing, strictly inside the bracket of what is known to fit and what is known not to; the next
curve runs through it. Where the curve was right the next guess is one token more, which does not fit:
the answer is confirmed by the estimate at it (fits) and at one token more (does not). Where the
step is not affine (an untiled block, a (T, T) mask, a chunk count that steps) the line is a guess,
followed by another through the latest lengths (a parabola where every resource's is convex, a
secant, or Newton's step where the two are one token apart), and by bisection after a few.
`longest_by_bisection` is the plain way, kept as the tests' oracle; both return a length that fits
with one token more not fitting, or the model's limit.

`needs(seq)` is the one question asked: {resource: (needed, available)} for a step of `seq` tokens
(planner.Machine.shortfalls without the filter), so this file knows no estimate and no machine.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Callable

Needs = Callable[[int], dict]

# Guesses from the probes' curves before the search falls back to bisection of what is left (the
# confirmation one token beyond the answer is one of them).
GUESSES = 12


class _Probes:
    """Every length asked so far, with the bracket they give: `low` fits (0: none known to), `high`
    does not (None: none known)."""

    def __init__(self, needs: Needs):
        self.needs, self.seen, self.order = needs, {}, []
        self.low, self.high = 0, None

    def fits(self, seq: int) -> bool:
        if seq not in self.seen:
            self.seen[seq] = self.needs(seq)
            self.order.append(seq)
        fit = all(need <= have for need, have in self.seen[seq].values())
        if fit and seq > self.low:
            self.low = seq
        if not fit and (self.high is None or seq < self.high):
            self.high = seq
        return fit

    def settled(self, limit: int) -> bool:
        return self.low >= limit or (self.high is not None and self.high - self.low <= 1)


def longest_by_length(needs: Needs, known: int, limit: int, tile: int = 1, affine: bool = False) -> int:
    """The longest sequence up to `limit` whose step fits: two probes (`known`, and twice it, a multiple
    of `tile`, or the limit where `affine`; where `known` does not fit, one token: if that does not fit
    either, nothing does), then guesses from the curves through the latest lengths, each strictly inside
    the bracket, until one fits and one token more does not. After GUESSES (a step in the estimate, or
    stairs), bisection of what the bracket leaves. `affine`: the blocks run in tiles, so each part of
    the need is a line, or the larger of two lines (a tile's attention, which grows with the keys, and
    its MLP, which does not): the second probe is the limit itself, and the line through the latest two
    is tried before the parabola."""
    probes = _Probes(needs)
    first = min(limit, max(1, known))
    # Lines (tiled blocks): the second probe at the limit, which settles a plan that fits all the way
    # at once, and past the bend of a block's attention and MLP parts gives a line through it.
    longer = limit if affine else min(limit, _multiple(2 * first, tile))
    second = longer if probes.fits(first) else 1
    if not probes.settled(limit) and second != first:
        probes.fits(second)
    guesses = [first, second]
    for _ in range(GUESSES):
        if probes.settled(limit):
            break
        guess = _guess(probes, guesses, limit, affine)
        if guess is None:
            break
        guesses.append(guess)
        probes.fits(guess)
    return _bisect(probes, limit)


def _multiple(seq: int, tile: int) -> int:
    return max(tile, seq // tile * tile)


def _guess(probes: _Probes, guesses: list[int], limit: int, affine: bool = False) -> int | None:
    """The next length to try, strictly inside the bracket: where a curve through the latest
    guesses first reaches a limit. Curves in turn, the first with an answer inside: a parabola
    through the latest three where every resource's is convex (a (T, T) term, or tiles that grow
    with T); the line through the latest two (affine: blocks in tiles of a fixed size; first where
    `affine`: a parabola through a bend of two lines misses); the line through the bracket's ends
    (regula falsi)."""
    top = limit if probes.high is None else probes.high - 1
    if top <= probes.low:
        return None
    latest = sorted(set(guesses[-3:]))
    curves = [(latest, _parabola_crossing)] if len(latest) == 3 else []
    curves.insert(0 if affine else len(curves), (sorted(set(guesses[-2:])), _line_crossing))
    if probes.low > 0 and probes.high is not None:
        curves.append(([probes.low, probes.high], _line_crossing))
    for lengths, crossing in curves:
        if len(lengths) < 2:
            continue
        bound = _solve(probes, lengths, crossing)
        if bound is _NOTHING_GROWS and probes.high is None:
            return top  # flat so far: the longest allowed
        if bound not in (None, _NOTHING_GROWS):
            # int: the floor of a positive crossing; at or below the longest known to fit, the
            # curve says that is the answer: the next length is the one to try
            return min(top, max(int(bound), probes.low + 1))
    return None


_NOTHING_GROWS = object()  # no resource's curve rises: the probes say nothing of where it ends


def _solve(probes: _Probes, lengths: list[int], crossing):
    """The smallest over resources of where the curve through `lengths` reaches the resource's
    limit; None where a curve gives no answer (it falls or turns away while over); _NOTHING_GROWS
    when every resource fits and none rises."""
    found = []
    for what in probes.seen[lengths[-1]]:
        if any(what not in probes.seen[seq] for seq in lengths):
            continue  # a part of the need some lengths do not have (a segment): no curve
        overs = [probes.seen[seq][what][0] - probes.seen[seq][what][1] for seq in lengths]
        point = crossing(lengths, overs)
        if point is None:
            return None
        if point is not _NOTHING_GROWS:
            found.append(point)
    return min(found) if found else _NOTHING_GROWS


def _line_crossing(lengths: list[int], overs: list[int]):
    """Where the line through two (length, need - have) points reaches 0, exactly (fractions of
    bytes): the largest length that fits on it. A falling or flat line: _NOTHING_GROWS if it fits;
    flat and over, 0 (no length fits it: a part of the need the length does not change, the
    weights); falling and over, None (a curve that says nothing of where it fits)."""
    (a, b), (over_a, over_b) = lengths, overs
    slope = Fraction(over_b - over_a, b - a)
    if slope <= 0:
        if over_b <= 0:
            return _NOTHING_GROWS
        return Fraction(0) if slope == 0 else None
    return a - over_a / slope


def _parabola_crossing(lengths: list[int], overs: list[int]):
    """Where the parabola through three (length, need - have) points reaches 0 on its rising side:
    None unless it is convex and rises at the last point; the line's answer when it is straight."""
    (a, b, c), (fa, fb, fc) = lengths, overs
    first, second = Fraction(fb - fa, b - a), Fraction(fc - fb, c - b)
    curve = (second - first) / (c - a)  # the T^2 coefficient
    if curve == 0:
        return _line_crossing([a, c], [fa, fc])
    slope = second + curve * (c - b)  # the derivative at c
    if curve < 0 or slope <= 0:
        return None
    # fc + slope x + curve x^2 = 0 on the rising side, x from c
    disc = float(slope) ** 2 - 4 * float(curve) * fc
    return Fraction(c + (-float(slope) + math.sqrt(disc)) / (2 * float(curve))) if disc >= 0 else None


def _bisect(probes: _Probes, limit: int) -> int:
    """Bisection of what the bracket leaves, doubling first while nothing has failed."""
    while probes.high is None and probes.low < limit:
        probes.fits(min(limit, max(1, 2 * probes.low)))
    while probes.high is not None and probes.high - probes.low > 1:
        probes.fits((probes.low + probes.high) // 2)
    return probes.low


def longest_by_bisection(needs: Needs, known: int, limit: int) -> int:
    """The plain way: doubling from `known`, then bisection to the token (the tests' oracle)."""
    probes = _Probes(needs)
    first = min(limit, max(1, known))
    probes.fits(first)
    return _bisect(probes, limit)
