"""Typed, validated stage configuration.

Every stage reads exactly one section of ``params.yaml`` (the section named like
the stage) and parses it into a pydantic model that forbids unknown keys. Errors
are raised before any work starts and name the dotted key, e.g.::

    ConfigError: params.yaml is invalid:
      pack.seq_len: Input should be greater than or equal to 8 (got 0)

Schemas live next to the code they configure (``pipeline/data/ingest.py`` owns
``IngestConfig``); ``SCHEMAS`` below maps each stage name to its schema so that
one loader, and one test, can reach all of them.
"""

from __future__ import annotations

import difflib
import importlib
import types
import typing
from collections import abc
from pathlib import Path
from typing import Annotated, Any, Literal, Mapping, TypeVar, Union

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from pipeline.errors import StageError

DEFAULT_PARAMS = Path("params.yaml")

# stage name -> "module:Class". Lazy, so that loading the ingest config does not
# import torch.
SCHEMAS: dict[str, str] = {
    "ingest": "pipeline.data.ingest:IngestConfig",
    "clean": "pipeline.data.clean:CleanConfig",
    "tokenizer": "pipeline.data.tokenizer:TokenizerConfig",
    "pack": "pipeline.data.pack:PackConfig",
    "pretrain": "pipeline.training.pretrain:PretrainConfig",
    "sft": "pipeline.training.sft:SFTConfig",
    "evaluate": "pipeline.evaluate:EvaluateConfig",
    "export": "pipeline.export:ExportConfig",
}


class ConfigError(StageError, ValueError):
    """A params file or section failed validation. The message names dotted keys."""


BOOL_NOT_NUMBER = "bool_not_number"


class SecretValueError(ValueError):
    """A validator's error about a value that holds a secret (a URL with
    credentials): its message is shown without the value."""


