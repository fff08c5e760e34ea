"""Fixed-point quantization of float updates for integer-only homomorphic sums.

A :class:`Quantizer` with ``bits`` bits and clipping range ``clip`` maps a float ``x`` to the signed
integer ``q = rint(x * scale)`` with ``scale = M / clip`` and ``M = 2**(bits-1) - 1``, so
``q`` lies in ``[-M, M]``. Values with ``|x| > clip`` cannot be represented: with
``overflow="clip"`` they are clipped to ``+-clip`` and counted (the count is returned); with
``overflow="raise"`` they are refused with a ``ValueError``. NaN and infinities are always refused.

After the server has formed the weighted integer sum ``S = sum_i w_i q_i`` (integer weights
``w_i >= 0``, total weight ``W = sum_i w_i``), :meth:`Quantizer.dequantize_sum` returns
``S / (W * scale)``, the weighted mean with weights ``w_i / W``.

Error bound (for values within ``[-clip, clip]``, i.e. none clipped):

* Rounding: ``|q - x * scale| <= 1/2`` per value, and the weights ``w_i / W`` are convex, so the
  decoded value ``y`` satisfies ``|y - sum_i (w_i / W) x_i| <= 0.5 / scale`` (plus float64 rounding,
  ~1e-16 relative).
* Integer weights: the thesis' eq. 4.4 uses ``w_i = round(p_i * P)`` for real weights ``p_i``
  (``sum p_i = 1``) and an integer precision ``P``. Against the exact mean ``sum_i p_i x_i`` the extra
  error is ``|sum_i (w_i / W - p_i) x_i| <= max|x| * sum_i |w_i / W - p_i|``. With
  ``|w_i - p_i P| <= 1/2`` and ``|W - P| <= N / 2`` this is at most ``max|x| * N / W`` for ``N``
  clients (a worst case; :func:`aggregate_error_bound` computes the sum exactly for given ``p``, ``w``).
  It shrinks as ``P`` grows; weights that are integers to begin with (example counts) have none.

So ``|y - sum_i p_i x_i| <= 0.5 / scale + max|x| * sum_i |w_i / W - p_i|`` (see
:func:`aggregate_error_bound`). Dividing by ``W`` rather than by the nominal ``P`` keeps the weights
convex; dividing by ``P`` would scale the whole mean by ``W / P``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

OVERFLOW_MODES = ("clip", "raise")
MIN_BITS, MAX_BITS = 2, 32


@dataclass(frozen=True)
class Quantizer:
    """Signed fixed-point quantizer: ``bits`` bits (``2..32``) over ``[-clip, clip]``.

    ``overflow``: ``"clip"`` (clip out-of-range values and count them) or ``"raise"`` (refuse them).
    """

    bits: int = 16
    clip: float = 1.0
    overflow: str = "clip"

    def __post_init__(self):
        if isinstance(self.bits, bool) or not isinstance(self.bits, (int, np.integer)) \
                or not MIN_BITS <= self.bits <= MAX_BITS:
            raise ValueError(f"channel.bits must be an integer in [{MIN_BITS}, {MAX_BITS}], got {self.bits!r}")
        if isinstance(self.clip, bool) or not isinstance(self.clip, (int, float, np.floating)) \
                or not math.isfinite(self.clip) or self.clip <= 0:
            raise ValueError(f"channel.clip must be a finite number > 0, got {self.clip!r}")
        if self.overflow not in OVERFLOW_MODES:
            raise ValueError(f"channel.overflow must be one of {OVERFLOW_MODES}, got {self.overflow!r}")
        object.__setattr__(self, "bits", int(self.bits))
        object.__setattr__(self, "clip", float(self.clip))

    @property
    def max_int(self) -> int:
        """``M = 2**(bits-1) - 1``: quantized values lie in ``[-M, M]``."""
        return (1 << (self.bits - 1)) - 1

    @property
    def scale(self) -> float:
        """Integers per unit: ``M / clip``."""
        return self.max_int / self.clip

    @property
    def step_error(self) -> float:
        """Rounding error bound per value and of any convex combination: ``0.5 / scale``."""
        return 0.5 / self.scale

    def quantize(self, values: np.ndarray) -> tuple[np.ndarray, int]:
        """``(q, clipped)``: int64 array ``rint(values * scale)`` in ``[-M, M]`` (same shape) and the
        number of values that were outside ``[-clip, clip]`` (clipped; always 0 with ``"raise"``)."""
        x = np.asarray(values, dtype=np.float64)
        if not np.all(np.isfinite(x)):
            raise ValueError(f"quantize: {int(np.sum(~np.isfinite(x)))} values are NaN or infinite")
        outside = np.abs(x) > self.clip
        clipped = int(np.count_nonzero(outside))
        if clipped and self.overflow == "raise":
            raise ValueError(f"quantize: {clipped} values outside [-{self.clip}, {self.clip}] "
                             f"(largest |x| = {float(np.max(np.abs(x))):.6g}) with channel.overflow='raise'; "
                             f"raise channel.clip or use channel.overflow='clip'")
        q = np.rint(np.clip(x, -self.clip, self.clip) * self.scale).astype(np.int64)
        np.clip(q, -self.max_int, self.max_int, out=q)
        return q, clipped

    def dequantize(self, q: np.ndarray) -> np.ndarray:
        """float64 ``q / scale`` (one client's values)."""
        return np.asarray(q, dtype=np.float64) / self.scale

    def dequantize_sum(self, total: np.ndarray, total_weight: int) -> np.ndarray:
        """The weighted mean from a weighted integer sum: float64 ``total / (total_weight * scale)``."""
        if isinstance(total_weight, bool) or not isinstance(total_weight, (int, np.integer)) or total_weight < 1:
            raise ValueError(f"total_weight must be an integer >= 1, got {total_weight!r}")
        return np.asarray(total, dtype=np.float64) / (int(total_weight) * self.scale)


def aggregate_error_bound(quantizer: Quantizer, weights: Sequence[int],
                          probabilities: Sequence[float] | None = None, max_abs: float | None = None) -> float:
    """Bound on ``|decoded - target|`` per element of the weighted mean (no values clipped).

    With ``probabilities=None`` the target is ``sum_i (w_i / W) x_i`` and the bound is ``0.5 / scale``.
    With the real weights ``p_i`` (normalised here to sum to 1) the target is ``sum_i p_i x_i`` and the
    bound adds ``max_abs * sum_i |w_i / W - p_i|`` (``max_abs`` defaults to ``clip``).
    """
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or len(w) == 0 or np.any(w < 0) or w.sum() <= 0:
        raise ValueError(f"weights must be a non-empty list of integers >= 0 with a positive sum, got {weights!r}")
    bound = quantizer.step_error
    if probabilities is not None:
        p = np.asarray(probabilities, dtype=np.float64)
        if p.shape != w.shape or np.any(p < 0) or p.sum() <= 0:
            raise ValueError("probabilities must be >= 0, sum > 0, one per weight")
        m = quantizer.clip if max_abs is None else float(max_abs)
        bound += m * float(np.sum(np.abs(w / w.sum() - p / p.sum())))
    return float(bound)


def integer_weights(probabilities: Sequence[float], precision: int) -> list[int]:
    """Eq. 4.4's integer weights ``w_i = round(p_i * P)`` (``P = precision >= 1``; half to even)."""
    if isinstance(precision, bool) or not isinstance(precision, (int, np.integer)) or precision < 1:
        raise ValueError(f"channel.precision must be an integer >= 1, got {precision!r}")
    p = np.asarray(probabilities, dtype=np.float64)
    if p.ndim != 1 or len(p) == 0 or not np.all(np.isfinite(p)) or np.any(p < 0):
        raise ValueError(f"probabilities must be finite and >= 0, got {probabilities!r}")
    w = [int(v) for v in np.rint(p * int(precision))]
    if sum(w) < 1:
        raise ValueError(f"channel.precision={precision} rounds every weight to 0; raise it")
    return w


def exact_integer_weights(weights: Sequence[float], precision: int) -> list[int]:
    """A rule's weights as integers: when they already are integers, divided by their greatest common
    divisor (the same mean; equal example counts become weights of 1, which cost the combination no
    exponentiation or multiplication) if they then sum to at most ``precision`` (no rounding error), else
    ``round(p_i * precision)`` (eq. 4.4)."""
    if all(float(x).is_integer() and x >= 0 for x in weights) and sum(weights) > 0:
        ints = [int(x) for x in weights]
        g = math.gcd(*ints)  # the same mean with smaller weights: exact, and cheaper to combine
        if sum(ints) // g <= precision:
            return [w // g for w in ints]
    total = float(sum(weights))
    return integer_weights([float(x) / total for x in weights], precision)


MIN_RANGE_EXPONENT, MAX_RANGE_EXPONENT = -60, 16  # an automatic clip 2**e lies in [2**-60, 2**16]


def range_exponent(values: np.ndarray) -> int:
    """The smallest ``e`` with ``max|values| <= 2**e``, clamped to ``[MIN_RANGE_EXPONENT, MAX_RANGE_EXPONENT + 1]``
    (all zeros: ``MIN_RANGE_EXPONENT``; above the largest allowed clip: ``MAX_RANGE_EXPONENT + 1``, which the
    channel refuses). ``ValueError`` for NaN or infinities."""
    x = np.asarray(values, dtype=np.float64)
    if x.size and not np.all(np.isfinite(x)):
        raise ValueError(f"range_exponent: {int(np.sum(~np.isfinite(x)))} values are NaN or infinite")
    m = float(np.max(np.abs(x))) if x.size else 0.0
    if m == 0.0:
        return MIN_RANGE_EXPONENT
    f, k = math.frexp(m)  # m = f * 2**k, 0.5 <= f < 1
    e = k - 1 if f == 0.5 else k
    return int(min(max(e, MIN_RANGE_EXPONENT), MAX_RANGE_EXPONENT + 1))
