import pytest

from bench import compressed


def fake_build(work, mb):
    folders = {}
    for kind in compressed.KINDS:
        d = folders[kind] = work / kind
        d.mkdir()
        (d / "part-00.jsonl").write_bytes(b"x" * 10)
    return folders


def fake_run(digest_of):
    def run(folder, work, workers):
        return {"wall_s": 1.0, "docs": 2, "bytes": 20, "digest": digest_of(folder.name)}
    return run


def test_the_bench_stops_when_a_kind_gives_other_documents(monkeypatch, capsys):
    monkeypatch.setattr(compressed, "build", fake_build)
    monkeypatch.setattr(compressed, "run", fake_run(lambda kind: "b" * 64 if kind == "xz" else "a" * 64))
    with pytest.raises(SystemExit, match="the kinds gave different documents"):
        compressed.main(["--rounds", "1"])
    assert "the same documents from every kind" not in capsys.readouterr().out


def test_the_same_documents_from_every_kind_make_the_table(monkeypatch, capsys):
    monkeypatch.setattr(compressed, "build", fake_build)
    monkeypatch.setattr(compressed, "run", fake_run(lambda kind: "a" * 64))
    compressed.main(["--rounds", "1"])
    out = capsys.readouterr().out
    assert "the same documents from every kind" in out and out.count("1.00") >= 4
