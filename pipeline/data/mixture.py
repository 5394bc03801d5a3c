"""Data mixtures: how many times pack writes each train document, so that every
source's share of the train tokens is the one ``pack.mixture`` asks for.

A mixture maps source names (``ingest.sources[].name``, by default the source's
path) to a ``weight`` or a ``tokens`` budget. Sources with a budget get exactly
that many train tokens; weighted sources share the train tokens they have
between them (so the corpus keeps its size) in proportion to their weights.
Validation documents are never resampled.

For a source with ``available`` train tokens and a ``target``, every document is
written ``target // available`` times, and the remaining ``target mod available``
tokens are filled with one more copy of documents taken in a seeded order (the
BLAKE2b hash of seed and id, person ``pack-mix``), each taken only while it
still fits (:func:`pipeline.data.shares.multiplicities`). Downsampling is the
case ``target < available``; upsampling repeats whole passes over the source.
The shortfall is smaller than the shortest document left without its extra copy,
so on real corpora the realised tokens are within a few of the target; and the
choice depends only on the seed, the ids and the token counts: not on worker
counts or row order.
"""

from __future__ import annotations

import hashlib
import math
from typing import Iterable, Mapping

import numpy as np
from pydantic import Field, model_validator

from pipeline.config import ParamsModel
from pipeline.data import shares
from pipeline.errors import StageError


class MixtureError(StageError):
    """The mixture cannot be realised: unknown or unlisted sources, or a source with nothing to give."""


MAX_TOKENS = 10**15  # a budget beyond any corpus (and within int64, which the counts are)


class Share(ParamsModel):
    """One source's part of the train tokens: a ``weight`` or a ``tokens`` budget."""

    weight: float | None = Field(None, gt=0, description="share of the weighted sources' train tokens")
    tokens: int | None = Field(None, gt=0, le=MAX_TOKENS,
                               description="train tokens to take from the source, instead of a weight")

    @model_validator(mode="after")
    def _one_of(self) -> "Share":
        if (self.weight is None) == (self.tokens is None):
            raise ValueError("give a weight or a tokens budget (one of them)")
        return self


def check_names(available: Iterable[str], mixture: Mapping[str, Share]) -> None:
    """Raise MixtureError, naming them, for sources with train documents that the
    mixture does not list, and mixture entries with no such source."""
    shares.check_names(available, mixture, "pack.mixture", MixtureError)


def targets(available: Mapping[str, int], mixture: Mapping[str, Share]) -> dict[str, int]:
    """Train tokens wanted from each source. Raises MixtureError, naming them, for
    sources of the data without an entry and entries without data."""
    check_names(available, mixture)
    weighted = shares.summable({n: s.weight for n, s in mixture.items() if s.weight is not None})
    pool = sum(available[n] for n in weighted)
    total_weight = sum(weighted.values())
    out = {n: int(s.tokens) for n, s in mixture.items() if s.tokens is not None}
    out.update({n: round(_part(pool, w, total_weight)) for n, w in weighted.items()})
    for n, t in out.items():
        if t > 0 and available[n] == 0:
            raise MixtureError(f"source {n!r} has no train tokens but the mixture asks for {t}")
    return out


def _part(pool: int, weight: float, total_weight: float) -> float:
    """``pool * weight / total_weight``, in that order (so ordinary weights round as
    they always have), or as ``pool * (weight / total_weight)`` where ``pool *
    weight`` overflows (a weight near the largest float, beside smaller ones)."""
    part = pool * weight / total_weight
    return part if math.isfinite(part) else pool * (weight / total_weight)


def order_keys(seed: int, ids: list[str]) -> np.ndarray:
    """The seeded order in which documents of a source get their extra copy."""
    return np.array([int.from_bytes(hashlib.blake2b(f"{seed}\x00{i}".encode(), digest_size=8,
                                                    person=b"pack-mix").digest(), "big") for i in ids],
                    dtype=np.uint64)


def repeat_warnings(available: Mapping[str, int], wanted: Mapping[str, int], max_repeats: float) -> list[str]:
    """One line per source that needs more than ``max_repeats`` passes over its documents."""
    lines = []
    for n in sorted(wanted):
        if available[n] and wanted[n] / available[n] > max_repeats:
            lines.append(f"source {n!r} has {available[n]:,} train tokens but the mixture asks for {wanted[n]:,}: "
                         f"each document is repeated {wanted[n] / available[n]:.2f} times on average, more than "
                         f"pack.max_repeats={max_repeats:g}")
    return lines


def empty_warnings(wanted: Mapping[str, int], realised: Mapping[str, int], shortest: Mapping[str, int]) -> list[str]:
    """One line per source that the mixture lists but takes nothing of: its target
    is below its shortest document, which is never cut (a tiny weight, or a
    small budget, beside a large corpus)."""
    return [f"source {n!r}: the mixture asks for {wanted[n]:,} train tokens, fewer than its shortest document "
            f"({shortest[n]:,} tokens), so none of its documents is trained on; raise its weight or tokens"
            for n in sorted(wanted) if realised[n] == 0 and shortest.get(n, 0) > 0]
