import pyarrow.parquet as pq

from bench.data import rot, short_paragraphs, write_copies


def test_rot_copies_differ_and_keep_everything_but_letters():
    text = "Zebra, ábc 42!"
    assert rot(text, 0) == text
    assert rot(text, 1) == "Afcsb, ácd 42!"
    assert rot(text, 27) == rot(text, 1)
    assert len({rot(text, k) for k in range(26)}) == 26


def test_short_paragraphs_are_measured_in_utf8_bytes():
    ok, long_in_bytes = "x" * 100, "é" * 100  # 100 characters either way; the second is 200 bytes
    too_long = "é" * 151  # 302 bytes
    text = "\n\n".join(["x" * 99, ok, long_in_bytes, too_long, "y" * 300])
    assert short_paragraphs([text]) == [ok, long_in_bytes, "y" * 300]


def test_write_copies_counts_the_bytes_it_writes(tmp_path):
    # the corpus bytes are the numerator of every MB/s figure: they must be the text written
    path = tmp_path / "c.parquet"
    docs, nbytes = write_copies(path, ["a", "b"], ["héllo", "wörld!"], min_bytes=20)
    table = pq.read_table(path)
    texts = table.column("text").to_pylist()
    assert (docs, nbytes) == (4, 26) == (len(texts), sum(len(t.encode()) for t in texts))
    assert texts == ["héllo", "wörld!", "iémmp", "xösme!"]
    assert table.column("id").to_pylist() == ["a-0", "b-0", "a-1", "b-1"]
