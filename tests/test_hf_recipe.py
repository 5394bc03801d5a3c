"""The README recipe "Fine-tune a Hugging Face model on your chat data", as a new
user follows it: a local Qwen2-style model folder under ``models/base/``, only
``params.yaml`` edited, then ``dvc repro``. One slow module sharing one run."""

import json
import os
import re
import subprocess

import pytest
import torch

from tests.conftest import BIN, dvc, project_copy
from tests.hf_models import save_tiny_hf_folder

pytestmark = pytest.mark.slow

BASE = "models/base/qwen2-tiny"
RECIPE = {  # the README recipe's params, at test size
    "ingest.max_bytes": 200_000,
    "tokenizer.source": BASE,
    "pack.seq_len": 64,
    "pretrain.init_from": BASE, "pretrain.schedule.max_steps": 0, "pretrain.schedule.warmup_steps": 0,
    "sft.data.seq_len": 256, "sft.data.max_examples": 200, "sft.data.overlong": "truncate",
    "sft.batch.micro_batch_size": 8, "sft.schedule.max_steps": 6, "sft.schedule.warmup_steps": 1,
    "sft.eval.every": 3, "sft.checkpoint.every": 3, "sft.logging.every": 3, "sft.optimizer.lr": 1.0e-3,
    "evaluate.max_rows": 8, "evaluate.samples": {"max_new_tokens": 4},
    "export.register_model": False,
}


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    root = project_copy(tmp_path_factory.mktemp("hf-recipe"), RECIPE)
    save_tiny_hf_folder("qwen2", root / BASE, max_position_embeddings=512)
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    return root, env, dvc(root, "repro", env=env)


def test_every_stage_ran_from_the_base_model(project):
    root, _, out = project
    assert re.findall(r"Running stage '([\w-]+)'", out) == [
        "ingest", "clean", "tokenizer", "pack", "pretrain", "sft", "evaluate", "export"]
    pre = json.loads((root / "metrics" / "pretrain.json").read_text())
    assert pre["steps"] == 0  # max_steps 0: the base model passed through
    assert "pretrain.model key(s)" not in out  # params.yaml ships preset: mini, the default: nothing to warn of
    assert json.loads((root / "metrics" / "sft.json").read_text())["steps"] == 6


def test_pass_through_keeps_the_base_weights(project):
    root, _, _ = project
    from pipeline.model import hf_adapter
    from pipeline.model.transformer import ModelConfig, Transformer
    from pipeline.training import checkpoint as ckpt

    step0 = ckpt.resolve(root / "models" / "pretrain")
    assert step0.step == 0 and step0.meta["final"]
    assert step0.meta["hf_config"]["architectures"] == ["Qwen2ForCausalLM"]
    _, base = hf_adapter.load_hf_model(root / BASE)
    ours = Transformer(ModelConfig(**step0.meta["model"]))
    ckpt.load_model_weights(step0, ours)
    theirs = base.state_dict()
    for name, tensor in ours.state_dict().items():
        assert torch.equal(tensor, theirs[name]), name


def test_export_is_the_same_family_with_the_original_tokenizer(project):
    root, _, _ = project
    import transformers

    export, base = root / "models" / "export", root / BASE
    config = json.loads((export / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["model_type"] == "qwen2"
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (export / name).read_bytes() == (base / name).read_bytes(), name
    model = transformers.AutoModelForCausalLM.from_pretrained(export)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    tok = transformers.AutoTokenizer.from_pretrained(export)
    assert tok.chat_template == (base / "chat_template.jinja").read_text()
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > ids["input_ids"].shape[1]


def test_sft_trained_only_the_assistant_with_the_models_template(project):
    root, _, _ = project
    import pyarrow as pa
    from tokenizers import Tokenizer

    manifest = json.loads((root / "data" / "sft" / "manifest.json").read_text())
    assert manifest["chat_template_name"].startswith("tokenizer (")
    tok = Tokenizer.from_file(str(root / "data" / "tokenizer" / "tokenizer.json"))
    im_start, im_end = tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")
    shard = sorted((root / "data" / "sft" / "train").glob("shard-*.arrow"))[0]
    table = pa.ipc.open_file(str(shard)).read_all()
    trained_spans = 0
    for ids, labels in zip(table.column("input_ids").to_pylist(), table.column("labels").to_pylist()):
        span: list[int] = []
        for token, label in zip(ids, labels):
            if label != -100:
                assert label == token
                span.append(token)
            elif span:  # a trained span ends with the end-of-turn token, and holds no header or prompt
                assert span[-1] == im_end and im_start not in span
                text = tok.decode(span, skip_special_tokens=False)
                assert "You are Qwen" not in text and "assistant\n" not in text and "user\n" not in text
                trained_spans, span = trained_spans + 1, []
    assert trained_spans > 10


def test_the_readme_generate_command_chats_with_the_export(project):
    root, env, _ = project
    out = subprocess.run([str(BIN / "python"), "-m", "pipeline.model.generate", "--model", "models/export", "--chat",
                          "Hello!", "--max-new-tokens", "4"], cwd=root, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]


def test_replacing_the_base_model_reruns_what_depends_on_it(project):
    root, env, _ = project
    assert "changed" not in dvc(root, "status", env=env)
    config = root / BASE / "generation_config.json"
    config.write_text(config.read_text().rstrip() + "\n\n")  # any change to a file of the model folder
    status = dvc(root, "status", env=env)
    changed = set(re.findall(r"^(\w+):\s*$", status, re.M))
    assert {"tokenizer", "pretrain"} <= changed, status
