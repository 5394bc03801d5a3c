"""Compressed input files, decompressed as they are read.

A file's last suffix names its codec (:data:`COMPRESSIONS`) and the suffix
before it its format: ``corpus.jsonl.zst`` is JSON Lines, ``book.txt.gz`` text.
pyarrow's codecs decompress gzip, bz2, zstd and lz4 (frame); Python's lzma, xz.
The data stages read a compressed file as they would the file it was made from.
A file in an object store (:class:`~pipeline.data.remote.RemotePath`) is read
the same way, compressed or not.
"""

from __future__ import annotations

import io
import lzma
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO, Callable, Iterable, Iterator, TypeVar

import pyarrow as pa

from pipeline.data.remote import RemotePath, open_stream

COMPRESSIONS: dict[str, str] = {".gz": "gzip", ".bz2": "bz2", ".zst": "zstd", ".zstd": "zstd", ".lz4": "lz4",
                                ".xz": "xz"}

# Where each codec checks its data: corrupt data is found there, not before.
CHECKED_AT: dict[str, str] = {
    "gzip": "by a CRC at the end of each member",
    "bz2": "by a CRC at the end of each block of up to 900 kB",
    "zstd": "by a checksum at the end of each frame, where the file has one",
    "lz4": "by a checksum at the end of the frame, where the file has one (pyarrow writes none)",
    "xz": "by a check at the end of each block (often the whole file)",
}

# Decompressed in pieces of this size: a codec that meets damaged data drops the
# piece it was filling, so what came before the damage is kept but for this much.
DECOMPRESSED_PIECE = 1 << 16


class DamagedStream(Exception):
    """A compressed input whose data is cut short or corrupt (its codec's error).
    ``cut_short``: the data ends early, and what came before is intact; corrupt
    data a codec finds only where it checks it (gzip at a member's end, by its
    CRC), so what it gave before may be damaged already."""

    def __init__(self, message: str, cut_short: bool):
        super().__init__(message)
        self.cut_short = cut_short


def compression_of(path: Path | RemotePath) -> str | None:
    """The codec a file is compressed with, by its suffix (None: not compressed)."""
    return COMPRESSIONS.get(path.suffix.lower())


def format_suffix(path: Path | RemotePath) -> str:
    """The suffix that names a file's format, lower-cased: the one before the
    codec's for a compressed file (``.jsonl`` for ``x.JSONL.gz``)."""
    name = PurePosixPath(path.name)
    return (name.with_suffix("") if compression_of(path) else name).suffix.lower()


class _Decompressed(io.RawIOBase):
    """The decompressed bytes of a compressed file (or the bytes of a remote
    one, ``codec`` None). Any error of the codec, or of reading the file under
    it, is a DamagedStream, so that a reader tells a damaged file from its own
    failures."""

    def __init__(self, path: Path | RemotePath, codec: str | None):
        self._under = None
        if isinstance(path, RemotePath):
            self._under = open_stream(path)
            self._stream = (self._under if codec is None else lzma.open(self._under, "rb") if codec == "xz"
                            else pa.CompressedInputStream(self._under, codec))
        else:
            self._stream = lzma.open(path, "rb") if codec == "xz" else pa.input_stream(str(path), compression=codec)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        try:
            return self._stream.readinto(buffer)
        except (OSError, EOFError, lzma.LZMAError) as e:
            # pyarrow's codecs say "Truncated compressed stream", lzma raises EOFError
            cut_short = isinstance(e, EOFError) or "Truncated" in str(e)
            raise DamagedStream(f"{type(e).__name__}: {e}", cut_short) from None

    def close(self) -> None:
        if not self.closed:
            self._stream.close()
            if self._under is not None and not self._under.closed:
                self._under.close()
        super().close()


def open_input(path: Path | RemotePath) -> BinaryIO:
    """A file's bytes, decompressed where its suffix names a codec."""
    codec = compression_of(path)
    if codec is None and not isinstance(path, RemotePath):
        return open(path, "rb")
    return io.BufferedReader(_Decompressed(path, codec), DECOMPRESSED_PIECE)


class _Rewound(io.RawIOBase):
    """The bytes ``head`` that were read from ``rest`` already, then the rest
    of it: the whole stream again, without opening the file a second time
    (another request for a file in an object store)."""

    def __init__(self, head: bytes, rest: BinaryIO):
        self._head, self._rest = memoryview(head), rest

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if self._head:
            n = min(len(buffer), len(self._head))
            buffer[:n] = self._head[:n]
            self._head = self._head[n:]
            return n
        return self._rest.readinto(buffer)


def rewound(head: bytes, rest: BinaryIO) -> BinaryIO:
    """A stream of ``head`` then what is left of ``rest``, from which ``head``
    was read: reads as the file opened again would. A local plain file is
    sought back to its start instead."""
    if rest.seekable():
        rest.seek(0)
        return rest
    return io.BufferedReader(_Rewound(head, rest), DECOMPRESSED_PIECE)


T = TypeVar("T")


def until_damaged(items: Iterable[T], path: Path | RemotePath, skip: Callable[[str], T], unit: str = "item"
                  ) -> Iterator[T]:
    """``items``, read from the file at ``path``, as they come; where its
    compressed data turns out damaged (or a remote file's reading fails), one
    last ``skip(why)`` for the rest of the file, which is not read (what came
    before the damage stays; where the data is corrupt rather than cut short,
    ``why`` says that it may be damaged too)."""
    read = 0
    try:
        for item in items:
            read += 1
            yield item
    except DamagedStream as e:
        codec = compression_of(path)
        what = f"its {codec} data is damaged or cut short" if codec else "reading it failed"
        doubt = ("" if e.cut_short or not codec else f", and the {unit}(s) read before may be damaged too ({codec} "
                 f"finds corrupt data only where it checks it, {CHECKED_AT[codec]})")
        yield skip(f"{what} after {read} {unit}(s); the rest of the file was not read{doubt}: {e}")
