import pytest

from bench import compressed


def fake_build(work, mb):
    folders = {}
    for kind in compressed.KINDS:
        d = folders[kind] = work / kind
        d.mkdir()
        (d / "part-00.jsonl").write_bytes(b"x" * {"plain": 400_000, "xz": 100_000}.get(kind, 200_000))
    return folders


WALLS = {"plain": 2.0, "gzip": 3.0, "zstd": 2.5, "xz": 8.0}


def fake_run(digest_of):
    def run(folder, work, workers):
        return {"wall_s": WALLS[folder.name], "docs": 2, "bytes": 20_000_000, "digest": digest_of(folder.name)}
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
    assert "the same documents from every kind" in out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()[2:]}
    # on disk MB, compression ratio, wall s, wall / plain, MB/s of text
    assert rows["plain"] == ["0.4", "1.00", "2.00", "1.00", "10.0"]
    assert rows["xz"] == ["0.1", "4.00", "8.00", "4.00", "2.5"]
