"""pipeline/layout.py: where a model folder lies, by its path relative to the
working folder or absolute, through links."""

from pathlib import Path

from pipeline import layout


def test_a_folder_is_in_models_base_by_where_it_leads(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "base" / "m").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "models" / "base" / "link").symlink_to(tmp_path / "elsewhere")
    assert layout.in_base_models(Path("models/base/m")) and layout.in_base_models(tmp_path / "models/base/m")
    assert not layout.in_base_models(Path("elsewhere")) and not layout.in_base_models(Path("models/base/link"))
    assert layout.through_link(Path("models/base/link")) == f" (through a link: it is {tmp_path / 'elsewhere'})"
    assert layout.through_link(Path("elsewhere")) == ""
    assert layout.packed_rows_writer("data/sft/train") == "sft" and layout.packed_rows_writer("data/x") is None
    assert layout.packed_rows_writer("data/sft_extra") is None and layout.packed_rows_writer("data/packedx/a") is None
    assert layout.packed_rows_writer(tmp_path / "data" / "packed") == "pack"
