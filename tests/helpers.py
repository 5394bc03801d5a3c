"""Builders for tiny on-disk inputs shared by several test modules."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
from tokenizers import Tokenizer, pre_tokenizers, trainers

from pipeline.data.tokenizer import SPECIAL_TOKENS, build_tokenizer, load_tokenizer
from pipeline.files import sha256_file
from pipeline.model.transformer import ModelConfig, Transformer, build_config
from pipeline.training import checkpoint as ckpt


def synthetic_docs(n_docs: int, vocab: int, seed: int, eot: int = 0) -> list[np.ndarray]:
    """Learnable documents: arithmetic progressions mod (vocab - 4), shifted past the
    special ids, each closed by ``eot``."""
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(n_docs):
        n, a, b = rng.integers(5, 40), rng.integers(0, vocab - 4), rng.integers(1, 4)
        docs.append(np.append((a + b * np.arange(n)) % (vocab - 4) + 4, eot).astype(np.int32))
    return docs


def write_split(d: Path, docs: list[np.ndarray], seq_len: int, labels: list[np.ndarray] | None = None) -> dict:
    d.mkdir(parents=True, exist_ok=True)
    width = seq_len + 1
    stream = np.concatenate(docs)
    lab_stream = np.concatenate(labels) if labels is not None else None
    starts = np.cumsum([0] + [len(x) for x in docs[:-1]])
    n_rows = len(stream) // width
    rows, row_starts = stream[: n_rows * width], []
    for r in range(n_rows):
        lo, hi = r * width, (r + 1) * width
        inside = starts[(starts > lo) & (starts < hi)] - lo
        row_starts.append([0, *inside.tolist()])
    cols = {
        "input_ids": pa.FixedSizeListArray.from_arrays(pa.array(rows, pa.int32()), width),
        "doc_starts": pa.array(row_starts, pa.list_(pa.int32())),
    }
    if lab_stream is not None:
        cols["labels"] = pa.FixedSizeListArray.from_arrays(pa.array(lab_stream[: n_rows * width], pa.int32()), width)
    table = pa.table(cols)
    path = d / "shard-00000.arrow"
    with pa.ipc.new_file(str(path), table.schema) as w:
        w.write_table(table)
    return {"rows": n_rows, "tokens": n_rows * width, "docs": len(docs),
            "shards": [{"path": f"{d.name}/{path.name}", "rows": n_rows, "sha256": sha256_file(path)}]}


def write_packed(out: Path, *, vocab: int = 64, seq_len: int = 32, n_docs: int = 400, seed: int = 0,
                 tokenizer: Path | None = None) -> Path:
    """A packed dataset in the pack stage's layout (train/, val/, manifest.json).
    ``tokenizer``: a tokenizer.json the manifest says the data was made with (its
    sha256, as pack records it; the token ids stay synthetic, below ``vocab``)."""
    docs = synthetic_docs(n_docs, vocab, seed)
    n_val = max(2, n_docs // 10)
    splits = {"train": write_split(out / "train", docs[n_val:], seq_len),
              "val": write_split(out / "val", docs[:n_val], seq_len)}
    manifest = {"seq_len": seq_len, "row_len": seq_len + 1, "vocab_size": vocab, "eot_id": 0, "pad_id": 1,
                "tokenizer_sha256": sha256_file(tokenizer) if tokenizer else "synthetic", "splits": splits}
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


# A few KB of code-like text: enough for a few hundred merges.
CORPUS = [
    f"def function_{i}(value, items):\n    total = value * {i}\n    for item in items:\n"
    f"        total += item  # accumulate\n    return total\n\n"
    f"class Widget{i}:\n    \"\"\"A widget that does thing number {i}.\"\"\"\n\n"
    f"    def __init__(self, name):\n        self.name = name\n"
    for i in range(40)
]


def train_tiny_tokenizer(path: Path, vocab_size: int = 320) -> Tokenizer:
    """Byte-level BPE with our special tokens at ids 0..3, trained on CORPUS, saved to ``path``."""
    tok = build_tokenizer()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return load_tokenizer(path)


def tiny_config(vocab_size: int, **overrides) -> ModelConfig:
    # A much wider init than training uses. At 0.02 the tied head makes greedy
    # decoding repeat one token forever, which would hide position bugs in the
    # cache; at 0.3 outputs vary and logits have clear margins, so argmax
    # comparisons do not hinge on rounding differences between code paths.
    return build_config("tiny", vocab_size, **{"init_std": 0.3, **overrides})


def tiny_model(config: ModelConfig, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(config).eval()


def save_checkpoint(folder: Path, model: Transformer, *, step: int = 5, meta: dict | None = None,
                    sharded: bool = False) -> ckpt.Checkpoint:
    """A complete training checkpoint of ``model`` in the trainer's layout
    (``sharded``: the DCP layout an FSDP run writes, here from one process),
    the final one of its run unless ``meta`` says ``final: False``."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    base = {"stage": "sft", "fingerprint": "f" * 16, "model": model.config.to_dict(), "metrics": {"loss": 1.25},
            "final": True}
    if sharded:
        from pipeline.training.distributed import Dist

        return ckpt.save_sharded(folder, step, model, optimizer, {"step": step}, {**base, **(meta or {})}, 2,
                                 Dist(0, 0, 1, torch.device("cpu"), None))
    return ckpt.save(folder, step, model, optimizer, {"step": step}, {**base, **(meta or {})}, keep=2)


