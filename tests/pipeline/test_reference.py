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
