"""Per-shard resume for the data stages: shards committed one by one, each with
the fingerprint it was made under.

A data stage killed after hours should not start again from zero. DVC deletes a
stage's outputs before it reruns it, unless they are declared ``persist: true``;
the data stages' outputs are, and this module is the validation that makes
keeping them safe (as the training stages' checkpoints do for theirs).

*Commit protocol.* A stage writes its output as numbered shards. Shard ``k`` is
written under a temporary name, fsynced and renamed to ``<stem>-0000k<ext>``
(:func:`pipeline.files.atomic_path`); then its record ``<stem>-0000k.json`` is
written the same way, holding the run's ``fingerprint``, the shard's ``sha256``
and the stage's own fields (its counts, and where in the input the shard ends,
so that the next shard can start there). A shard counts as committed only when
its record exists, names this run's fingerprint, is as it was written (it holds
the digest of its own fields, ``record_sha256``: a hand-edited count or end
point is not built on), the shard's bytes hash to the record's digest, and (for
a format whose row count its metadata holds: Arrow IPC files, Parquet) the
shard holds the record's ``rows``. A kill at any moment leaves either a
committed shard, or a shard without a record (or a temporary file), which is
removed. A directory where a shard or record belongs is never removed: it is
a one-line error.

*Fingerprint.* A digest of what the output depends on: the stage name, the
params that change outputs (not the executor or the worker count: the output is
the same under all of them), the input (the upstream manifest's digest, or the
files' names, sizes and modification times) and the code (the digest of the
modules that compute the output). Shards made under another fingerprint are
stale: :meth:`ShardLog.open` removes them, with a warning naming each, before
anything new is written. Shards of the same fingerprint are kept, so a rerun
only writes the shards that are missing or damaged.

*Manifest.* When every shard is committed the stage writes ``manifest.json``
(last, atomically), listing the shards, their rows and digests.
:meth:`ShardLog.open` removes it first: a folder without a manifest is
incomplete, and readers refuse it.

*What DVC sees.* The manifest and the shards are the data; the records (and
pack's checkpoints, clean's decisions) are bookkeeping that names the
fingerprint, so code included. The project's ``.dvcignore`` leaves the
bookkeeping out of DVC's hash of an output and the manifest holds no
fingerprint: a change of code that leaves the shards byte-identical leaves
the output's hash as it was, and DVC reruns nothing downstream.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.errors import StageError
from pipeline.files import json_default, atomic_path, read_json, sha256_file, write_json

log = logging.getLogger("pipeline.data.resume")

MANIFEST = "manifest.json"


def digest_json(data: Any) -> str:
    """sha256 of ``data`` as canonical JSON (sorted keys, no spaces)."""
    return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":"), default=str).encode()).hexdigest()


def record_digest(rec: Mapping[str, Any]) -> str:
    """The digest of a commit record's fields (all but ``record_sha256``) as a
    reader reads them back from its JSON."""
    fields = {k: v for k, v in rec.items() if k != "record_sha256"}
    return digest_json(json.loads(json.dumps(fields, default=json_default)))


def _arrow_rows(path: Path) -> int:
    with pa.memory_map(str(path), "r") as source:  # the footer and the batches' headers: no column is read
        reader = pa.ipc.open_file(source)
        return sum(reader.get_batch(i).num_rows for i in range(reader.num_record_batches))


# A shard's row count from its metadata, by extension: how a record's ``rows`` is checked cheaply
ROW_COUNTS: dict[str, Callable[[Path], int]] = {
    ".arrow": _arrow_rows,
    ".parquet": lambda path: pq.read_metadata(path).num_rows,
}


def code_digest(*modules: Any) -> str:
    """sha256 over the source files of ``modules`` (module objects), in order:
    a change to the code that computes an output makes its old shards stale."""
    h = hashlib.sha256()
    for m in modules:
        path = Path(m.__file__)
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def files_digest(paths: Iterable[Any]) -> str:
    """sha256 over each file's path, size and modification time: what a stage's
    raw input looks like without reading it (a file touched but unchanged makes
    the shards stale, which costs time but never mixes inputs). A path is a
    str, a Path, or a :class:`~pipeline.data.remote.RemotePath`."""
    entries = []
    for p in paths:
        st = (p if hasattr(p, "stat") else Path(p)).stat()
        entries.append([str(p), st.st_size, st.st_mtime_ns])
    return digest_json(entries)


def input_digest(path: str | Path) -> str:
    """The digest of an upstream output: a sharded folder's manifest (which holds
    every shard's sha256), or a single file's sha256."""
    path = Path(path)
    return sha256_file(path / MANIFEST if path.is_dir() else path)


def fingerprint(stage: str, params: Mapping[str, Any], inputs: Mapping[str, str], code: str) -> str:
    return digest_json({"stage": stage, "params": params, "inputs": inputs, "code": code})


class ShardLog:
    """The committed shards of one output folder: ``<folder>/<stem>-NNNNN<ext>``
    with records ``<stem>-NNNNN.json`` (see the module docstring).

    Use: :meth:`open` (removes stale, damaged and uncommitted files; returns
    what it kept), then per shard :meth:`committed` (the record, or None) and
    :meth:`commit`, and last :meth:`finish` (the manifest)."""

    def __init__(self, folder: str | Path, fingerprint: str, stem: str = "shard", ext: str = ".parquet"):
        self.folder, self.fp, self.stem, self.ext = Path(folder), fingerprint, stem, ext
        self.records: dict[int, dict[str, Any]] = {}
        self.removed: list[str] = []
        self._name = re.compile(rf"{re.escape(stem)}-(\d{{5,}})(?:{re.escape(ext)}|\.json)")

    def path(self, k: int) -> Path:
        return self.folder / f"{self.stem}-{k:05d}{self.ext}"

    def record_path(self, k: int) -> Path:
        return self.folder / f"{self.stem}-{k:05d}.json"

    def _refuse_directory(self, path: Path) -> None:
        if path.is_dir() and not path.is_symlink():  # not written by the stage: maybe the user's
            raise StageError(f"{path} is a directory where a shard or its record belongs; it is not removed: "
                             "move it out of the stage's output and run again")

    def _remove(self, path: Path, why: str) -> None:
        self._refuse_directory(path)
        if path.is_symlink() or path.exists():  # a link, dangling or not, is removed, never what it points to
            path.unlink()
            self.removed.append(f"{path.name} ({why})")

    def open(self) -> dict[int, dict[str, Any]]:
        """Scan the folder: keep each shard whose record names this fingerprint and
        whose bytes match the record's sha256; remove the manifest, temporary
        files, and every other shard and record, logging one line per removal.
        Returns the kept records by shard index."""
        if self.folder.exists() and not self.folder.is_dir():
            raise StageError(f"{self.folder} is a file, where the stage writes its output folder: move it away")
        self.folder.mkdir(parents=True, exist_ok=True)
        for p in sorted(self.folder.iterdir()):  # before anything is removed: the run stops here
            if self._name.fullmatch(p.name):
                self._refuse_directory(p)
        # the manifest says "complete"; it is written again when the stage completes (not a loss: no warning)
        (self.folder / MANIFEST).unlink(missing_ok=True)
        for tmp in sorted(self.folder.glob(f".{self.stem}-*.tmp")):
            self._remove(tmp, "unfinished write")
        indexes = sorted({int(m.group(1)) for p in self.folder.iterdir() if (m := self._name.fullmatch(p.name))})
        for k in indexes:
            why = self._check(k)
            if why is None:
                continue
            self._remove(self.path(k), why)
            self._remove(self.record_path(k), why)
        self._warn(self.removed)
        return dict(self.records)

    def _warn(self, removed: list[str]) -> None:
        """Log ``removed`` ("name (why)" each) as one warning line per reason, however many shards."""
        by_reason: dict[str, list[str]] = {}
        for line in removed:
            name, why = line.split(" (", 1)
            by_reason.setdefault(why[:-1], []).append(name)
        for why, names in by_reason.items():
            shown = ", ".join(names) if len(names) <= 4 else f"{names[0]}, {names[1]}, ... {names[-1]}"
            log.warning("%s: removed %d file(s), %s: %s", self.folder, len(names), why, shown)

    def _check(self, k: int) -> str | None:
        """None when shard ``k`` is committed under this fingerprint (and keep its record), else why not."""
        rec_path, path = self.record_path(k), self.path(k)
        if not rec_path.is_file():
            # DVC caches a persisted output without the .dvcignore'd records, so a restored copy lacks them too
            return ("no commit record (a run interrupted while writing it, or a copy of the output restored without "
                    "its records, as `dvc exp run --temp` and `dvc checkout` make; it is written again)")
        try:
            rec = read_json(rec_path)
        except (OSError, ValueError):
            return "unreadable commit record"
        if not isinstance(rec, dict) or rec.get("fingerprint") != self.fp:
            return "made under another fingerprint: other input, params or code"
        if rec.get("record_sha256") != record_digest(rec):  # its counts and end point: the shard cannot tell
            return "its record was edited or written by an older version (its fields do not match its digest)"
        if rec.get("shard") != path.name:  # renamed: its fields (where it ends) are of another place
            return "its record names another shard (renamed by hand?)"
        if path.is_symlink():  # not what the stage wrote, and its target may change under it
            return "the shard is a symbolic link"
        if not path.is_file():
            return "shard missing"
        if sha256_file(path) != rec.get("sha256"):
            return "sha256 does not match its record"
        count = ROW_COUNTS.get(self.ext)
        if count is not None and "rows" in rec:
            try:
                rows = count(path)
            except (OSError, pa.ArrowException):
                return "not a readable shard"
            if rows != rec["rows"]:
                return "its row count does not match its record"
        self.records[k] = rec
        return None

    def keep_below(self, n: int, why: str) -> None:
        """Remove every shard of index ``n`` or more, and its record (a stage that
        resumes from a point before them), logging one line for them all."""
        start = len(self.removed)
        indexes = {int(m.group(1)) for p in self.folder.iterdir() if (m := self._name.fullmatch(p.name))} \
            if self.folder.is_dir() else set()
        for k in sorted(k for k in indexes | set(self.records) if k >= n):
            self.records.pop(k, None)
            self._remove(self.path(k), why)
            self._remove(self.record_path(k), why)
        self._warn(self.removed[start:])

    def committed(self, k: int) -> dict[str, Any] | None:
        """The record of shard ``k`` if it is committed, else None."""
        return self.records.get(k)

    @contextlib.contextmanager
    def writing(self, k: int) -> Iterator[Path]:
        """A temporary path for shard ``k``, renamed to the shard's name (after an
        fsync) on a clean exit; :meth:`seal` then commits it."""
        self.records.pop(k, None)
        self.record_path(k).unlink(missing_ok=True)
        with atomic_path(self.path(k)) as tmp:
            yield tmp

    def seal(self, k: int, fields: Mapping[str, Any]) -> dict[str, Any]:
        """Commit the written shard ``k``: its record, with its sha256 and ``fields``."""
        path = self.path(k)
        rec = {"fingerprint": self.fp, "shard": path.name, "sha256": sha256_file(path), **fields}
        rec["record_sha256"] = record_digest(rec)
        write_json(self.record_path(k), rec)
        self.records[k] = rec
        return rec

    def commit(self, k: int, write: Callable[[Path], Any], fields: Mapping[str, Any]) -> dict[str, Any]:
        """Write shard ``k`` with ``write(tmp_path)``, then its record with ``fields``;
        each atomically, the shard first. Returns the record."""
        with self.writing(k) as tmp:
            write(tmp)
        return self.seal(k, fields)

    def finish(self, n: int, fields: Mapping[str, Any]) -> dict[str, Any]:
        """Write the manifest for shards ``0..n-1`` (all committed) with ``fields``
        and each shard's ``rows`` (from its record) and sha256; remove any shard
        of a higher index. Returns the manifest."""
        missing = [k for k in range(n) if k not in self.records]
        if missing:
            raise RuntimeError(f"{self.folder}: shard(s) {missing} are not committed")
        for k in sorted(k for k in self.records if k >= n):
            self._remove(self.path(k), "beyond the last shard")
            self._remove(self.record_path(k), "beyond the last shard")
            del self.records[k]
        shards = [{"path": self.path(k).name, "rows": self.records[k].get("rows"),
                   "sha256": self.records[k]["sha256"]} for k in range(n)]
        # no fingerprint here: the manifest is what the next stage reads and DVC hashes, so it holds the
        # data only, and a code change that leaves the shards byte-identical leaves it byte-identical too
        manifest = {**fields, "shards": shards}
        write_json(self.folder / MANIFEST, manifest)
        return manifest
