"""pipeline/training/parallelize.py: FSDP2 wrapping from outside the model. The
training-level checks (FSDP equals DDP, resume, resharding) are in
test_trainer.py and tests/stages/."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from pipeline.model.transformer import Transformer, build_config
from pipeline.training import distributed
from pipeline.training.config import ComputeSection
from pipeline.training.distributed import Dist
from pipeline.training.parallelize import (
    ParallelismError,
    check_fsdp,
    check_parallelism,
    is_sharded,
    mixed_precision,
    parallelize,
    reset_after_failed_pass,
)

CUDA = Dist(0, 0, 8, torch.device("cuda", 0), "nccl")
CPU = Dist(0, 0, 2, torch.device("cpu"), "gloo")


def test_bf16_weights_and_fp32_reduction_on_cuda_only():
    policy = mixed_precision(CUDA, "bf16")
    assert policy.param_dtype == torch.bfloat16 and policy.reduce_dtype == torch.float32
    for d, precision in [(CUDA, "fp32"), (CPU, "bf16"), (CPU, "fp32")]:
        policy = mixed_precision(d, precision)
        assert policy.param_dtype is None and policy.reduce_dtype is None  # parameters keep their dtype


def test_the_backend_is_resolved_for_the_runs_precision(monkeypatch):
    """auto on an Ampere GPU: varlen in bf16 (flash attention), flex in fp32."""
    from pipeline.model import attention
    from pipeline.model.attention import SDPA, Varlen

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(attention, "Flex", lambda compile: type("Flex", (SDPA,), {"name": "flex"})())
    monkeypatch.setattr(attention, "Varlen", lambda: Varlen.__new__(Varlen))
    one_gpu = Dist(0, 0, 1, torch.device("cuda", 0), None)
    for precision, name in (("bf16", "varlen"), ("fp32", "flex")):
        model = Transformer(build_config("tiny", 64))
        parallelize(model, ComputeSection(), one_gpu, precision)
        assert model.attention_backend.name == name and model.layers[1].attention.backend.name == name


@pytest.mark.parametrize("on", [False, True])
def test_activation_checkpointing_recomputes_each_block_in_backward(on):
    model = Transformer(build_config("tiny", 64))
    calls = []
    for block in model.layers:
        block.attention.register_forward_hook(lambda *_: calls.append(1))
    wrapped = parallelize(model, ComputeSection(attention="sdpa", activation_checkpointing=on),
                          Dist(0, 0, 1, torch.device("cpu"), None))
    wrapped(torch.randint(0, 64, (2, 16))).sum().backward()
    assert len(calls) == (4 if on else 2)


def test_fsdp_needs_a_process_group_and_refuses_fp16():
    with pytest.raises(ParallelismError, match="needs a process group"):
        check_fsdp(Dist(0, 0, 1, torch.device("cpu"), None), "fp32")
    with pytest.raises(ParallelismError, match="not fp16"):
        check_fsdp(CPU, "fp16")
    check_fsdp(CPU, "bf16")
    alone = Dist(0, 0, 1, torch.device("cpu"), None)  # parallelize checks before it shards, on every rank
    with pytest.raises(ParallelismError, match="needs a process group"):
        parallelize(Transformer(build_config("tiny", 64)), ComputeSection(attention="sdpa", parallelism="fsdp"), alone)


def test_the_launcher_refuses_fsdp_in_the_fp16_a_rank_would_resolve(monkeypatch):
    """Before torchrun starts, with the precision resolved for this machine's
    device: ``auto`` is fp16 on a GPU without bf16."""
    with pytest.raises(ParallelismError, match="not fp16") as err:
        check_parallelism(ComputeSection(parallelism="fsdp", precision="fp16", device="cpu"))
    assert "\n" not in str(err.value)
    check_parallelism(ComputeSection(parallelism="ddp", precision="fp16", device="cpu"))  # ddp scales fp16
    check_parallelism(ComputeSection(parallelism="fsdp", precision="fp32", device="cpu"))
    check_parallelism(ComputeSection(parallelism="fsdp", precision="auto", device="cpu"))  # bf16 or fp32
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))  # a T4: no bf16
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr("pipeline.training.parallelize.pick_device", lambda requested: torch.device("cuda", 0))
    with pytest.raises(ParallelismError, match="not fp16"):
        check_parallelism(ComputeSection(parallelism="fsdp", precision="auto"))


def test_each_block_then_the_root_is_sharded_under_the_same_names():
    d = distributed.init("cpu", need_group=True)  # one process, in-memory store
    try:
        assert d.enabled and d.world_size == 1 and dist.get_world_size() == 1
        model = Transformer(build_config("tiny", 64))
        names = [n for n, _ in model.named_parameters()]
        wrapped = parallelize(model, ComputeSection(parallelism="fsdp", attention="sdpa"), d, "fp32")
        assert wrapped is model and is_sharded(model) and all(is_sharded(b) for b in model.layers)
        assert [n for n, _ in model.named_parameters()] == names
        assert all(isinstance(p, DTensor) for p in model.parameters())
        assert model.output.weight is model.tok_embeddings.weight  # still tied
        plain = Transformer(build_config("tiny", 64))
        assert parallelize(plain, ComputeSection(attention="sdpa"), d, "fp32") is plain and not is_sharded(plain)
    finally:
        distributed.shutdown()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fsdp_on_cuda_in_bf16_trains_with_fp32_master_weights(tmp_path):
    from tests.pipeline.training.test_trainer import losses_and_norms, run

    (tmp_path / "fsdp").mkdir()
    run(tmp_path / "fsdp", device="cuda", precision="bf16", parallelism="fsdp", max_steps=12)
    losses = [float(loss) for loss, _ in losses_and_norms(tmp_path / "fsdp")]
    assert all(map(torch.isfinite, torch.tensor(losses))) and losses[-1] < losses[0]
    from pipeline.training import checkpoint as ckpt
    from pipeline.training.trainer import ckpt_model

    last = ckpt.latest(tmp_path / "fsdp" / "models")
    assert ckpt.is_sharded(last)
    model = Transformer(ckpt_model(last))
    ckpt.load_model_weights(last, model)
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_a_torch_that_cannot_reset_fsdp_after_a_failed_pass_stops_in_one_line():
    """FSDPModule.reset_iter_state is what recovers a sharded model from a pass that
    ran out of memory; an older torch has none, and must not train on in that state."""
    with pytest.raises(ParallelismError, match="set batch.micro_batch_size to a number$") as err:
        reset_after_failed_pass(torch.nn.Linear(2, 2))
    assert "\n" not in str(err.value)


def test_a_failed_pass_is_reset_where_torch_can():
    """Where FSDPModule.reset_iter_state exists, it is called: the shards are
    regathered afresh at the next pass instead of the ranks drifting apart."""
    calls = []

    class Sharded(torch.nn.Linear):
        def reset_iter_state(self):
            calls.append(1)

    reset_after_failed_pass(Sharded(2, 2))
    assert calls == [1]
