"""pipeline/data/compressed.py: a compressed input read as the file it was made
from, and a damaged one read up to its damage, which one skip reports. How
ingest reads compressed files of every format is tested in test_ingest.py."""

import gzip
import lzma
import random
from pathlib import Path

import pyarrow as pa
import pytest

from pipeline.data.compressed import (CHECKED_AT, DECOMPRESSED_PIECE, compression_of, format_suffix, open_input, rewound,
                                      until_damaged)
from tests.pipeline.data.test_ingest import compress

CODECS = ["gzip", "zstd", "bz2", "xz"]  # lz4's frames carry no checksum here: corrupt data reads as other data


def lines(n: int = 20_000) -> bytes:
    rng = random.Random(0)  # text that compresses as text does, not as one repeated line
    return "".join(f"line {i} " + " ".join(rng.choice(["a", "bb", "ccc", "dddd"]) for _ in range(16)) + "\n"
                   for i in range(n)).encode()


def read_lines(path: Path) -> list:
    """The lines of ``path`` up to its damage, then the skip: ("skip", why)."""
    def stream():
        with open_input(path) as f:
            yield from f
    return list(until_damaged(stream(), path, lambda why: ("skip", why), unit="line"))


@pytest.mark.parametrize("codec", CODECS)
def test_a_cut_short_file_keeps_its_intact_lines_and_says_where_it_stopped(tmp_path, codec):
    (tmp_path / "a.txt").write_bytes(data := lines())
    packed = compress(tmp_path / "a.txt", codec)
    packed.write_bytes(packed.read_bytes()[: packed.stat().st_size * 2 // 3])
    *got, (kind, why) = read_lines(packed)
    assert kind == "skip" and data.startswith(b"".join(got)) and 0 < len(got) < 20_000
    assert why.startswith(f"its {codec} data is damaged or cut short after {len(got)} line(s); the rest of the file "
                          "was not read: "), why
    assert "may be damaged" not in why  # what came before the cut is the file's own


@pytest.mark.parametrize("codec", CODECS)
def test_corrupt_data_says_that_what_came_before_it_may_be_damaged_too(tmp_path, codec):
    """Bytes overwritten in the middle: a codec finds corrupt data only where it
    checks it (gzip by the CRC at the end of a member, having given other text
    than the file's before it), so the skip does not vouch for the lines read
    before it."""
    (tmp_path / "a.txt").write_bytes(lines())
    packed = compress(tmp_path / "a.txt", codec)
    raw = bytearray(packed.read_bytes())
    middle = len(raw) // 2
    raw[middle:middle + 40] = bytes(b ^ 0xFF for b in raw[middle:middle + 40])
    packed.write_bytes(bytes(raw))
    *got, (kind, why) = read_lines(packed)
    assert kind == "skip"
    assert why.startswith(f"its {codec} data is damaged or cut short after {len(got)} line(s); the rest of the file "
                          f"was not read, and the line(s) read before may be damaged too ({codec} finds corrupt "
                          f"data only where it checks it, {CHECKED_AT[codec]}): "), why
    assert codec == "gzip" or "gzip" not in why  # each codec's own check, not gzip's


def test_a_plain_file_that_fails_is_not_said_to_be_damaged(tmp_path):
    """A read that fails under a file that is not compressed (a store's
    connection) says so, and nothing of damaged data."""
    from pipeline.data.compressed import DamagedStream

    def failing():
        yield "one"
        raise DamagedStream("OSError: connection reset", cut_short=False)

    *got, (_, why) = until_damaged(failing(), tmp_path / "a.txt", lambda why: ("skip", why))
    assert got == ["one"]
    assert why == "reading it failed after 1 item(s); the rest of the file was not read: OSError: connection reset"


@pytest.mark.parametrize("name, suffix", [("a.JSONL.gz", ".jsonl"), ("a.txt", ".txt"), ("a.tar.xz", ".tar"),
                                          ("a.json.ZST", ".json"), ("a.gz", ""), ("a.csv.lz4", ".csv")])
def test_the_format_is_the_suffix_before_the_codec_s(name, suffix):
    assert format_suffix(Path(name)) == suffix


@pytest.mark.parametrize("name", ["a.txt", "a.txt.gz"])
def test_rewound_reads_the_whole_stream_again(tmp_path, name):
    data = lines(3000)
    (tmp_path / "a.txt").write_bytes(data)
    compress(tmp_path / "a.txt", "gzip")
    with open_input(tmp_path / name) as f:
        head = f.read(8192)
        assert rewound(head, f).read() == data


def test_zstd_is_read_under_either_suffix():
    assert compression_of(Path("a.jsonl.zst")) == compression_of(Path("a.jsonl.zstd")) == "zstd"
    assert format_suffix(Path("a.jsonl.zstd")) == ".jsonl"


def test_rewound_gives_a_head_larger_than_one_read(tmp_path):
    """A head of more than DECOMPRESSED_PIECE bytes goes out a read's worth at a time."""
    data = lines(20_000)
    (tmp_path / "a.txt").write_bytes(data)
    with open_input(compress(tmp_path / "a.txt", "gzip")) as f:
        head = f.read(DECOMPRESSED_PIECE + 100)
        again = rewound(head, f)
        assert again.read(10) == data[:10] and again.read() == data[10:]


@pytest.mark.parametrize("codec", ["gzip", "xz", None])
def test_closing_a_remote_file_closes_its_stream(monkeypatch, codec):
    """The store's stream under a codec is closed with it (lzma does not close
    a stream it was given)."""
    from pipeline.data import compressed
    from pipeline.data.remote import RemotePath

    data = b"some text\n"
    packed = {"gzip": lambda: gzip.compress(data), "xz": lambda: lzma.compress(data), None: lambda: data}[codec]()
    streams = []
    monkeypatch.setattr(compressed, "open_stream", lambda path: streams.append(pa.BufferReader(packed)) or streams[-1])
    suffix = {"gzip": ".gz", "xz": ".xz", None: ""}[codec]
    with open_input(RemotePath(f"s3://bucket/a.txt{suffix}")) as f:
        assert f.read() == data
    assert [s.closed for s in streams] == [True]
