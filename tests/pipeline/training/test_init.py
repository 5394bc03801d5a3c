"""Where a run's starting weights come from (pipeline/training/init.py):
resolve_init for each kind of init_from, and check_tokenizer's pairing of the
packed data with the initial model. Every refusal is one line naming the thing."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline.files import sha256_file
from pipeline.model import hf_adapter
from pipeline.model.transformer import Transformer
from pipeline.training.init import InitError, check_tokenizer, resolve_init
from tests.hf_models import save_tiny_hf_folder, save_tiny_hf_model
from tests.helpers import save_checkpoint, tiny_config, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


def one_line(err) -> str:
    message = str(err.value)
    assert "\n" not in message, message
    return message


def refused(init_from) -> str:
    with pytest.raises(InitError) as err:
        resolve_init(str(init_from), warn_outside_base=False)
    return one_line(err)


# --------------------------------------------------------------------------- resolve_init


def test_none_is_a_random_init():
    assert resolve_init(None) is None


def test_a_missing_path_is_one_line_naming_it(tmp_path):
    message = refused(tmp_path / "nowhere")
    assert f"init_from {tmp_path / 'nowhere'} does not exist" in message
    assert "Hugging Face model folder" in message and "checkpoint" in message


def test_weights_that_do_not_fit_the_config_are_refused_from_their_headers(tmp_path):
    """resolve_init runs in the launcher: a misshapen tensor is one line there, not a rank's error."""
    folder = save_tiny_hf_model("llama", tmp_path / "m")
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.norm.weight"] = torch.ones(2 * tensors["model.norm.weight"].shape[0])
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    message = refused(folder)
    assert message.startswith(f"init_from {folder}: weights do not fit LlamaForCausalLM of this config: ")
    assert "model.norm.weight has shape [128], the config says [64]" in message
    assert message.count(str(folder)) == 1


@pytest.mark.parametrize("make", ["empty", "weights_only"])
def test_a_folder_that_is_neither_kind_is_one_line(tmp_path, make):
    path = tmp_path / "thing"
    path.mkdir()
    if make == "weights_only":  # no config.json
        save_tiny_hf_model("llama", tmp_path / "hf")
        shutil.copy(tmp_path / "hf" / "model.safetensors", path / "model.safetensors")
    message = refused(path)
    assert f"init_from {path} is neither a Hugging Face model folder" in message
    assert "model.safetensors" in message and "checkpoint of ours (meta.json)" in message


def test_a_run_folder_whose_run_has_not_finished_warns_and_its_step_folder_does_not(tmp_path, caplog):
    run_folder = tmp_path / "models" / "sft"
    meta = {"stage": "sft", "final": False, "schedule": {"max_steps": 20}}  # killed at step 8 of 20
    save_checkpoint(run_folder, tiny_model(tiny_config(64)), step=8, meta=meta)
    with caplog.at_level("WARNING", logger="pipeline.training"):
        found = resolve_init(str(run_folder))
    assert found.path.name == "step-00000008"
    assert (f"init_from {run_folder}: {found.path} is not sft's final checkpoint (step 8 of 20); sft was "
            "interrupted") in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="pipeline.training"):
        resolve_init(str(run_folder / "step-00000008"))
        resolve_init(str(run_folder), warn_outside_base=False)  # a rank: the launcher has warned
    assert caplog.text == ""


def test_the_parent_of_models_or_runs_names_them(run_folder, tmp_path):
    message = refused(run_folder / "previous")  # README: models/pretrain/previous/<run-id>/step-N
    assert message.endswith(f"; it holds {run_folder / PREVIOUS}: name one of them")
    base = tmp_path / "base"
    for name in ("a", "b"):
        save_tiny_hf_model("llama", base / name)
    (base / "notes").mkdir()
    assert refused(base).endswith(f"; it holds {base / 'a'}, {base / 'b'}: name one of them")
    for name in ("c", "d", "e"):  # a long list is cut after three
        save_tiny_hf_model("llama", base / name)
    assert refused(base).endswith(f"; it holds {base / 'a'}, {base / 'b'}, {base / 'c'} and 2 more: name one of them")


def test_a_lora_adapter_folder_is_named_as_one(tmp_path):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"peft_type": "LORA", "base_model_name_or_path": "Qwen/x"}')
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    message = refused(adapter)
    assert message.startswith(f"init_from {adapter} is a PEFT (LoRA) adapter (adapter_config.json), not a whole model")
    assert "merge_and_unload" in message


