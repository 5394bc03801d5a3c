"""pipeline/reference.py: the README's params reference renders every default as
Markdown code and says what each switch switches."""

from pathlib import Path

from pipeline.data.filters import FILTERS
from pipeline.reference import reference

ROOT = Path(__file__).resolve().parents[2]


def rows() -> dict[str, tuple[str, str]]:
    out = {}
    for line in reference(ROOT / "params.yaml").splitlines():
        if line.startswith("| `") and not line.startswith("| `key"):
            key, default, meaning = (c.strip() for c in line.strip("|").split(" | ", 2))
            out[key.strip("`")] = (default, meaning)
    return out


def test_defaults_are_yaml_values_in_well_formed_code_spans():
    table = rows()
    assert all("None" not in d and "True" not in d and "False" not in d for d, _ in table.values())
    assert '"name": null' in table["ingest.sources"][0]
    chat = table["evaluate.samples.chat"][0]  # a default with backticks in it
    assert chat.startswith("`` ") and chat.endswith(" ``") and "`os.path.join`" in chat


def test_each_filter_switch_says_what_the_filter_does():
    table = rows()
    for name, f in FILTERS.items():
        assert f.doc in table[f"clean.filters.{name}.enabled"][1], name


# --------------------------------------------------------------------------- probe3-track: the CLI


def project(tmp_path, monkeypatch, readme: str):
    import shutil

    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    (tmp_path / "README.md").write_text(readme)
    monkeypatch.chdir(tmp_path)
    return tmp_path / "README.md"


def test_check_fails_in_one_line_when_the_readme_drifts_and_write_mends_it(tmp_path, monkeypatch, capsys):
    from pipeline.reference import BEGIN, END, main

    block = reference(ROOT / "params.yaml")
    readme = project(tmp_path, monkeypatch, f"# x\n\n{block}\n\nafter\n")
    assert main(["--check"]) == 0
    readme.write_text(readme.read_text().replace("| `pack.seq_len` | `256` |", "| `pack.seq_len` | `512` |"))
    assert main(["--check"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pack.seq_len" in err and "--write" in err
    assert main(["--write"]) == 0 and main(["--check"]) == 0
    assert readme.read_text() == f"# x\n\n{block}\n\nafter\n"
    readme.write_text(f"# x\n\n{BEGIN}\n{END}\n")  # a block emptied by hand is stale too
    assert main(["--check"]) == 1


def test_a_readme_without_the_markers_or_params_yaml_is_one_line_not_a_traceback(tmp_path, monkeypatch, capsys):
    from pipeline.reference import main

    readme = project(tmp_path, monkeypatch, "# no block here\n")
    for flag in ("--check", "--write"):
        assert main([flag]) == 2
        assert "params-reference:begin" in capsys.readouterr().err
    assert readme.read_text() == "# no block here\n"  # nothing written
    (tmp_path / "params.yaml").unlink()  # not the project root: the table would lose params.yaml's comments
    assert main(["--check"]) == 2 and "params.yaml" in capsys.readouterr().err


def test_an_end_marker_above_the_block_is_not_taken_for_its_end(tmp_path, monkeypatch):
    from pipeline.reference import BEGIN, END, main

    block = reference(ROOT / "params.yaml")
    readme = project(tmp_path, monkeypatch, f"a note on {END}\n\n{BEGIN}\nold\n{END}\n")
    assert main(["--write"]) == 0 and main(["--check"]) == 0
    assert readme.read_text() == f"a note on {END}\n\n{block}\n"
