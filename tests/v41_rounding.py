"""The number formats and round trips of deepseek-v41.md §7.2-7.4 in float64 numpy, written from the
spec text for tests/v41_oracle.py (its `forward(round_trips=True)`). Nothing here is imported from
dsjax."""

from __future__ import annotations

import numpy as np

F = np.float64


def round_significand(x, bits):
    """RNE of float64 x to `bits` significant bits (no exponent limits)."""
    m, e = np.frexp(np.asarray(x, F))  # x = m 2^e, 0.5 <= |m| < 1
    return np.ldexp(np.round(m * 2.0 ** bits), e - bits)  # np.round: half to even


def _minifloat(x, bits, min_exp, max_value):
    """RNE to a format with `bits` significant bits, normals from 2^(min_exp - 1), saturating."""
    x = np.clip(np.asarray(x, F), -max_value, max_value)
    _, e = np.frexp(x)
    ulp = 2.0 ** (np.maximum(e, min_exp) - bits)
    return np.round(x / ulp) * ulp


def e4m3(x):
    return _minifloat(x, 4, -5, 448.0)


def e2m1(x):
    return _minifloat(x, 2, 1, 6.0)


def pow2_scale(a, m):
    """P(a, M) = 2^ceil(log2(a · fp32(1/M))), the product formed in fp32 (§7.2)."""
    p = np.float32(a) * np.float32(1.0 / m)
    mant, e = np.frexp(p.astype(F))
    return np.ldexp(1.0, np.where(np.abs(mant) == 0.5, e - 1, e))


class Rounding:
    """The round trips of v41_oracle's `forward(round_trips=...)`; identities when off.

    jitter: every computed value x moves by jitter · |x| (per_row: jitter · max|x| over its row,
    the last axis: float32 errors scale with the magnitudes a value is formed from, so a small
    element of a row can move relatively more) before it is rounded. If a jitter of either sign
    leaves a forward's output unchanged, no rounding decision lies that close to its boundary,
    and an implementation whose values are that close to float64 rounds them all the same way."""

    def __init__(self, on, jitter=0.0, per_row=False):
        self.on = on
        self.jitter = jitter
        self.per_row = per_row

    def bf16(self, x):
        """RNE to bf16 of a computed value."""
        x = np.asarray(x, F)
        if not self.on:
            return x
        if self.jitter:
            x = x + self.jitter * (np.max(np.abs(x), axis=-1, keepdims=True) if self.per_row and x.ndim else np.abs(x))
        return round_significand(x, 8)

    def decided(self, x):
        """RNE to bf16 of a value every implementation forms exactly (FP4 dots, products of bf16
        values by powers of two, exact fp32 sums): not jittered."""
        return round_significand(x, 8) if self.on else np.asarray(x, F)

    def _groups(self, x, n):
        x = self.bf16(x)  # every QDQ reads bf16
        g = x.reshape(*x.shape[:-1], -1, n)
        return g, np.abs(g).max(axis=-1, keepdims=True)

    def fp8(self, x):
        """QDQ_fp8 per 32 (§7.3): s = P(max(amax, 1e-4), 448), e4m3(x / s) s."""
        if not self.on:
            return np.asarray(x, F)
        g, a = self._groups(x, 32)
        s = pow2_scale(np.maximum(a, np.float32(1e-4)), 448.0)
        return (e4m3(g / s) * s).reshape(np.shape(x))

    def fp4_e8m0(self, x):
        """QDQ_fp4/32,e8m0 (§7.4): s = P(max(amax, 6·2^-126), 6), e2m1(clip(x / s, ±6)) s."""
        if not self.on:
            return np.asarray(x, F)
        g, a = self._groups(x, 32)
        s = pow2_scale(np.maximum(a, 6.0 * 2.0 ** -126), 6.0)
        return (e2m1(g / s) * s).reshape(np.shape(x))

    def fp4_e4m3(self, x):
        """QDQ_fp4/16,e4m3 (§7.4): s = e4m3(a / 6) (fp32 division), e2m1 of the fp32 quotient x / s."""
        if not self.on:
            return np.asarray(x, F)
        g, a = self._groups(x, 16)
        s = e4m3(np.float32(np.maximum(a, 6.0 * 2.0 ** -9)) / np.float32(6.0))
        return (e2m1((np.float32(g) / np.float32(s)).astype(F)) * s).reshape(np.shape(x))
