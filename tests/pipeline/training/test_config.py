"""pipeline/training/config.py: the nested training config and the run identity
that follows from its sections."""

import pytest
from pydantic import BaseModel

from pipeline.config import ConfigError, load_params, parse_section
from pipeline.training.config import Section, TrainConfig, identity_sections, run_identity
from pipeline.training.pretrain import PretrainConfig
from pipeline.training.sft import SFTConfig
from tests.conftest import ROOT

MODEL = {"d_model": 64}


def fingerprint(cfg: TrainConfig, global_batch: int = 16) -> str:
    return run_identity(cfg, MODEL, global_batch, "data", None)


def changed(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value * 0.5
    return None


@pytest.mark.parametrize("schema", [PretrainConfig, SFTConfig])
def test_every_key_of_an_identity_section_changes_the_fingerprint_and_no_other_key_does(schema):
    cfg = schema()
    base = fingerprint(cfg)
    checked = {True: 0, False: 0}
    for name in schema.model_fields:
        section = getattr(cfg, name)
        if not isinstance(section, Section):
            continue
        for key in type(section).model_fields:
            new = changed(getattr(section, key))
            if new is None:
                continue
            try:
                edited = cfg.model_copy(update={name: section.model_copy(update={key: new})})
            except ValueError:
                continue
            assert (fingerprint(edited) != base) == type(section).identity, f"{name}.{key}"
            checked[type(section).identity] += 1
    assert checked[True] >= 8 and checked[False] >= 10


def test_seed_model_and_global_batch_are_identity():
    cfg = PretrainConfig()
    assert fingerprint(cfg.model_copy(update={"seed": 1})) != fingerprint(cfg)
    assert fingerprint(cfg, global_batch=32) != fingerprint(cfg)
    assert run_identity(cfg, {"d_model": 128}, 16, "data", None) != fingerprint(cfg)
    assert run_identity(cfg, MODEL, 16, "other data", None) != fingerprint(cfg)
    assert run_identity(cfg, MODEL, 16, "data", "pretrain-run") != fingerprint(cfg)
    assert set(identity_sections(cfg)) == {"seed", "model", "data", "optimizer", "schedule"}


def test_a_section_must_say_whether_it_is_identity():
    with pytest.raises(TypeError, match="identity"):
        class Undecided(Section):  # noqa: F841
            x: int = 1


def test_every_field_of_the_training_config_is_a_section_or_a_plain_value():
    for schema in (PretrainConfig, SFTConfig):
        for name, field in schema.model_fields.items():
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                assert issubclass(ann, Section), f"{schema.__name__}.{name} is a model but not a Section"


def test_shipped_params_parse_nested():
    pre, sft = load_params("pretrain", ROOT / "params.yaml"), load_params("sft", ROOT / "params.yaml")
    assert pre.optimizer.lr == 3e-3 and pre.schedule.max_steps == 300 and pre.model.preset == "mini"
    assert sft.data.sources[0].path == "builtin:stdlib-docstrings" and sft.launch.rdzv_id == "llm-pipeline-sft"


def test_flat_keys_of_the_old_layout_are_refused_with_their_dotted_name():
    with pytest.raises(ConfigError, match=r"pretrain\.lr: unknown key"):
        parse_section(PretrainConfig, {"lr": 1e-3}, "pretrain")
    with pytest.raises(ConfigError, match=r"sft\.optimizer\.lrr: unknown key"):
        parse_section(SFTConfig, {"optimizer": {"lrr": 1e-3}}, "sft")