class ParamsModel(BaseModel):
    """Base for every model read from params.yaml, a stage's schema or a part of
    one: unknown keys are errors, the model is immutable once built, a float is
    finite (``.inf`` and ``.nan`` are errors), and a boolean is not a number.

    pydantic reads True as 1 for int and float fields, and YAML reads ``yes``,
    ``no``, ``on``, ``off``, ``true`` and ``false`` as booleans, so ``lr: yes``
    would train at a learning rate of 1.0. A field whose type admits a boolean
    (``bool``, ``bool | None``) takes one as before."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        field = cls.model_fields.get(info.field_name or "")
        where = _bool_as_number(field.annotation, value) if field is not None else None
        if where is not None:
            loc, flag = where  # loc: the key or index inside a dict or list field, () for the field itself
            raise PydanticCustomError(
                BOOL_NOT_NUMBER, f"a number is expected, not the boolean {flag} (YAML reads "
                "yes/no/on/off/true/false as booleans)", {"inner_loc": loc})
        return value


def _bool_as_number(annotation: Any, value: Any) -> tuple[tuple[Any, ...], bool] | None:
    """Where in ``value`` (a path of keys and indices, and the boolean found) a
    boolean stands for a number of ``annotation``; None where there is none. Looks
    into lists, tuples and dicts, not into nested models (they check their own)."""
    if isinstance(value, bool):
        return ((), value) if _numeric(annotation) and not _admits_bool(annotation) else None
    for m in _members(annotation):
        origin, args = typing.get_origin(m), typing.get_args(m)
        if isinstance(value, dict) and origin in (dict, abc.Mapping) and len(args) == 2:
            found = [(k, _bool_as_number(args[0], k) or _bool_as_number(args[1], v)) for k, v in value.items()]
        elif isinstance(value, (list, tuple)) and origin in (list, tuple, abc.Sequence) and args:
            # list[X], tuple[X, ...]; tuple[X, Y] gives each position its own type
            fixed = origin is tuple and args[-1] is not Ellipsis
            found = [(i, _bool_as_number(args[i] if fixed and i < len(args) else args[0], v))
                     for i, v in enumerate(value)]
        else:
            continue
        return next((((at, *f[0]), f[1]) for at, f in found if f is not None), None)
    return None


def _members(annotation: Any) -> list[Any]:
    """The alternatives of a type, Annotated and unions (``X | Y``, Optional) unwrapped."""
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return _members(typing.get_args(annotation)[0])
    if origin in (Union, types.UnionType):
        return [m for arg in typing.get_args(annotation) for m in _members(arg)]
    return [annotation]


def _numeric(annotation: Any) -> bool:
    for m in _members(annotation):
        if typing.get_origin(m) is Literal:
            if any(isinstance(v, (int, float)) and not isinstance(v, bool) for v in typing.get_args(m)):
                return True
        elif isinstance(m, type) and issubclass(m, (int, float)) and not issubclass(m, bool):
            return True
    return False


def _admits_bool(annotation: Any) -> bool:
    for m in _members(annotation):
        if m is Any or m is object or m is bool:
            return True
        if typing.get_origin(m) is Literal and any(isinstance(v, bool) for v in typing.get_args(m)):
            return True
    return False


class StageConfig(ParamsModel):
    """Base for every stage schema (see :class:`ParamsModel`); defaults are validated too."""

    model_config = ConfigDict(validate_default=True)


C = TypeVar("C", bound=BaseModel)


def schema_for(stage: str) -> type[StageConfig]:
    if stage not in SCHEMAS:
        raise ConfigError(f"unknown stage {stage!r}; known stages: {', '.join(SCHEMAS)}")
    module, cls = SCHEMAS[stage].split(":")
    return getattr(importlib.import_module(module), cls)


def _keys_at(schema: Any, loc: tuple[Any, ...]) -> set[str]:
    """The keys of the model(s) that ``loc`` (a validation error's path, less
    its last part) leads to in ``schema``: through nested models, list items and
    dict values; none where the path leads nowhere known."""
    here = [schema]
    for part in loc:
        there = []
        for t in (m for h in here for m in _members(h)):
            origin, args = typing.get_origin(t), typing.get_args(t)
            if isinstance(t, type) and issubclass(t, BaseModel):
                if part in t.model_fields:
                    there.append(t.model_fields[part].annotation)
                elif part == t.__name__:  # a union's member, named in the path
                    there.append(t)
            elif origin in (list, tuple, abc.Sequence) and args and isinstance(part, int):
                there.append(args[0])
            elif origin in (dict, abc.Mapping) and len(args) == 2:
                there.append(args[1])
        here = there
    return {name for h in here for m in _members(h) if isinstance(m, type) and issubclass(m, BaseModel)
            for name in m.model_fields}


def did_you_mean(word: Any, known: Any) -> str:
    """ "did you mean 'x'?" for the one of ``known`` closest to a misspelt
    ``word``, or "" where none is close."""
    close = difflib.get_close_matches(str(word), sorted(map(str, known)), n=1, cutoff=0.6)
    return f"did you mean {close[0]!r}?" if close else ""


def format_validation_error(err: ValidationError, prefix: str, schema: Any = None) -> str:
    lines = []
    for e in err.errors():
        key = ".".join([prefix, *(str(p) for p in e["loc"])]) if e["loc"] else prefix
        msg = e["msg"].removeprefix("Value error, ")  # pydantic's prefix for a validator's own message
        if e["type"] == BOOL_NOT_NUMBER:  # the message shows the boolean; the key may lie inside a dict or list
            key = ".".join([key, *(str(p) for p in e["ctx"]["inner_loc"])])
        elif e["type"] == "extra_forbidden":
            hint = did_you_mean(e["loc"][-1], _keys_at(schema, e["loc"][:-1])) if schema and e["loc"] else ""
            msg = f"unknown key; {hint} (see README 'Params reference')" if hint else \
                "unknown key (check the spelling; see README 'Params reference')"
        elif ("input" in e and e["type"] != "missing" and e["loc"] and not isinstance(e["input"], dict)
              and not isinstance(e.get("ctx", {}).get("error"), SecretValueError)):
            shown = repr(e["input"])
            msg += f" (got {shown[:80]}{'…' if len(shown) > 80 else ''})"
        lines.append(f"  {key}: {msg}")
    return "\n".join(lines)


def parse_section(schema: type[C], data: Any, prefix: str, source: str = "params.yaml") -> C:
    """Validate ``data`` against ``schema``; raise ConfigError naming dotted keys."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{source} is invalid:\n  {prefix}: expected a mapping, got {type(data).__name__}"
        )
    try:
        return schema.model_validate(data)
    except ValidationError as err:
        raise ConfigError(f"{source} is invalid:\n{format_validation_error(err, prefix, schema)}") from None


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key given twice in one mapping is an
    error: PyYAML would keep the second silently (so a key added to a section
    that already sets it further down would do nothing), and DVC, which reads
    params.yaml too, refuses such a file."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}  # key -> the line it was first given on
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *anchor`: the keys it brings in may be overridden, as YAML means
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: construct_mapping says so
                continue
            if first is not None:
                lines = f"lines {first} and {line}" if first != line else f"line {line}"
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice in one mapping ({lines}); keep one", key_node.start_mark)
            seen[key] = line
        return super().construct_mapping(node, deep)


def load_yaml(path: str | Path) -> Any:
    """The parsed contents of the YAML file ``path`` (None for an empty file).
    Raises ConfigError for a missing or unreadable file (a directory, text that
    is not UTF-8) or invalid YAML, naming the file and, for invalid YAML, the
    line and column."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path} is not UTF-8 text: invalid byte at position {err.start}") from None
    except OSError as err:  # a directory, no permission
        raise ConfigError(f"{path}: cannot read: {err.strerror}") from None
    try:
        return yaml.load(text, Loader=_StrictLoader)  # a SafeLoader
    except yaml.YAMLError as err:
        where = getattr(err, "problem_mark", None)
        at = f" (line {where.line + 1}, column {where.column + 1})" if where is not None else ""
        problem = getattr(err, "problem", None) or str(err)
        raise ConfigError(f"{path} is not valid YAML{at}: {problem}") from None
    except RecursionError:  # PyYAML builds nested lists and mappings by recursion
        raise ConfigError(f"{path}: its lists or mappings are nested too deeply to read") from None


def read_params(path: str | Path = DEFAULT_PARAMS) -> dict[str, Any]:
    """The whole params file, checked to be a mapping of known stage sections."""
    path = Path(path)
    if not path.exists():
        where = "" if path.is_absolute() else (f" in {Path.cwd()}; run the stage from the project's folder, where "
                                               "params.yaml and dvc.yaml are")
        raise ConfigError(f"params file not found: {path}{where}")
    data = load_yaml(path)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of stage sections")
    unknown = sorted(set(data) - set(SCHEMAS), key=str)  # YAML keys may be numbers or null too
    if unknown:
        stages, lines = ", ".join(SCHEMAS), []
        for k in unknown:
            hint = did_you_mean(k, SCHEMAS)
            lines.append(f"  {k}: unknown section; {hint} (stages are {stages})" if hint
                         else f"  {k}: unknown section; stages are {stages}")
        raise ConfigError(f"{path} is invalid:\n" + "\n".join(lines))
    return data


def load_params(stage: str, path: str | Path = DEFAULT_PARAMS) -> StageConfig:
    """Load and validate the section of ``path`` that belongs to ``stage``."""
    schema = schema_for(stage)
    data = read_params(path)
    return parse_section(schema, data.get(stage), stage, source=str(path))


def flatten(cfg: BaseModel | dict, prefix: str = "") -> dict[str, Any]:
    """Flatten a config to dotted keys, e.g. for MLflow params."""
    data = cfg.model_dump(mode="json") if isinstance(cfg, BaseModel) else cfg
    out: dict[str, Any] = {}

    def walk(node: Any, key: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{key}.{k}" if key else str(k))
        elif isinstance(node, list) and node and all(isinstance(x, dict) for x in node):
            for i, v in enumerate(node):
                walk(v, f"{key}.{i}")
        else:
            out[key] = node

    walk(data, prefix)
    return out


def changed_keys(old: BaseModel | dict, new: BaseModel | dict) -> list[str]:
    """Dotted keys (:func:`flatten`) whose values differ between two configs or
    records, added and removed keys included, e.g. ``["optimizer.lr"]``."""
    a, b = flatten(old), flatten(new)
    return sorted(k for k in a.keys() | b.keys() if a.get(k, _MISSING) != b.get(k, _MISSING))


_MISSING = object()


def metric_values(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The numeric leaves of a (nested) metrics dict under dotted names, NaN kept;
    strings, bools, lists and nulls are dropped, since a metric is a number."""
    flat = flatten(dict(metrics), prefix)
    return {k: float(v) for k, v in flat.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
