"""pipeline/training/config.py: the nested training config and the run identity
that follows from its sections."""

import pytest
from pydantic import BaseModel

from pipeline.config import ConfigError, load_params, parse_section
from pipeline.training.config import (
    BatchSection,
    Section,
    TrainConfig,
    fingerprint_of,
    identity_sections,
    requested_rows_per_rank,
    run_identity,
)
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
            counts = type(section).identity and key in section.identity_values()
            assert (fingerprint(edited) != base) == counts, f"{name}.{key}"
            checked[type(section).identity] += 1
    assert checked[True] >= 8 and checked[False] >= 10


@pytest.mark.parametrize("schema", [PretrainConfig, SFTConfig])
def test_only_the_run_length_and_inert_schedule_keys_are_left_out_of_the_identity(schema):
    cfg = schema()
    assert set(type(cfg.schedule).model_fields) - set(cfg.schedule.identity_values()) == {
        "max_steps", "decay_fraction", "decay_steps", "decay_shape"}  # cosine ignores the wsd keys
    wsd = cfg.model_copy(update={"schedule": cfg.schedule.model_copy(update={"kind": "wsd"})})
    assert set(wsd.schedule.identity_values()) == {"kind", "warmup_steps", "min_lr", "decay_fraction", "decay_steps",
                                                   "decay_shape"}
    steps = wsd.model_copy(update={"schedule": wsd.schedule.model_copy(update={"decay_steps": 5})})
    assert "decay_fraction" not in steps.schedule.identity_values()  # decay_steps overrides it
    assert len({fingerprint(c) for c in (cfg, wsd, steps)}) == 3


def test_sft_data_keys_that_act_only_through_the_shards_are_left_to_the_data_identity():
    """The quarantine's sample size never changes what is trained; shard_rows and template_date change it only
    by changing the shards, whose hashes are the data identity."""
    cfg = SFTConfig()
    assert set(type(cfg.data).model_fields) - set(cfg.data.identity_values()) == {
        "quarantine_per_reason", "shard_rows", "template_date"}
    reporting = cfg.model_copy(update={"data": cfg.data.model_copy(update={"quarantine_per_reason": 5})})
    assert fingerprint(reporting) == fingerprint(cfg)
    seq = cfg.model_copy(update={"data": cfg.data.model_copy(update={"seq_len": 128})})
    assert fingerprint(seq) != fingerprint(cfg)


def test_raising_max_steps_keeps_the_identity_and_other_schedule_keys_change_it():
    cfg = PretrainConfig()
    longer = cfg.model_copy(update={"schedule": cfg.schedule.model_copy(update={"max_steps": 6000})})
    assert fingerprint(longer) == fingerprint(cfg)
    for key, value in {"warmup_steps": 10, "min_lr": 1e-5, "kind": "wsd"}.items():
        edited = cfg.model_copy(update={"schedule": cfg.schedule.model_copy(update={key: value})})
        assert fingerprint(edited) != fingerprint(cfg), key


def test_identity_record_names_what_changed():
    from pipeline.training.checkpoint import changed_keys
    from pipeline.training.config import identity_record

    cfg = PretrainConfig()
    a = identity_record(cfg, MODEL, 16, "data", None)
    b = identity_record(cfg.model_copy(update={"optimizer": cfg.optimizer.model_copy(update={"lr": 1e-3})}),
                        {"d_model": 128}, 16, "other data", "checkpoint:abc")
    assert changed_keys(a, b) == ["dataset", "init", "model.d_model", "optimizer.lr"]
    assert changed_keys(a, a) == []


def schedule(**kw):
    return parse_section(PretrainConfig, {"schedule": kw}, "pretrain").schedule


@pytest.mark.parametrize("kw, message", [
    ({"kind": "wsd", "max_steps": 100, "warmup_steps": 10, "decay_steps": 91},
     "wsd: warmup_steps (10) + decay (decay_steps 91) must fit in max_steps (100)"),
    ({"kind": "wsd", "max_steps": 100, "warmup_steps": 10, "decay_fraction": 0.95},
     "wsd: warmup_steps (10) + decay (decay_fraction 0.95 of max_steps = 95 steps) must fit in max_steps (100)"),
    ({"kind": "wsd", "decay_fraction": 0}, "pretrain.schedule.decay_fraction"),
    ({"kind": "wsd", "decay_fraction": 1.5}, "pretrain.schedule.decay_fraction"),
    ({"kind": "wsd", "decay_steps": 0}, "pretrain.schedule.decay_steps"),
    ({"kind": "linear"}, "pretrain.schedule.kind"),
    ({"kind": "wsd", "decay_shape": "cosine"}, "pretrain.schedule.decay_shape"),
    ({"max_steps": -1}, "pretrain.schedule.max_steps"),
    ({"max_steps": 10, "warmup_steps": 10}, "warmup_steps (10) must be below max_steps (10)"),
])
def test_schedule_errors_are_one_line_naming_the_key(kw, message):
    with pytest.raises(ConfigError) as err:
        schedule(**kw)
    lines = str(err.value).splitlines()
    assert len(lines) == 2 and message in lines[1], str(err.value)  # the file, then one line for the key


def test_valid_schedules():
    assert schedule(max_steps=0, warmup_steps=50).max_steps == 0  # a pass-through run: no step, no warmup rule
    s = schedule(kind="wsd", max_steps=100, warmup_steps=10, decay_steps=90)
    assert (s.decay_length(), s.decay_start()) == (90, 10)
    s = schedule(kind="wsd", max_steps=30, warmup_steps=2, decay_fraction=0.1)
    assert (s.decay_length(), s.decay_start()) == (3, 27)  # 0.1 x 30 = 3.0000000000000004 rounds to 3
    assert schedule(kind="wsd", max_steps=0).decay_length() == 1


