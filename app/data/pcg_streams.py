"""numpy's ``default_rng(entropy).random(k)``, computed for a whole block of entropies at once.

The crop draws (``augment.sample_uniforms``) give each sample its own generator seeded with (seed, epoch, sample
id, stream). Built one at a time, numpy's ``SeedSequence`` and ``PCG64`` cost about 12 us a sample, a third of
the CPU path's work on a 32 px photo and most of the device path's. This module runs the same published
algorithms (O'Neill's seed_seq hash as numpy's ``SeedSequence`` implements it, then PCG64's XSL-RR 128/64
generator and numpy's 53-bit doubles) as uint32/uint64 array arithmetic over the block, so every draw is the
same double, bit for bit, and a run's pixels do not change.

numpy's compatibility policy (NEP 19) keeps a bit generator's stream fixed across versions, but not every
``Generator`` method's, and a reimplementation can drift from the real thing: :func:`uniforms` checks itself
against numpy's own generator once per process and, on any difference, warns and uses numpy's generators one at a
time from then on.
"""

from __future__ import annotations

import logging
import threading

import numpy as np

log = logging.getLogger(__name__)

# SeedSequence's constants (numpy/random/bit_generator.pyx; O'Neill's seed_seq_fe).
_INIT_A, _MULT_A = np.uint32(0x43B0D7E5), np.uint32(0x931E8875)
_INIT_B, _MULT_B = np.uint32(0x8B51F9DD), np.uint32(0x58F38DED)
_MIX_L, _MIX_R = np.uint32(0xCA01F9DD), np.uint32(0x4973F715)
_XSHIFT = np.uint32(16)
_POOL = 4  # SeedSequence's default pool size, in uint32 words
# PCG64's 128-bit LCG multiplier (numpy/random/src/pcg64/pcg64.h), as (high, low) 64-bit halves.
_MUL_HI, _MUL_LO = np.uint64(2549297995355413924), np.uint64(4865540595714422341)
_M32 = np.uint64(0xFFFFFFFF)
_S32 = np.uint64(32)


