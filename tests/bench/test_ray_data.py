import pyarrow as pa

from bench.ray_data import row_groups


def test_row_groups_cut_at_the_document_or_byte_bound():
    table = pa.table({"text": ["a" * 3, "b" * 3, "c" * 3, None, "d" * 10, "e"]})
    # at most 2 documents, and a group ends at the document that brings it to 5 bytes
    assert row_groups(table, docs=2, text_bytes=5) == [(0, 2), (2, 4), (4, 5), (5, 6)]
    assert row_groups(table, docs=10, text_bytes=100) == [(0, 6)]
    assert row_groups(table.slice(0, 0)) == []
