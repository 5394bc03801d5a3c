"""Accounting for records that enter a stage and do not leave it.

A :class:`Ledger` counts every skip or drop by reason and keeps a bounded
sample of the records themselves in a quarantine JSONL file, so that nothing is
lost without a trace and the file stays small however bad the input is.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from pipeline.files import atomic_write

# Characters that JSON leaves as they are in a string and str.splitlines() (and
# so many a JSONL reader) takes for line ends: written as their escapes.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


class Ledger:
    """Counts reasons and samples quarantined records.

    ``per_reason`` bounds how many records of each reason are kept verbatim (the
    first ones seen, which makes the file deterministic); the counts are exact.
    Long text fields are clipped to ``max_chars`` in the quarantine file.
    """

    def __init__(self, per_reason: int = 100, max_chars: int = 2000):
        self.counts: Counter[str] = Counter()
        self.samples: list[dict[str, Any]] = []
        self._kept: Counter[str] = Counter()
        self.per_reason = per_reason
        self.max_chars = max_chars

    def record(self, reason: str, source: str, location: str = "", text: str | None = None,
               detail: str = "", n: int = 1) -> None:
        self.counts[reason] += n
        if self._kept[reason] < self.per_reason:
            self._kept[reason] += 1
            entry: dict[str, Any] = {"reason": reason, "source": source, "location": location}
            if detail:
                entry["detail"] = detail
            if text is not None:
                entry["text"] = text[: self.max_chars]
                if len(text) > self.max_chars:
                    entry["text_chars"] = len(text)
            self.samples.append(entry)

    def merge(self, other: "Ledger") -> None:
        for s in other.samples:
            if self._kept[s["reason"]] < self.per_reason:
                self._kept[s["reason"]] += 1
                self.samples.append(s)
        self.counts.update(other.counts)

    def to_dict(self) -> dict[str, Any]:
        """Counts and samples as JSON data (a shard's commit record holds its own)."""
        return {"counts": dict(self.counts), "samples": list(self.samples)}

    @classmethod
    def from_dict(cls, data: dict[str, Any], per_reason: int = 100, max_chars: int = 2000) -> "Ledger":
        """The ledger :meth:`to_dict` described: merging it gives what recording its
        records again would have given."""
        ledger = cls(per_reason=per_reason, max_chars=max_chars)
        ledger.counts.update(data["counts"])
        ledger.samples = list(data["samples"])
        ledger._kept.update(s["reason"] for s in ledger.samples)
        return ledger

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def as_dict(self) -> dict[str, int]:
        return dict(sorted(self.counts.items()))

    def write(self, path: str | Path) -> None:
        with atomic_write(path) as f:
            for s in self.samples:
                line = json.dumps(s, ensure_ascii=False)
                if not line.isascii():
                    try:
                        line.encode("utf-8")
                    except UnicodeEncodeError:  # a lone surrogate (the reason for some skips): kept as its escape
                        line = json.dumps(s)
                    else:  # a record is one line for any line reader
                        line = line.translate(_LINE_BREAKS)
                f.write(line + "\n")


def counts_text(counts: dict[str, int]) -> str:
    """Counts by reason as one log line's part, by reason name: ``binary 1, non_utf8 2``."""
    return ", ".join(f"{reason} {n:,}" for reason, n in sorted(counts.items()))