def test_a_file_is_one_line_naming_the_folder_that_holds_it(tmp_path):
    folder = save_tiny_hf_model("llama", tmp_path / "hf")
    message = refused(folder / "model.safetensors")
    assert f"init_from {folder / 'model.safetensors'} is a file; init_from names a folder" in message
    assert message.endswith(f"name the folder that holds it, {folder}")
    (tmp_path / "notes.txt").write_text("hello")  # a file in no model folder: no folder to suggest
    message = refused(tmp_path / "notes.txt")
    assert "is a file; init_from names a folder" in message and "holds it" not in message


def test_a_copied_cache_snapshot_whose_links_point_nowhere_says_so(tmp_path):
    """The Hugging Face cache keeps a snapshot's files as relative links into blobs/;
    `cp -r` of the snapshot copies the links, which then point nowhere."""
    blobs, copy = tmp_path / "blobs", tmp_path / "copy"
    save_tiny_hf_model("llama", blobs)
    copy.mkdir()
    shutil.copy(blobs / "config.json", copy / "config.json")
    (copy / "model.safetensors").symlink_to("../../blobs/model.safetensors")  # relative to a cache that is not there
    message = refused(copy)
    assert message.startswith(f"init_from {copy}: model.safetensors is a link to nothing (model.safetensors -> "
                              "../../blobs/model.safetensors)")
    assert "cp -rL" in message
    (copy / "model.safetensors").unlink()
    (copy / "model.safetensors").symlink_to(blobs / "model.safetensors")  # a link that resolves is fine
    assert resolve_init(str(copy), warn_outside_base=False).kind == "hf"


@pytest.mark.parametrize("bin_weights", [False, True])
def test_a_hugging_face_folder_without_safetensors_weights_says_what_it_lacks(tmp_path, bin_weights):
    path = tmp_path / "thing"
    path.mkdir()
    save_tiny_hf_model("llama", tmp_path / "hf")
    shutil.copy(tmp_path / "hf" / "config.json", path / "config.json")
    if bin_weights:
        (path / "pytorch_model.bin").write_bytes(b"pickle")
    message = refused(path)
    assert f"init_from {path} is a Hugging Face model folder without safetensors weights" in message
    assert "no model.safetensors or model.safetensors.index.json" in message
    assert ("found pytorch_model.bin: convert them to safetensors" in message) == bin_weights


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_hugging_face_folder_gives_its_model_config_weights_and_metadata(tmp_path, family):
    folder = save_tiny_hf_folder(family, tmp_path / family)
    init = resolve_init(str(folder), warn_outside_base=False)
    config = json.loads((folder / "config.json").read_text())
    assert init.kind == "hf" and init.path == folder and init.checkpoint is None
    assert init.model == hf_adapter.config_from_hf(config)
    assert init.model.family == family and init.model.vocab_size == 640 and init.model.max_seq_len == 128
    assert init.tokenizer_sha256 == sha256_file(folder / "tokenizer.json")
    assert init.meta["hf_config"] == config and init.meta["init_from"] == str(folder)
    assert init.meta["hf_generation_config"] == json.loads((folder / "generation_config.json").read_text())
    assert init.init_id.startswith("hf:")
    # load_weights fills a model built from init.model with the folder's weights
    _, reference = hf_adapter.load_hf_model(folder)
    model = Transformer(init.model)
    init.load_weights(model)
    for k, v in reference.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k


@pytest.mark.parametrize("sharded", [False, True])
def test_the_init_id_is_stable_and_follows_every_weight_file(tmp_path, sharded):
    folder = save_tiny_hf_model("qwen2", tmp_path / "a", sharded=sharded)
    first = resolve_init(str(folder), warn_outside_base=False).init_id
    assert resolve_init(str(folder), warn_outside_base=False).init_id == first  # the same folder, the same id
    copy = shutil.copytree(folder, tmp_path / "b")  # content, not location: a copy is the same model
    assert resolve_init(str(copy), warn_outside_base=False).init_id == first
    files = sorted(hf_adapter.weight_files(folder))
    assert (len(files) > 1) == sharded
    for name in files:  # a change in any weight file (the last shard too) is another model
        changed = shutil.copytree(folder, tmp_path / f"changed-{name}")
        tensors = load_file(str(changed / name))
        key = sorted(tensors)[0]
        tensors[key] = tensors[key] + 1.0
        save_file(tensors, str(changed / name), metadata={"format": "pt"})
        assert resolve_init(str(changed), warn_outside_base=False).init_id != first, name
    retuned = shutil.copytree(folder, tmp_path / "config")
    config = json.loads((retuned / "config.json").read_text())
    (retuned / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}))
    assert resolve_init(str(retuned), warn_outside_base=False).init_id != first


