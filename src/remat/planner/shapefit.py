"""The step model as a function of one varying size: profiles at a few sizes, fitted exactly.

A profile (:class:`~remat.Profile`) is exact for the one batch shape it measured. Along one
varying size ``n`` (the sequence length of a batch of tokens, the side of a square image)
every byte term of the step model is a low-degree polynomial in ``n``: activations grow
linearly in tokens, and quadratically where attention materialises ``seq x seq`` (or where a
convolution's maps grow with an image's area). :class:`ShapeFit` holds profiles measured at a
few sizes (the *knots*) and gives the profile at any size between them by exact rational
interpolation (:class:`fractions.Fraction`): each term at ``n`` is the value at ``n`` of the
polynomial of degree at most 2 through the three knots around ``n`` (all knots when there are
fewer), so a term that is quadratic between its knots is predicted to the byte.

A term can fail to be one polynomial: a peak is the largest of several sums, and which one is
largest can change with ``n``; kernels pick other tile sizes past a threshold. So a fit is
*checked* against profiles at sizes that were not knots (:meth:`ShapeFit.refine`): every
byte term must equal the measured one exactly. Where it does, the fit is trusted between the
two knots around that size; where it does not, the misses are reported by name, the size
becomes a knot and the two halves are checked in turn, up to a number of profiles. Outside
the trusted intervals the caller measures each size it needs instead of trusting the fit
(:mod:`remat.planner.shapes`). Times (and FLOPs) are interpolated the same way and
never checked: they only rank plans, a time below 0 is taken as 0. Scratch inside operators
(``scratch``'s terms and the blocks' per-window ones) is the workspace a kernel sizes by its
own thresholds: between two sizes where it was measured it is the larger of their values
(scratch assumed to grow with the size within an interval), neither fitted nor checked. A
profile from shapes sees none: its knot's scratch is measured in a real step of the planned
model and given by :meth:`ShapeFit.add_scratch`.

Example:
    >>> import torch, remat
    >>> from remat.planner.shapefit import ShapeFit
    >>> model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(3)])
    >>> x = torch.randn(16, 8)
    >>> def measure(n):
    ...     return remat.profile(model, x[:n], timer="flops")
    >>> fit = ShapeFit({n: measure(n) for n in (4, 8, 16)})
    >>> fit.refine(measure)                  # checked at 12 and 6: exact
    []
    >>> fit.trusted(14), fit.at(14).unchecked_peak_bytes == measure(14).unchecked_peak_bytes
    (True, True)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from fractions import Fraction
from typing import Any

from ..engine.errors import PlanError
from .distributed import structure
from .solve import Profile
from .types import Fit, ProfileData, term_parts, with_parts

__all__ = ["ShapeFit", "fits", "interpolate", "terms"]


def _fields(obj: Any) -> list[tuple[str, Fit]]:
    """The numeric fields of a profile or block, each with what the fit does with it (its
    ``metadata["fit"]``: :class:`~remat.planner.types.Fit`)."""
    return [(f.name, f.metadata["fit"]) for f in dataclasses.fields(obj) if "fit" in f.metadata]


def _walk(prof: ProfileData) -> Iterator[tuple[str, int | float, Fit]]:
    """Every number of ``prof`` by name (see :func:`terms`), with its field's fit."""
    for prefix, obj in term_parts(prof):
        for name, fit in _fields(obj):
            v = getattr(obj, name)
            if isinstance(v, dict):
                for k in sorted(v):
                    yield f"{prefix}{name}[{k}]", v[k], fit
            else:
                yield f"{prefix}{name}", v, fit


def terms(prof: ProfileData) -> dict[str, int | float]:
    """Every number of ``prof`` by name (``"top"``, ``"scratch.bytes"``,
    ``"blocks.0.fwd_excess[keep]"``): the fields the step model reads, of the profile, of its
    groups of terms and of each block (:func:`~remat.planner.types.term_parts`).

    Example:
        >>> import torch, remat
        >>> from remat.planner.shapefit import terms
        >>> prof = remat.profile(torch.nn.Sequential(torch.nn.Linear(4, 4)), torch.randn(2, 4),
        ...                      timer="flops")
        >>> terms(prof)["static_bytes"]
        112
    """
    return {name: v for name, v, _ in _walk(prof)}


