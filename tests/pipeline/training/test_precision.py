import pytest
import torch

from pipeline.training.precision import autocast, resolve_precision

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize("device", [CPU, CUDA])
@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp32"])
def test_an_explicit_precision_is_kept(device, precision):
    assert resolve_precision(precision, device) == precision


@pytest.mark.parametrize("native, expected", [(True, "bf16"), (False, "fp32")])
def test_auto_on_a_cpu_is_bf16_only_where_onednn_runs_it_natively(monkeypatch, native, expected):
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: native)
    assert resolve_precision("auto", CPU) == expected


def test_auto_on_a_cpu_whose_torch_cannot_say_is_fp32(monkeypatch):
    def unknown():
        raise RuntimeError("no oneDNN in this build")

    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", unknown)
    assert resolve_precision("auto", CPU) == "fp32"


@pytest.mark.parametrize("bf16, expected", [(True, "bf16"), (False, "fp16")])
def test_auto_on_a_gpu_is_bf16_or_else_fp16(monkeypatch, bf16, expected):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)
    assert resolve_precision("auto", CUDA) == expected


def test_autocast_runs_matmuls_in_the_precision_and_fp32_is_left_alone():
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    with autocast(CPU, "bf16"):
        assert (a @ b).dtype == torch.bfloat16
    with autocast(CPU, "fp32"):
        assert (a @ b).dtype == torch.float32 and not torch.is_autocast_enabled("cpu")