def test_sampling_settings_are_no_part_of_the_init_id(tmp_path):
    """generation_config.json does not change what training computes, so an edited
    or re-downloaded one resumes the run instead of restarting it; export reads the
    file anew (tests/pipeline/test_export.py)."""
    folder = save_tiny_hf_folder("qwen2", tmp_path / "m")
    first = resolve_init(str(folder), warn_outside_base=False)
    file = folder / "generation_config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), "do_sample": True, "temperature": 0.7}))
    again = resolve_init(str(folder), warn_outside_base=False)
    assert again.init_id == first.init_id
    assert again.meta["hf_generation_config"]["temperature"] == 0.7
    file.unlink()
    assert resolve_init(str(folder), warn_outside_base=False).init_id == first.init_id


def test_a_folder_outside_models_base_warns_that_dvc_does_not_track_it(tmp_path, caplog):
    folder = save_tiny_hf_model("llama", tmp_path / "llama")
    with caplog.at_level("WARNING", logger="pipeline.training"):
        resolve_init(str(folder))
    assert f"init_from {folder} is outside models/base/" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="pipeline.training"):
        resolve_init(str(folder), warn_outside_base=False)
    assert caplog.text == ""


def test_a_link_under_models_base_warns_naming_where_it_leads(tmp_path, caplog, monkeypatch):
    """DVC hashes no file of a linked folder (its dep on models/base/ lists 0 files), so a model
    linked there is as untracked as one elsewhere: the warning says it is a link, and to what."""
    folder = save_tiny_hf_model("llama", tmp_path / "elsewhere" / "llama")
    (tmp_path / "models" / "base").mkdir(parents=True)
    (tmp_path / "models" / "base" / "llama").symlink_to(folder)
    monkeypatch.chdir(tmp_path)
    with caplog.at_level("WARNING", logger="pipeline.training"):
        resolve_init("models/base/llama")
    assert f"init_from models/base/llama is outside models/base/ (through a link: it is {folder})" in caplog.text


@pytest.fixture
def run_folder(tmp_path):
    """A run folder of ours with checkpoints at steps 4 and 8 (different weights),
    and a previous run under previous/<id>/ with one at step 2."""
    run = tmp_path / "models" / "pretrain"
    config = tiny_config(64)
    for step, seed in ((4, 1), (8, 2)):
        save_checkpoint(run, tiny_model(config, seed=seed), step=step,
                        meta={"tokenizer_sha256": "t" * 64, "hf_config": {"architectures": ["LlamaForCausalLM"]}})
    save_checkpoint(run / "previous" / "0123456789abcdef", tiny_model(config, seed=3), step=2)
    return run


PREVIOUS = "previous/0123456789abcdef"


@pytest.mark.parametrize("where, found, seed", [
    (".", "step-00000008", 2),  # a run folder: its newest checkpoint
    ("step-00000004", "step-00000004", 1),
    (f"{PREVIOUS}/step-00000002", f"{PREVIOUS}/step-00000002", 3),
    (PREVIOUS, f"{PREVIOUS}/step-00000002", 3),
])
def test_a_checkpoint_of_ours_by_run_folder_step_folder_or_previous_run(run_folder, where, found, seed):
    init = resolve_init(str(run_folder / where))
    step = int(found[-8:])
    assert init.kind == "checkpoint" and init.checkpoint.step == step
    assert init.path.resolve() == (run_folder / found).resolve()
    assert init.model == tiny_config(64)
    assert init.init_id.startswith("ckpt:")
    model = Transformer(init.model)
    init.load_weights(model)
    expected = tiny_model(tiny_config(64), seed=seed).state_dict()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in expected.items())
    if step != 2:  # what the run it comes from recorded travels on: the tokenizer and the original config.json
        assert init.tokenizer_sha256 == "t" * 64
        assert init.meta == {"init_from": str(init.path), "hf_config": {"architectures": ["LlamaForCausalLM"]}}
    else:
        assert init.tokenizer_sha256 is None and "hf_config" not in init.meta