def fits(prof: ProfileData) -> dict[str, Fit]:
    """What the fit does with each number of :func:`terms` (its field's ``metadata["fit"]``)."""
    return {name: fit for name, _, fit in _walk(prof)}


def _rebuilt(obj: Any, prefix: str, values: Mapping[str, int | float]) -> Any:
    changes: dict[str, Any] = {}
    for name, _ in _fields(obj):
        v = getattr(obj, name)
        if isinstance(v, dict):
            changes[name] = {k: values[f"{prefix}{name}[{k}]"] for k in v}
        else:
            changes[name] = values[f"{prefix}{name}"]
    return dataclasses.replace(obj, **changes)


def _structure(prof: ProfileData) -> tuple[object, ...]:
    """What must be the same at every size: the blocks, decisions, options and the keys of
    every dict of terms (:func:`~remat.planner.distributed.structure`), shapes and the unit
    of times apart (the bytes of a profile counting FLOPs are those of one timing steps), and
    where its scratch came from (a profile from shapes has it measured later, or not)."""
    return structure(
        dataclasses.replace(
            prof,
            input_shapes=[],
            cost_unit="s",  # the unit apart: one value at every size
            scratch=dataclasses.replace(prof.scratch, located=False),
            from_shapes=False,
        )
    )


def interpolate(knots: Sequence[tuple[int, int | float]], x: int) -> Fraction:
    """The value at ``x`` of the polynomial of least degree through ``knots`` (``(size,
    value)`` pairs with distinct sizes), exactly (Lagrange's form).

    Example:
        >>> from remat.planner.shapefit import interpolate
        >>> interpolate([(1, 1), (2, 4), (3, 9)], 5)   # n**2
        Fraction(25, 1)
    """
    total = Fraction(0)
    for i, (xi, yi) in enumerate(knots):
        term = Fraction(yi)
        for j, (xj, _) in enumerate(knots):
            if j != i:
                term *= Fraction(x - xj, xi - xj)
        total += term
    return total


