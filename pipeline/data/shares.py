"""Shares of named sources, as pack's mixture and the tokenizer's sample weights
realise them: which sources must be named, and how many copies of each document
make a source's share.

A share is met with whole documents: for a source whose documents hold
``total`` units (tokens for pack, bytes for the tokenizer) and a ``target``,
every document is taken ``target // total`` times, and the remaining ``target
mod total`` units are filled with one more copy of documents in a seeded order,
each taken only while it still fits. Taking less than a source holds is the case
``target < total``; more repeats whole passes over it. The shortfall is smaller
than the shortest document left without its extra copy, and the choice depends
only on the order keys, the sizes and the target: not on worker counts or row
order.
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping

import numpy as np

from pipeline.errors import StageError


def check_names(available: Iterable[str], named: Mapping[str, object], key: str, error: type[StageError]) -> None:
    """Raise ``error``, naming them, for sources with train documents that the
    params ``key`` (a mapping by source name) do not list, and entries with no
    such source."""
    unlisted = sorted(set(available) - set(named))
    unknown = sorted(set(named) - set(available))
    if unlisted:
        # Both at once is most often a misspelt name: say which entry it is.
        misspelt = f" and names {unknown}, which no source with train documents is called" if unknown else ""
        raise error(f"{key} has no entry for source(s) {unlisted}{misspelt}; list every train source "
                    f"(names: {sorted(available)})")
    if unknown:
        raise error(f"{key} names source(s) {unknown} that have no train documents "
                    f"(sources with train documents: {sorted(available)}); a source has none when it is "
                    f"split: val, when clean dropped all of it, or when ingest.max_bytes was reached before "
                    f"it (data/ingest/report.json, unread_files_per_source)")


def summable(weights: Mapping[str, float]) -> dict[str, float]:
    """``weights`` scaled by the largest where their sum overflows a float
    (weights near the largest float), so that each one's share, its weight over
    their sum, is their ratio as for any other weights."""
    if math.isfinite(sum(weights.values())):
        return dict(weights)
    largest = max(weights.values())
    return {n: w / largest for n, w in weights.items()}


def multiplicities(keys: np.ndarray, sizes: np.ndarray, target: int) -> np.ndarray:
    """Copies of each document (``sizes[i]`` units, order key ``keys[i]``) whose
    sizes sum to ``target`` as nearly as whole documents allow (see the module
    docstring)."""
    sizes = np.asarray(sizes, dtype=np.int64)
    total = int(sizes.sum())
    if total == 0:
        return np.zeros(len(sizes), dtype=np.int64)
    full, rest = divmod(int(target), total)
    m = np.full(len(sizes), full, dtype=np.int64)
    if rest == 0:
        return m
    order = np.argsort(keys, kind="stable")
    taken = np.cumsum(sizes[order])
    prefix = int(np.searchsorted(taken, rest, side="right"))  # the longest prefix that fits
    m[order[:prefix]] += 1
    gap = rest - (int(taken[prefix - 1]) if prefix else 0)
    for i in order[prefix:]:  # then each later document that still fits
        if gap == 0:
            break
        if 0 < sizes[i] <= gap:
            m[i] += 1
            gap -= int(sizes[i])
    return m