def test_two_checkpoints_of_one_run_are_two_starting_points(run_folder):
    """Steps 4 and 8 share the run's fingerprint; their weights differ, and so
    must the init ids (else a lengthened upstream run would not start a new run
    downstream, which would resume on the old weights' checkpoints)."""
    a, b = (resolve_init(str(run_folder / f"step-0000000{s}")) for s in (4, 8))
    assert a.checkpoint.meta["fingerprint"] == b.checkpoint.meta["fingerprint"]
    assert sha256_file(a.path / "model.safetensors") != sha256_file(b.path / "model.safetensors")
    assert a.init_id != b.init_id


@pytest.mark.parametrize("damage", ["weights", "meta", "optimizer_missing"])
def test_a_damaged_checkpoint_is_one_line_naming_the_file(run_folder, damage):
    step = run_folder / "step-00000008"
    if damage == "weights":
        data = bytearray((step / "model.safetensors").read_bytes())
        data[len(data) // 2] ^= 0xFF
        (step / "model.safetensors").write_bytes(bytes(data))
        file = "model.safetensors"
    elif damage == "meta":
        (step / "meta.json").write_text("{not json")
        file = "meta.json"
    else:
        (step / "optimizer.pt").unlink()
        file = "optimizer.pt"
    for path in (step, run_folder):  # named directly, or as the run's newest: never an older one in its place
        message = refused(path)
        assert f"{step / file}" in message and "damaged" in message


def test_damaged_hugging_face_files_are_one_line_naming_the_folder(tmp_path):
    folder = save_tiny_hf_folder("qwen2", tmp_path / "good")
    bad_config = shutil.copytree(folder, tmp_path / "config")
    (bad_config / "config.json").write_text("{not json")
    assert f"{bad_config / 'config.json'}: cannot read" in refused(bad_config)
    truncated = shutil.copytree(folder, tmp_path / "weights")
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    message = refused(truncated)
    assert f"init_from {truncated}" in message and "safetensors" in message
    bad_generation = shutil.copytree(folder, tmp_path / "generation")
    (bad_generation / "generation_config.json").write_text("{")
    assert f"{bad_generation / 'generation_config.json'}" in refused(bad_generation)
    sharded = save_tiny_hf_model("qwen2", tmp_path / "sharded", sharded=True)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (sharded / shard).unlink()
    message = refused(sharded)
    assert shard in message and "missing" in message


@pytest.mark.parametrize("edit, named", [
    ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "GPT2LMHeadModel"),
    ({"architectures": ["GemmaForCausalLM"], "model_type": "gemma"}, "GemmaForCausalLM"),
])
def test_an_unsupported_architecture_is_one_line_listing_the_supported_ones(tmp_path, edit, named):
    folder = save_tiny_hf_model("llama", tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **edit}))
    message = refused(folder)
    assert f"init_from {folder}" in message and named in message
    for supported in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"):
        assert supported in message


