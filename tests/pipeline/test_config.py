import re
import types
import typing
from collections import abc
from typing import Any, Literal

import pytest
from pydantic import BaseModel, Field

from pipeline.config import (
    SCHEMAS,
    ConfigError,
    ParamsModel,
    StageConfig,
    changed_keys,
    flatten,
    load_params,
    load_yaml,
    metric_values,
    parse_section,
    read_params,
    schema_for,
)
from pipeline.data.ingest import IngestConfig


def write(tmp_path, text):
    p = tmp_path / "params.yaml"
    p.write_text(text)
    return p


def test_unknown_key_names_dotted_path(tmp_path):
    p = write(tmp_path, "ingest:\n  max_bytez: 5\n")
    with pytest.raises(ConfigError, match=r"ingest\.max_bytez: unknown key"):
        load_params("ingest", p)


def test_a_misspelt_key_or_section_is_answered_with_the_one_meant(tmp_path):
    p = write(tmp_path, "ingest:\n  max_byte: 5\n  sources:\n    - {path: a, fromat: text}\n  zzz: 1\n")
    with pytest.raises(ConfigError) as e:
        load_params("ingest", p)
    assert str(e.value).splitlines()[1:] == [
        "  ingest.sources.0.fromat: unknown key; did you mean 'format'? (see README 'Params reference')",
        "  ingest.max_byte: unknown key; did you mean 'max_bytes'? (see README 'Params reference')",
        "  ingest.zzz: unknown key (check the spelling; see README 'Params reference')"]
    with pytest.raises(ConfigError) as e:
        read_params(write(tmp_path, "ingets: {}\nzzz: {}\n"))
    stages = ", ".join(SCHEMAS)
    assert str(e.value).splitlines()[1:] == [f"  ingets: unknown section; did you mean 'ingest'? (stages are {stages})",
                                             f"  zzz: unknown section; stages are {stages}"]


def _models_in(model: type[BaseModel], path: tuple = ()):
    """(path, model) for ``model`` and every model its fields hold, as a params
    path: a list's item is 0, a dict's value "k"."""
    yield path, model
    for name, field in model.model_fields.items():
        todo = [(field.annotation, (name,))]
        while todo:
            t, at = todo.pop()
            origin, args = typing.get_origin(t), typing.get_args(t)
            if origin is typing.Annotated or origin in (typing.Union, types.UnionType):
                todo += [(a, at) for a in (args[:1] if origin is typing.Annotated else args)]
            elif isinstance(t, type) and issubclass(t, BaseModel):
                yield from _models_in(t, path + at)
            elif origin in (list, tuple, abc.Sequence) and args:
                todo.append((args[0], at + (0,)))
            elif origin in (dict, abc.Mapping) and len(args) == 2:
                todo.append((args[1], at + ("k",)))


@pytest.mark.parametrize("stage", list(SCHEMAS))
def test_every_key_of_every_section_misspelt_is_answered_with_itself(stage):
    """Each key of each model a stage's schema holds (nested, in a list, in a
    dict), with its last letter doubled: the message names the key meant."""
    schema, tried = schema_for(stage), 0
    for path, model in _models_in(schema):
        for key in model.model_fields:
            data: Any = {key + key[-1]: 1}
            for part in reversed(path):
                data = [data] if isinstance(part, int) else {part: data}
            with pytest.raises(ConfigError) as e:
                parse_section(schema, data, stage)
            dotted = ".".join([stage, *map(str, path), key + key[-1]])
            assert f"  {dotted}: unknown key; did you mean {key!r}? " in str(e.value), str(e.value)
            tried += 1
    assert tried > 5


def test_nested_unknown_key_names_list_index(tmp_path):
    p = write(tmp_path, "ingest:\n  sources:\n    - path: a\n      fromat: text\n")
    with pytest.raises(ConfigError, match=r"ingest\.sources\.0\.fromat: unknown key"):
        load_params("ingest", p)


def test_wrong_type_and_range_are_reported_together(tmp_path):
    p = write(tmp_path, "ingest:\n  max_doc_bytes: lots\n  quarantine_per_reason: -1\n")
    with pytest.raises(ConfigError) as e:
        load_params("ingest", p)
    msg = str(e.value)
    assert "ingest.max_doc_bytes" in msg and "'lots'" in msg
    assert "ingest.quarantine_per_reason" in msg and "greater than or equal to 0" in msg


def test_bad_enum_value(tmp_path):
    p = write(tmp_path, "ingest:\n  sources:\n    - path: a\n      split_by: sentence\n")
    with pytest.raises(ConfigError, match=r"ingest\.sources\.0\.split_by"):
        load_params("ingest", p)


