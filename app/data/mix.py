"""Which samples share a shard: a seeded mix of the split, so that the order of a source's rows never
decides what a shard holds.

The epoch plan (``lightray.data.plan``) draws each global batch from one or two shards (shard-granular reads
keep training I/O sequential), so every shard must be a fair sample of the split. A listing of class
folders is sorted by class, and so are many row sources: the Hugging Face ``datasets`` layout of a dataset
built from class folders is one file per split, its rows in class order. Shards of consecutive rows would
then hold one class each, and every batch one class: the run trains at chance.

ImageFolder listings are always mixed (reading files in any order costs the same). A row source is mixed
when its labels show that runs of consecutive rows are not fair samples (:func:`clustered`); a source
written shuffled keeps its row ranges, read sequentially, since mixing it would read each file once per
shard for nothing.
"""

from __future__ import annotations

import math

import numpy as np

SHARD_MIX_SEED = 20200731
CHECK_ROWS = 512  # rows per run in the clustering check (the default shard size)
LIMIT = 6.0  # standard deviations: a shuffled split scores within a few, a class-sorted one hundreds


def shard_order(n: int, split: str) -> np.ndarray:
    """A fixed pseudo-random permutation of a split's ``n`` selected entries (same inputs, same shards)."""
    rng = np.random.default_rng([SHARD_MIX_SEED, sum(split.encode())])
    return rng.permutation(n)


def clustering(labels: np.ndarray, rows: int = 0) -> float:
    """How far runs of ``rows`` consecutive labels are from fair samples of the whole, in standard deviations.
    ``rows`` 0: CHECK_ROWS, or an eighth of a smaller split (at least 16), so that a small split cut into
    small shards is checked at a size it is cut to.

    The statistic is Pearson's chi-square of each run's class counts against the split's class shares,
    summed over runs. For runs drawn at random it has mean about ``runs * (classes - 1)`` and standard
    deviation about the square root of twice that; the result is how many of those deviations above the mean
    the source lies (a shuffled source: within a few; a class-sorted one: hundreds)."""
    labels = np.asarray(labels, dtype=np.int64)
    labels = labels[labels >= 0]
    n = len(labels)
    rows = rows or check_rows(n)
    if n < 2 * rows:  # one shard, or a shard and a tail: the plan permutes within the shard anyway
        return 0.0
    classes, codes = np.unique(labels, return_inverse=True)
    if len(classes) < 2:
        return 0.0
    share = np.bincount(codes, minlength=len(classes)) / n
    runs = n // rows
    counts = np.zeros((runs, len(classes)))
    np.add.at(counts, (np.arange(runs * rows) // rows, codes[:runs * rows]), 1.0)
    return counts_deviation(counts, share, n)


def counts_deviation(counts: np.ndarray, share: np.ndarray, n: int) -> float:
    """The statistic of :func:`clustering` for given groups: ``counts`` (groups x classes) against the split's
    class ``share`` over its ``n`` samples, in standard deviations above what random groups would score."""
    sizes = counts.sum(1, keepdims=True)
    expected = sizes * share
    chi2 = float((((counts - expected) ** 2) / expected).sum())
    # Sampling without replacement from the split shrinks the variance by (n - size) / (n - 1).
    dof = float(((len(share) - 1) * (n - sizes) / max(1, n - 1)).sum())
    return (chi2 - dof) / math.sqrt(2 * max(dof, 1.0))


def check_rows(n: int) -> int:
    return min(CHECK_ROWS, max(16, n // 8))