def _hashmix(value: np.ndarray, hash_const: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    value = value ^ hash_const
    hash_const = hash_const * _MULT_A
    value = value * hash_const
    return value ^ (value >> _XSHIFT), hash_const


def _mix(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    r = _MIX_L * x - _MIX_R * y
    return r ^ (r >> _XSHIFT)


def _pool(entropy: np.ndarray) -> np.ndarray:
    """SeedSequence's mixed pool, (n, 4) uint32, of (n, L) uint32 entropy words (``mix_entropy``)."""
    n, length = entropy.shape
    hc = np.full(n, _INIT_A, np.uint32)
    mixer = np.empty((n, _POOL), np.uint32)
    for i in range(_POOL):
        word = entropy[:, i] if i < length else np.zeros(n, np.uint32)
        mixer[:, i], hc = _hashmix(word, hc)
    for src in range(_POOL):
        for dst in range(_POOL):
            if src != dst:
                h, hc = _hashmix(mixer[:, src], hc)
                mixer[:, dst] = _mix(mixer[:, dst], h)
    for src in range(_POOL, length):
        for dst in range(_POOL):
            h, hc = _hashmix(entropy[:, src], hc)
            mixer[:, dst] = _mix(mixer[:, dst], h)
    return mixer


def _state64(pool: np.ndarray, n_words64: int) -> np.ndarray:
    """``SeedSequence.generate_state(n_words64, np.uint64)``: (n, n_words64) uint64."""
    n = pool.shape[0]
    hc = np.full(n, _INIT_B, np.uint32)
    out32 = np.empty((n, 2 * n_words64), np.uint32)
    for i in range(2 * n_words64):
        v = pool[:, i % _POOL] ^ hc
        hc = hc * _MULT_B
        v = v * hc
        out32[:, i] = v ^ (v >> _XSHIFT)
    lo, hi = out32[:, 0::2].astype(np.uint64), out32[:, 1::2].astype(np.uint64)
    return lo | (hi << _S32)  # little-endian pairs of words, as numpy views them


def _mulhi(a: np.ndarray, b: np.uint64) -> np.ndarray:
    """The high 64 bits of the 128-bit product of uint64 ``a`` and ``b``."""
    a0, a1 = a & _M32, a >> _S32
    b0, b1 = b & _M32, b >> _S32
    p00, p01, p10, p11 = a0 * b0, a0 * b1, a1 * b0, a1 * b1
    mid = (p00 >> _S32) + (p01 & _M32) + (p10 & _M32)
    return p11 + (p01 >> _S32) + (p10 >> _S32) + (mid >> _S32)


def _step(hi: np.ndarray, lo: np.ndarray, inc_hi: np.ndarray, inc_lo: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """state = state * multiplier + inc (mod 2**128)."""
    new_hi = _mulhi(lo, _MUL_LO) + lo * _MUL_HI + hi * _MUL_LO
    new_lo = lo * _MUL_LO
    out_lo = new_lo + inc_lo
    return new_hi + inc_hi + (out_lo < new_lo).astype(np.uint64), out_lo


def _doubles(seed4: np.ndarray, k: int) -> np.ndarray:
    """PCG64 seeded from ``generate_state(4, uint64)`` rows, then ``Generator.random(k)``: (n, k) float64."""
    init_hi, init_lo, seq_hi, seq_lo = (seed4[:, j] for j in range(4))
    inc_hi = (seq_hi << np.uint64(1)) | (seq_lo >> np.uint64(63))
    inc_lo = (seq_lo << np.uint64(1)) | np.uint64(1)
    hi, lo = _step(np.zeros_like(init_hi), np.zeros_like(init_lo), inc_hi, inc_lo)
    lo2 = lo + init_lo
    hi = hi + init_hi + (lo2 < lo).astype(np.uint64)
    hi, lo = _step(hi, lo2, inc_hi, inc_lo)
    out = np.empty((len(init_hi), k), np.float64)
    for j in range(k):
        hi, lo = _step(hi, lo, inc_hi, inc_lo)
        x, rot = hi ^ lo, hi >> np.uint64(58)
        v = (x >> rot) | (x << ((np.uint64(64) - rot) & np.uint64(63)))  # XSL-RR output
        out[:, j] = (v >> np.uint64(11)).astype(np.float64) * (1.0 / 9007199254740992.0)
    return out


def _vectorised(rows: np.ndarray, k: int) -> np.ndarray:
    """(n, k) doubles of ``default_rng(list(row)).random(k)`` for each row of non-negative int entries."""
    out = np.empty((len(rows), k), np.float64)
    # An int of 2**32 or more is two entropy words, so rows group by their words' layout (nearly always one).
    wide = rows >= np.uint64(2**32)
    layouts, which = np.unique(wide, axis=0, return_inverse=True)
    for li, layout in enumerate(layouts):
        sel = np.flatnonzero(which.reshape(-1) == li)
        cols = []
        for j, two in enumerate(layout):
            cols.append(rows[sel, j] & _M32)
            if two:
                cols.append(rows[sel, j] >> _S32)
        entropy = np.stack(cols, axis=1).astype(np.uint32)
        with np.errstate(over="ignore"):
            out[sel] = _doubles(_state64(_pool(entropy), 4), k)
    return out


def _one_at_a_time(rows: list[list[int]], k: int) -> np.ndarray:
    out = np.empty((len(rows), k), np.float64)
    for i, row in enumerate(rows):
        out[i] = np.random.default_rng(row).random(k)
    return out


_CHECK_LOCK = threading.Lock()
_checked: bool | None = None  # None: not yet checked in this process; then whether the vectorised path agrees


def _agrees() -> bool:
    global _checked
    with _CHECK_LOCK:
        if _checked is None:
            probe = [[0, 0, 0, 0xA06], [7, 3, 123456, 0xA06], [2**31 + 5, 41, 2**40 + 17, 0xF11],
                     [2**63 + 1, 2**32, 2**33 - 1, 9]]
            got = _vectorised(np.array(probe, np.uint64), 7)
            _checked = bool(np.array_equal(got, _one_at_a_time(probe, 7)))
            if not _checked:
                log.warning("lightray.data.pcg_streams: numpy %s's default_rng(...).random() no longer matches the "
                            "vectorised SeedSequence + PCG64 streams; crop draws fall back to one generator per "
                            "sample (correct, about 12 us a sample slower)", np.__version__)
        return _checked


def uniforms(columns: list[np.ndarray | int], k: int) -> np.ndarray:
    """(n, k) float64: row ``i`` is ``np.random.default_rng([c[i] for c in columns]).random(k)``, exactly.

    ``columns``: equal-length int arrays or scalars (broadcast), each entry in [0, 2**64). Anything else (a
    negative entry) goes through numpy's own generator, which raises as it always has."""
    arrays = np.broadcast_arrays(*[np.atleast_1d(np.asarray(c)) for c in columns])
    n = len(arrays[0])
    if n == 0:
        return np.empty((0, k), np.float64)
    in_range = all(a.dtype.kind == "u" or (a.dtype.kind == "i" and (a >= 0).all()) for a in arrays)
    if in_range and _agrees():
        return _vectorised(np.stack([a.astype(np.uint64) for a in arrays], axis=1), k)
    return _one_at_a_time([[int(a[i]) for a in arrays] for i in range(n)], k)