def test_unknown_section_and_unknown_stage(tmp_path):
    p = write(tmp_path, "ingset: {}\n")
    with pytest.raises(ConfigError, match="ingset: unknown section"):
        read_params(p)
    with pytest.raises(ConfigError, match="unknown stage"):
        load_params("nope", write(tmp_path, "{}\n"))


def test_unknown_sections_that_yaml_reads_as_numbers_or_null_are_listed_too(tmp_path):
    """YAML reads `1:` and `null:` as an int and None: two such keys beside a
    misspelt section name were a TypeError from sorting them, not the list."""
    with pytest.raises(ConfigError) as e:
        read_params(write(tmp_path, "1: {}\nnull: {}\ningset: {}\n"))
    assert [line.split(":")[0].strip() for line in str(e.value).splitlines()[1:]] == ["1", "None", "ingset"]


@pytest.mark.parametrize("text", ["- ingest\n- pack\n", "ingest\n", "42\n"])
def test_a_top_level_that_is_not_a_mapping_is_refused(tmp_path, text):
    with pytest.raises(ConfigError, match=r"params\.yaml: the top level must be a mapping of stage sections$"):
        load_params("ingest", write(tmp_path, text))


def test_a_long_wrong_value_is_shown_cut_to_80_characters(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_params("ingest", write(tmp_path, f"ingest:\n  max_doc_bytes: {'x' * 200}\n"))
    assert str(e.value).splitlines()[1] == ("  ingest.max_doc_bytes: Input should be a valid integer, unable to "
                                            f"parse string as an integer (got '{'x' * 79}…)")


def test_section_must_be_mapping_and_file_must_exist(tmp_path):
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_params("ingest", write(tmp_path, "ingest: [1, 2]\n"))
    with pytest.raises(ConfigError, match="not found"):
        load_params("ingest", tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_params("ingest", write(tmp_path, "ingest: {a: [\n"))


def test_a_stage_run_from_another_folder_is_told_where_it_looked_for_params(tmp_path, monkeypatch):
    """A stage run from a subfolder said only "params file not found: params.yaml"."""
    (tmp_path / "data").mkdir()
    monkeypatch.chdir(tmp_path / "data")
    with pytest.raises(ConfigError) as e:
        load_params("ingest")
    assert str(e.value) == (f"params file not found: params.yaml in {tmp_path / 'data'}; run the stage from the "
                            "project's folder, where params.yaml and dvc.yaml are")
    with pytest.raises(ConfigError, match=r"^params file not found: /\S*missing\.yaml$"):
        read_params(tmp_path / "missing.yaml")


def test_load_yaml_reads_a_file_and_names_where_it_is_invalid(tmp_path):
    assert load_yaml(write(tmp_path, "a: [1, 2]\n")) == {"a": [1, 2]}
    assert load_yaml(write(tmp_path, "")) is None
    with pytest.raises(ConfigError, match=r"params\.yaml is not valid YAML \(line 2, column 3\): mapping values"):
        load_yaml(write(tmp_path, "a: 1\n b: 2\n"))
    with pytest.raises(ConfigError, match="missing.yaml: file not found"):
        load_yaml(tmp_path / "missing.yaml")


def test_a_params_path_that_is_a_directory_or_not_utf8_is_a_one_line_error(tmp_path):
    """Both raised a bare IsADirectoryError / UnicodeDecodeError traceback."""
    (tmp_path / "params_dir").mkdir()
    with pytest.raises(ConfigError, match=r"^\S*params_dir: cannot read: Is a directory$"):
        load_params("sft", tmp_path / "params_dir")
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes("sft:\n  seed: 1  # caf\u00e9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"^\S*latin1\.yaml is not UTF-8 text: invalid byte at position 21$"):
        load_params("sft", latin1)


def test_yaml_nested_too_deeply_is_a_one_line_error(tmp_path):
    """PyYAML's composer recurses: thousands of nested brackets were a RecursionError traceback."""
    with pytest.raises(ConfigError, match=r"^\S*params\.yaml: its lists or mappings are nested too deeply to read$"):
        load_params("ingest", write(tmp_path, "ingest: " + "[" * 5000 + "]" * 5000 + "\n"))


def test_a_key_given_twice_is_an_error_not_the_last_one_silently(tmp_path):
    """YAML parsers keep the second of two equal keys; a `source:` added at the
    top of a section that sets it again further down would do nothing."""
    twice = "tokenizer:\n  source: models/base/qwen\n  vocab_size: 512\n  source: train\n"
    with pytest.raises(ConfigError, match=r"^.*params\.yaml is not valid YAML \(line 4, column 3\): key 'source' is "
                                          r"given twice in one mapping \(lines 2 and 4\); keep one$"):
        load_params("tokenizer", write(tmp_path, twice))
    with pytest.raises(ConfigError, match=r"key 'lr' is given twice in one mapping \(line 1\)"):
        load_yaml(write(tmp_path, "opt: {lr: 1, lr: 2}\n"))
    with pytest.raises(ConfigError, match=r"key 'pack' is given twice"):
        read_params(write(tmp_path, "pack: {}\ningest: {}\npack: {seq_len: 64}\n"))
    # the same key in different mappings, and keys a merge brings in and the mapping overrides, are fine
    assert load_yaml(write(tmp_path, "a: {x: 1}\nb: {x: 2}\n")) == {"a": {"x": 1}, "b": {"x": 2}}
    assert load_yaml(write(tmp_path, "base: &b {x: 1, y: 2}\nd:\n  <<: *b\n  y: 3\n"))["d"] == {"x": 1, "y": 3}


def test_empty_section_gives_defaults(tmp_path):
    cfg = load_params("ingest", write(tmp_path, "ingest:\n"))
    assert cfg == IngestConfig()
    assert cfg.sources[0].path == "{stdlib}/**/*.py"
    assert load_params("ingest", write(tmp_path, "# nothing set yet\n")) == IngestConfig()  # an empty file


def test_a_model_level_error_names_its_section_without_repeating_the_section(tmp_path):
    """A section's own check (here the schedule's) has the whole section as its
    input: the message names the key and does not append the section's dict."""
    p = write(tmp_path, "pretrain:\n  schedule: {max_steps: 10, warmup_steps: 10}\n")
    with pytest.raises(ConfigError) as e:
        load_params("pretrain", p)
    assert str(e.value).splitlines()[1:] == [
        "  pretrain.schedule: warmup_steps (10) must be below max_steps (10)"]


def test_configs_are_frozen():
    cfg = parse_section(IngestConfig, {"max_bytes": 10}, "ingest")
    with pytest.raises(Exception):
        cfg.max_bytes = 5


def test_flatten_uses_dotted_names():
    cfg = parse_section(IngestConfig, {"max_bytes": 10, "sources": [{"path": "x"}]}, "ingest")
    flat = flatten(cfg, "ingest")
    assert flat["ingest.max_bytes"] == 10
    assert flat["ingest.sources.0.path"] == "x"
    assert flat["ingest.sources.0.split_by"] == "file"
    # an empty list is a value (an empty list of sections must not vanish), as is a list of plain values
    assert flatten({"a": [], "b": [1, 2], "c": {}}) == {"a": [], "b": [1, 2]}


def test_changed_keys_count_a_key_added_or_removed_even_when_its_value_is_null():
    old, new = {"a": 1, "b": {"c": None}}, {"a": 1, "b": {"d": None}}
    assert changed_keys(old, new) == ["b.c", "b.d"]
    assert changed_keys(old, old) == []


def test_metric_values_are_the_numeric_leaves_under_dotted_names():
    flat = metric_values({"sft": {"bits_per_byte": 1.5, "ok": True, "note": "x", "n": None},
                                   "steps": 3, "bad": float("nan"), "sizes": [1, 2]}, "eval")
    assert flat.keys() == {"eval.sft.bits_per_byte", "eval.steps", "eval.bad"}
    assert flat["eval.sft.bits_per_byte"] == 1.5 and flat["eval.steps"] == 3.0 and flat["eval.bad"] != flat["eval.bad"]


BOOL_HINT = r"a number is expected, not the boolean {} \(YAML reads yes/no/on/off/true/false as booleans\)$"


@pytest.mark.parametrize("stage, yaml_value, key, flag", [
    ("pretrain", "optimizer: {lr: yes}", "pretrain.optimizer.lr", True),
    ("pretrain", "optimizer: {lr: on}", "pretrain.optimizer.lr", True),
    ("pretrain", "schedule: {max_steps: true}", "pretrain.schedule.max_steps", True),
    ("pretrain", "batch: {micro_batch_size: true}", "pretrain.batch.micro_batch_size", True),  # int | 'auto'
    ("pretrain", "batch: {micro_batch_size: no}", "pretrain.batch.micro_batch_size", False),  # not "at least 1"
    ("sft", "optimizer: {lr: off}", "sft.optimizer.lr", False),
    ("tokenizer", "sample_weights: {a: 1.0, b: no}", "tokenizer.sample_weights.b", False),  # inside a dict
    ("pack", "mixture: {a: {weight: yes}}", "pack.mixture.a.weight", True),  # float | None, in a nested model
    ("clean", "filters: {gopher_top_ngrams: {max_char_frac: {true: 0.2}}}",  # a dict key: dict[int, float]
     "clean.filters.gopher_top_ngrams.max_char_frac.True", True),
])
def test_a_boolean_is_not_a_number(tmp_path, stage, yaml_value, key, flag):
    """pydantic reads True as 1, so `lr: yes` would have trained at lr=1.0."""
    p = write(tmp_path, f"{stage}:\n  {yaml_value}\n")
    with pytest.raises(ConfigError) as e:
        load_params(stage, p)
    lines = str(e.value).splitlines()
    assert lines[0] == f"{p} is invalid:" and len(lines) == 2
    assert lines[1].startswith(f"  {key}: ")
    assert re.search(BOOL_HINT.format(flag), lines[1])


@pytest.mark.parametrize("yaml_value", [".inf", "-.inf", ".nan", ".NaN", "'inf'", "1.0e999"])
def test_a_float_is_finite(tmp_path, yaml_value):
    """A non-finite lr passed validation and failed only at the first step, after
    the previous run had been moved aside."""
    p = write(tmp_path, f"pretrain:\n  optimizer:\n    lr: {yaml_value}\n")
    with pytest.raises(ConfigError) as e:
        load_params("pretrain", p)
    lines = str(e.value).splitlines()
    assert len(lines) == 2 and lines[1].startswith("  pretrain.optimizer.lr: Input should be a finite number (got ")


@pytest.mark.parametrize("section, key", [("optimizer", "weight_decay"), ("optimizer", "eps"),
                                          ("logging", "spike_factor"), ("model", "rope_theta")])
def test_other_floats_are_finite_too(tmp_path, section, key):
    p = write(tmp_path, f"pretrain:\n  {section}:\n    {key}: .inf\n")
    with pytest.raises(ConfigError, match=rf"pretrain\.{section}\.{key}: Input should be a finite number"):
        load_params("pretrain", p)


def test_boolean_fields_still_take_yaml_booleans(tmp_path):
    p = write(tmp_path, "pretrain:\n  compute: {compile: yes}\n  checkpoint: {keep_best: on}\n"
                        "  model: {tie_embeddings: no}\n  logging: {track: false}\n  batch: {micro_batch_size: auto}\n"
                        "  optimizer: {lr: 1e-3}\n")
    cfg = load_params("pretrain", p)
    assert cfg.compute.compile is True and cfg.checkpoint.keep_best is True
    assert cfg.model.tie_embeddings is False and cfg.logging.track is False
    assert cfg.batch.micro_batch_size == "auto" and cfg.optimizer.lr == 1e-3  # PyYAML reads 1e-3 as a string
    assert load_params("ingest", write(tmp_path, "ingest: {include_hidden: yes}\n")).include_hidden is True
    assert load_params("clean", write(tmp_path, "clean:\n  filters: {too_short: {enabled: off}}\n")
                       ).filters.too_short.enabled is False


class _Shapes(ParamsModel):
    """Field shapes no stage schema has yet, for the boolean check's walk."""

    ratio: float | bool = 0.5  # admits a boolean: one is taken as it is
    loose: int | Any = 0  # admits anything, a boolean too
    size: Literal[1, 2] = 2  # pydantic reads True as 1 here too
    widths: list[int] = []
    pair: tuple[str, int] = ("a", 1)  # each position its own type


@pytest.mark.parametrize("data, key", [({"widths": [1, True]}, "x.widths.1"), ({"pair": ["yes", True]}, "x.pair.1"),
                                       ({"size": True}, "x.size")])
def test_a_boolean_inside_a_list_or_tuple_or_for_a_numeric_literal_is_not_a_number(data, key):
    with pytest.raises(ConfigError) as e:
        parse_section(_Shapes, data, "x")
    assert str(e.value).splitlines()[1] == f"  {key}: a number is expected, not the boolean True (YAML reads " \
        "yes/no/on/off/true/false as booleans)"


def test_a_tuple_position_typed_str_takes_no_number_check():
    with pytest.raises(ConfigError) as e:
        parse_section(_Shapes, {"pair": [True, 2]}, "x")
    assert str(e.value).splitlines()[1] == "  x.pair.0: Input should be a valid string (got True)"


def test_a_field_that_admits_a_boolean_takes_one():
    cfg = parse_section(_Shapes, {"ratio": True, "loose": True}, "x")
    assert cfg.ratio is True and cfg.loose is True


def test_a_stage_schema_checks_its_own_defaults():
    """A default outside its field's bounds is a programming error, caught at the first use."""

    class Broken(StageConfig):
        every: int = Field(0, ge=1)

    with pytest.raises(ConfigError, match=r"^params.yaml is invalid:\n  broken.every: Input should be greater"):
        parse_section(Broken, {}, "broken")