class ShapeFit:
    """Profiles of one model at a few sizes of its varying dimension, and the profile at any
    size between them (see the module's docstring).

    Byte terms are interpolated through the *byte knots* (every size whose bytes were
    measured: the profiles given, and each profile added by :meth:`add` or :meth:`refine`),
    times through the profiles given only (a profile added with another timer has its own
    units). Between two byte knots the fit is *trusted* once :meth:`refine` found it exact
    at a size between them; :meth:`trusted` says where it is.

    Args:
        profiles: size -> the profile measured at that size (two or more sizes; the
            same blocks and decisions, as :func:`remat.profile` measures them for one model).

    Raises:
        PlanError: fewer than two sizes, or profiles of different blocks or decisions.
    """

    def __init__(self, profiles: Mapping[int, Profile]) -> None:
        if len(profiles) < 2:
            raise PlanError(
                f"ShapeFit: needs profiles at two or more sizes, got sizes {sorted(profiles)}."
            )
        self.sizes = sorted(profiles)
        self.profiles = {n: profiles[n] for n in self.sizes}
        self._structure = _structure(self.profiles[self.sizes[0]])
        for n in self.sizes[1:]:
            self._check_structure(n, self.profiles[n])
        self._times = {n: terms(p) for n, p in self.profiles.items()}
        self._bytes = dict(self._times)
        #: what the fit does with each term (the same at every size: one structure)
        self._fit = fits(self.profiles[self.sizes[0]])
        #: per size whose scratch inside operators was measured (not a profile from
        #: shapes, which sees none), its scratch terms
        self._scratch = {
            n: self._scratch_terms(t)
            for n, t in self._times.items()
            if not self.profiles[n].from_shapes
        }
        self._certified: dict[tuple[int, int], dict[str, tuple[int, ...]]] = {}
        self.misfits: dict[int, list[str]] = {}
        """Per size checked by :meth:`refine`, the byte terms the fit missed there."""

    def _scratch_terms(self, values: Mapping[str, int | float]) -> dict[str, int | float]:
        """The scratch terms of :func:`terms`' record (:attr:`Fit.BOUND`: the workspace of
        one operator, which its kernel sizes by thresholds of its own, no polynomial in the
        size; between two knots the larger of their values, not fitted, never checked)."""
        return {k: v for k, v in values.items() if self._fit[k] is Fit.BOUND}

    def _exact(self, name: str) -> bool:
        """Whether the term ``name`` is a byte term fitted exactly (:attr:`Fit.EXACT`)."""
        return self._fit[name] is Fit.EXACT

    def _check_structure(self, size: int, prof: ProfileData) -> None:
        if _structure(prof) != self._structure:
            raise PlanError(
                f"ShapeFit: the profile at size {size} has other blocks or decisions (or other "
                f"shared block inputs) than the one at size {self.sizes[0]}; profile one model "
                "with one set of options."
            )

    @property
    def largest(self) -> int:
        """The largest size profiled."""
        return self.sizes[-1]

    @property
    def knots(self) -> list[int]:
        """Every size whose bytes were measured."""
        return sorted(self._bytes)

    @property
    def exact(self) -> bool:
        """Whether every size :meth:`refine` checked found every byte term exact."""
        return not any(self.misfits.values())

    def add(self, size: int, prof: Profile) -> None:
        """Take the bytes measured at ``size`` as a knot (its times are not used)."""
        self._check_structure(size, prof)
        self._bytes[size] = terms(prof)
        if not prof.from_shapes:
            self._scratch[size] = self._scratch_terms(self._bytes[size])

    def add_scratch(self, size: int, prof: Profile) -> None:
        """Take the scratch inside operators of ``prof`` (the profile at the knot ``size``
        with the scratch a real step measured there, :func:`remat.planner.stepmodel.located`):
        the profile at ``size`` becomes ``prof``, and sizes between knots are bounded by it."""
        self._check_structure(size, prof)
        got = self._scratch_terms(terms(prof))
        self._scratch[size] = got
        if size in self.profiles:
            self.profiles[size] = prof
            self._times[size] = {**self._times[size], **got}
        if size in self._bytes:
            self._bytes[size] = {**self._bytes[size], **got}

    def _scratch_at(self, name: str, size: int) -> int:
        """A scratch term at ``size``: measured there, else the larger of the sizes around
        it whose scratch was measured (0 while none was)."""
        known = sorted(self._scratch)
        if size in self._scratch or not known:
            return int(self._scratch.get(size, {}).get(name, 0))
        around = [(a, b) for a, b in zip(known, known[1:]) if a < size < b]
        ends = around[0] if around else self._window(known, size)
        return max(int(self._scratch[n][name]) for n in ends)

    @staticmethod
    def _window(knots: list[int], x: int) -> tuple[int, ...]:
        """Three consecutive knots around ``x`` (all of them when there are three or fewer):
        the interval holding ``x`` and the knot after it (before it at the end)."""
        if len(knots) <= 3:
            return tuple(knots)
        i = max([j for j in range(len(knots)) if knots[j] <= x], default=0)
        start = max(0, min(i, len(knots) - 3))
        return tuple(knots[start : start + 3])

    def _interval(self, x: int) -> tuple[int, int] | None:
        knots = self.knots
        for a, b in zip(knots, knots[1:]):
            if a < x < b:
                return a, b
        return None

    def _certify(self, multiple: int) -> None:
        """Find, for each interval between consecutive byte knots and each byte term, four
        consecutive knots around the interval on one polynomial of degree 2 (the fourth is
        where the first three's polynomial is checked); an interval is trusted when every
        term has such knots, or when no size inside it is a multiple of ``multiple``."""
        knots = self.knots
        names = [k for k in self._bytes[knots[0]] if self._exact(k)]
        self._certified = {}
        for i, (a, b) in enumerate(zip(knots, knots[1:])):
            if -(-(a + 1) // multiple) * multiple >= b:
                self._certified[(a, b)] = {}
                continue
            starts = [j for j in (i - 1, i - 2, i) if 0 <= j and j + 4 <= len(knots)]
            chosen: dict[str, tuple[int, ...]] = {}
            for name in names:
                for j in starts:
                    w = knots[j : j + 4]
                    pts = [(n, self._bytes[n][name]) for n in w[:3]]
                    if interpolate(pts, w[3]) == self._bytes[w[3]][name]:
                        chosen[name] = tuple(w[:3])
                        break
                else:
                    break
            if len(chosen) == len(names):
                self._certified[(a, b)] = chosen

    def trusted(self, size: int) -> bool:
        """Whether the bytes at ``size`` are measured, or fitted where the knots around it
        were found on one polynomial (see :meth:`refine`)."""
        return size in self._bytes or self._interval(size) in self._certified

    def values(self, size: int) -> dict[str, int | float]:
        """Every term at ``size``: bytes measured at a knot, else fitted (rounded down where
        the fit is not an integer: it misses there), and times fitted through the profiles
        given."""
        base = self._bytes.get(size)
        certified = self._certified.get(self._interval(size) or (0, 0), {})
        nearest = self._window(self.knots, size)
        times = self._window(self.sizes, size)
        out: dict[str, int | float] = {}
        for name in self._times[self.sizes[0]]:
            is_float = self._fit[name] is Fit.TIME
            if self._fit[name] is Fit.BOUND:
                out[name] = self._scratch_at(name, size)
                continue
            if not is_float and base is not None:
                out[name] = base[name]
                continue
            if is_float and size in self._times:
                out[name] = self._times[size][name]
                continue
            source = self._times if is_float else self._bytes
            window = times if is_float else certified.get(name, nearest)
            value = interpolate([(n, source[n][name]) for n in window], size)
            out[name] = max(float(value), 0.0) if is_float else math.floor(value)
        return out

    def at(self, size: int) -> Profile:
        """The profile at ``size``: the one given at that size, else the fitted one, its input
        shapes those of the largest profile with the largest size read as ``size``."""
        if size in self.profiles:
            return self.profiles[size]
        values = self.values(size)
        top = self.profiles[self.largest]
        prof = with_parts(top, lambda prefix, part: _rebuilt(part, prefix, values))
        prof.input_shapes = [
            [size if d == self.largest else d for d in shape] for shape in top.input_shapes
        ]
        return prof

    def misses(self, size: int, prof: Profile) -> list[str]:
        """The byte terms of ``prof`` (measured at ``size``) the fit does not give exactly."""
        got = terms(prof)
        fitted = self.values(size)
        return [k for k, v in got.items() if self._exact(k) and fitted[k] != v]

    def refine(
        self, measure: Callable[[int], Profile], *, multiple: int = 1, limit: int = 4
    ) -> list[str]:
        """Check the fit between the byte knots with at most ``limit`` more profiles
        (``measure(size)``, any timer; each measured size becomes a knot).

        An interval between two consecutive knots is trusted when, for every byte term,
        four consecutive knots around it lie on one polynomial of degree 2 (three define
        it, the fourth checks it to the byte), or when no size inside it is a multiple of
        ``multiple``. While an interval is not trusted and profiles are left, the widest
        (the largest first) is profiled in its middle (rounded up to ``multiple``), where
        the fit through the three nearest knots is compared with what was measured.

        Returns:
            The byte terms that fit missed (``"blocks.0.fwd_excess[keep] at 385: fitted 1,
            measured 2"``), also kept per size in :attr:`misfits`.
        """
        out: list[str] = []
        spent = 0
        while True:
            self._certify(multiple)
            knots = self.knots
            todo = [(a, b) for a, b in zip(knots, knots[1:]) if (a, b) not in self._certified]
            if not todo or spent >= limit:
                return out
            a, b = min(todo, key=lambda ab: (ab[0] - ab[1], -ab[1]))  # widest, then largest
            mid = min(b - 1, -(-((a + b) // 2) // multiple) * multiple)
            prof = measure(mid)
            spent += 1
            self._check_structure(mid, prof)
            fitted = self.values(mid)
            got = terms(prof)
            wrong = [k for k, v in got.items() if self._exact(k) and fitted[k] != v]
            self.misfits[mid] = wrong
            out += [f"{k} at {mid}: fitted {fitted[k]}, measured {got[k]}" for k in wrong]
            self._bytes[mid] = got
            if not prof.from_shapes:
                self._scratch[mid] = self._scratch_terms(got)