def test_an_unsupported_config_feature_is_one_line_naming_it(tmp_path):
    folder = save_tiny_hf_model("llama", tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    (folder / "config.json").write_text(json.dumps(config))
    message = refused(folder)
    assert "yarn" in message and "default, llama3" in message


# --------------------------------------------------------------------------- check_tokenizer


def manifest(vocab_size, sha):
    return {"vocab_size": vocab_size, "tokenizer_sha256": sha}


def test_data_made_with_the_models_tokenizer_passes(tmp_path, caplog):
    folder = save_tiny_hf_folder("qwen2", tmp_path / "m")
    init = resolve_init(str(folder), warn_outside_base=False)
    with caplog.at_level("WARNING", logger="pipeline.training"):
        check_tokenizer(init, manifest(534, sha256_file(folder / "tokenizer.json")))
    assert caplog.text == ""


def test_data_made_with_another_tokenizer_is_one_line_telling_to_set_tokenizer_source(tmp_path):
    folder = save_tiny_hf_folder("qwen2", tmp_path / "m")
    init = resolve_init(str(folder), warn_outside_base=False)
    with pytest.raises(InitError) as err:
        check_tokenizer(init, manifest(320, "a" * 64))  # our own trained tokenizer: fits, but is another one
    message = one_line(err)
    assert f"set tokenizer.source: {folder}" in message and "aaaaaaaaaaaa" in message
    assert init.tokenizer_sha256[:12] in message


def test_data_made_with_another_tokenizer_than_a_checkpoints_is_refused(tmp_path):
    save_checkpoint(tmp_path / "run", tiny_model(tiny_config(64)), meta={"tokenizer_sha256": "t" * 64})
    init = resolve_init(str(tmp_path / "run"))
    check_tokenizer(init, manifest(64, "t" * 64))
    with pytest.raises(InitError) as err:
        check_tokenizer(init, manifest(64, "a" * 64))
    assert "use the tokenizer that checkpoint was trained with" in one_line(err)


def test_a_tokenizer_with_more_ids_than_the_models_embedding_is_refused(tmp_path, caplog):
    folder = save_tiny_hf_model("llama", tmp_path / "m", vocab_size=384)  # no tokenizer.json: only the size is known
    init = resolve_init(str(folder), warn_outside_base=False)
    with caplog.at_level("WARNING", logger="pipeline.training"):
        check_tokenizer(init, manifest(384, "a" * 64))  # fills the table exactly: fine
    with pytest.raises(InitError) as err:
        check_tokenizer(init, manifest(385, "a" * 64))
    assert f"the tokenizer's ids need 385 embedding rows but {folder} embeds only 384" in one_line(err)


@pytest.mark.parametrize("top", [700, 640])  # 640: one past the last row
def test_a_tokenizer_whose_ids_leave_gaps_is_checked_by_its_largest_id(tmp_path, top):
    """tokenizers counts tokens, not ids: a vocabulary with a gap has fewer tokens than its largest id + 1,
    and an id past the embedding would stop the first training step (an index error, or a CUDA assert)."""
    folder = save_tiny_hf_folder("llama", tmp_path / "m", vocab_size=640)
    tok = json.loads((folder / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab[max(vocab, key=vocab.get)] = top  # one id moved past the table; the count stays
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    init = resolve_init(str(folder), warn_outside_base=False)
    from tokenizers import Tokenizer

    from pipeline.data.tokenizer import id_space

    rows = id_space(Tokenizer.from_file(str(folder / "tokenizer.json")))  # what pack writes as vocab_size
    assert rows == top + 1 and Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab_size() <= 640
    with pytest.raises(InitError) as err:
        check_tokenizer(init, manifest(rows, sha256_file(folder / "tokenizer.json")))
    assert f"the tokenizer's ids need {top + 1} embedding rows but {folder} embeds only 640" in one_line(err)


def test_a_model_folder_without_tokenizer_json_only_warns(tmp_path, caplog):
    folder = save_tiny_hf_model("mistral", tmp_path / "m", vocab_size=384)
    init = resolve_init(str(folder), warn_outside_base=False)
    assert init.tokenizer_sha256 is None
    with caplog.at_level("WARNING", logger="pipeline.training"):
        check_tokenizer(init, manifest(300, "a" * 64))
    assert f"{folder} ships no tokenizer.json" in caplog.text and "300 <= 384" in caplog.text


def test_the_folder_is_hashed_once_per_launch_unless_a_file_changes_in_place(tmp_path, monkeypatch):
    from pipeline.training import init as init_module

    monkeypatch.delenv(init_module.FOLDER_ID_ENV, raising=False)
    folder = save_tiny_hf_model("llama", tmp_path / "m")
    hashed = []
    real = init_module.sha256_file
    monkeypatch.setattr(init_module, "sha256_file", lambda p: hashed.append(p.name) or real(p))
    first = resolve_init(str(folder), warn_outside_base=False).init_id
    n = len(hashed)
    assert n >= 2  # config.json and the weights
    assert resolve_init(str(folder), warn_outside_base=False).init_id == first  # a rank after the launcher
    assert [h for h in hashed[n:] if h != "tokenizer.json"] == []  # the weights were not read again
    tensors = load_file(str(folder / "model.safetensors"))  # the same size, new content, in place
    key = sorted(tensors)[0]
    tensors[key] = tensors[key] + 1.0
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    assert resolve_init(str(folder), warn_outside_base=False).init_id != first