@pytest.mark.parametrize("schema, stage", [(PretrainConfig, "pretrain"), (SFTConfig, "sft")])
def test_a_seed_numpy_cannot_take_is_refused_naming_the_key(schema, stage):
    """The trainer seeds NumPy, which takes 0 to 2^32 - 1: outside that every rank
    failed with a traceback after the launch, not in one line before it."""
    for ok in (0, 2**32 - 1):
        assert parse_section(schema, {"seed": ok}, stage).seed == ok
    for bad, message in ((-1, "greater than or equal to 0"), (2**32, "less than or equal to 4294967295")):
        with pytest.raises(ConfigError, match=rf"^params.yaml is invalid:\n  {stage}.seed: Input should be {message}"):
            parse_section(schema, {"seed": bad}, stage)


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


@pytest.mark.parametrize("value", [0, -3, "big"])
def test_a_bad_micro_batch_size_is_one_message_naming_the_key(value):
    """It was one line per member of the union, each under a made-up key
    (pretrain.batch.micro_batch_size.constrained-int, ...literal['auto'])."""
    with pytest.raises(ConfigError) as err:
        parse_section(PretrainConfig, {"batch": {"micro_batch_size": value}}, "pretrain")
    assert str(err.value).splitlines()[1:] == [
        f"  pretrain.batch.micro_batch_size: must be auto or a whole number of at least 1 (got {value!r})"]


# (section, key, values at the edge that are valid, values just past it that are not)
BOUNDS = [
    ("optimizer", "lr", [1e-9], [0.0]),
    ("optimizer", "weight_decay", [0.0], [-0.01]),
    ("optimizer", "beta1", [0.0, 0.999], [1.0, -0.01]),
    ("optimizer", "beta2", [0.0, 0.999], [1.0, -0.01]),
    ("optimizer", "eps", [1e-12], [0.0]),
    ("optimizer", "grad_clip", [0.0], [-0.01]),  # 0 = off
    ("batch", "grad_accum_steps", [1], [0]),
    ("schedule", "warmup_steps", [0, 9], [-1]),  # below max_steps (10 here)
    ("schedule", "min_lr", [0.0, 1e-3], [-1e-9]),  # up to optimizer.lr (1e-3 here)
    ("schedule", "decay_fraction", [1.0], [0.0, 1.01]),
    ("schedule", "decay_steps", [1, 10], [0]),
    ("eval", "every", [1], [0]),
    ("eval", "rows", [1, None], [0]),
    ("checkpoint", "every", [1], [0]),
    ("checkpoint", "keep", [1], [0]),
    ("checkpoint", "keep_previous", [0, None], [-1]),
    ("logging", "every", [1], [0]),
    ("logging", "spike_factor", [1.01], [1.0]),
    ("logging", "peak_flops", [1.0, None], [0.0]),
]


@pytest.mark.parametrize("schema, stage", [(PretrainConfig, "pretrain"), (SFTConfig, "sft")])
@pytest.mark.parametrize("section, key, good, bad", BOUNDS)
def test_each_bound_holds_at_its_edge(schema, stage, section, key, good, bad):
    """Valid up to the documented edge, one line naming the key just past it."""
    base = {"optimizer": {"lr": 1e-3}, "schedule": {"max_steps": 10, "warmup_steps": 0, "min_lr": 0.0}}

    def params(value):
        return {**base, section: {**base.get(section, {}), key: value}}

    for value in good:
        assert getattr(getattr(parse_section(schema, params(value), stage), section), key) == value
    for value in bad:
        with pytest.raises(ConfigError) as err:
            parse_section(schema, params(value), stage)
        lines = str(err.value).splitlines()
        assert len(lines) == 2 and lines[1].startswith(f"  {stage}.{section}.{key}: "), (value, str(err.value))


def test_max_steps_zero_is_a_pass_through_for_pretrain_only():
    assert parse_section(PretrainConfig, {"schedule": {"max_steps": 0, "warmup_steps": 0}}, "pretrain"
                         ).schedule.max_steps == 0
    with pytest.raises(ConfigError, match=r"^params.yaml is invalid:\n  sft.schedule.max_steps: Input should be "
                                          r"greater than or equal to 1"):
        parse_section(SFTConfig, {"schedule": {"max_steps": 0, "warmup_steps": 0}}, "sft")


def test_requested_rows_per_rank_is_micro_batch_times_accumulation_with_auto_as_16():
    assert requested_rows_per_rank(BatchSection(micro_batch_size=4, grad_accum_steps=3)) == 12
    assert requested_rows_per_rank(BatchSection(micro_batch_size="auto", grad_accum_steps=3)) == 48


def test_the_fingerprint_does_not_depend_on_key_order():
    """A model record read back from a checkpoint's JSON may list its keys in another order than the
    ModelConfig it was made from: the same run all the same."""
    assert fingerprint_of({"model": {"d_model": 64, "n_layers": 2}, "seed": 1}) == \
        fingerprint_of({"seed": 1, "model": {"n_layers": 2, "d_model": 64}})


@pytest.mark.parametrize("value", [True, False])
def test_a_yaml_boolean_micro_batch_size_is_named_as_one(value):
    """`micro_batch_size: no` (YAML's false) is named as the boolean it became, as `yes` is,
    not as a number below 1."""
    with pytest.raises(ConfigError, match=rf"pretrain.batch.micro_batch_size: a number is expected, not the "
                                          rf"boolean {value}"):
        parse_section(PretrainConfig, {"batch": {"micro_batch_size": value}}, "pretrain")