# Test shorthand for the nested training config: each short name is one key of
# one section of pipeline/training/config.py (a test that names them all would
# otherwise drown in braces). `train_params(lr=1e-2)` -> {"optimizer": {"lr": 1e-2}}.
TRAIN_KEYS = {
    "doc_mask": "data.doc_mask", "micro_batch_size": "batch.micro_batch_size",
    "grad_accum_steps": "batch.grad_accum_steps", "lr": "optimizer.lr", "weight_decay": "optimizer.weight_decay",
    "grad_clip": "optimizer.grad_clip", "max_steps": "schedule.max_steps", "warmup_steps": "schedule.warmup_steps",
    "min_lr": "schedule.min_lr", "kind": "schedule.kind", "decay_fraction": "schedule.decay_fraction",
    "decay_steps": "schedule.decay_steps", "decay_shape": "schedule.decay_shape", "device": "compute.device", "precision": "compute.precision",
    "compile": "compute.compile", "activation_checkpointing": "compute.activation_checkpointing",
    "parallelism": "compute.parallelism",
    "nproc_per_node": "launch.nproc_per_node", "eval_every": "eval.every", "eval_rows": "eval.rows",
    "checkpoint_every": "checkpoint.every", "keep_checkpoints": "checkpoint.keep", "keep_best": "checkpoint.keep_best",
    "keep_previous": "checkpoint.keep_previous", "log_every": "logging.every",
    "peak_flops": "logging.peak_flops", "track": "logging.track", "seq_len": "data.seq_len",
    "max_examples": "data.max_examples",
}


def train_params(base: dict | None = None, **short) -> dict:
    """A nested training params section from ``base`` (already nested) plus
    ``short`` names of TRAIN_KEYS; any other key (``model``, ``seed``) is kept as is."""
    import copy

    out = copy.deepcopy(base or {})
    for name, value in short.items():
        *parents, last = TRAIN_KEYS.get(name, name).split(".")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return out


@functools.lru_cache(maxsize=1)
def small_disks() -> str | None:
    """None where :func:`on_small_disk` works here (a tmpfs mounted in a mount
    namespace of its own, as root or in a user namespace), else why not."""
    import shutil
    import subprocess

    if shutil.which("unshare") is None:
        return "no unshare command"
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                            "mount -t tmpfs -o size=64k tmpfs /tmp"], capture_output=True, text=True)
    return None if probe.returncode == 0 else f"cannot mount a tmpfs: {probe.stderr.strip()}"


def on_small_disk(folder: str, kilobytes: int, script: str, read_only: bool = False) -> list[str]:
    """A command that runs the shell ``script`` with a fresh tmpfs of ``kilobytes``
    (``read_only``: mounted so) on ``folder`` (relative to its cwd): a full or
    read-only disk without root, seen by that command alone; the tmpfs and what
    it holds end with the command."""
    return ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
            f"mount -t tmpfs -o size={kilobytes}k{',ro' if read_only else ''} tmpfs {folder} && {script}"]
