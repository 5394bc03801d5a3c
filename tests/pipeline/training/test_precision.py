import types
import warnings

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


def fake_gpu(monkeypatch, major: int, minor: int, hip: str | None = None) -> None:
    """torch.cuda as a machine with one GPU of compute capability major.minor sees it
    (a T4 is 7.5, an A100 8.0), where bf16 tensors can be made (emulated before 8.0)."""
    props = types.SimpleNamespace(major=major, minor=minor, name=f"sm{major}{minor}")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    monkeypatch.setattr(torch.cuda, "_check_bf16_tensor_supported", lambda device: True)
    monkeypatch.setattr(torch.version, "hip", hip)


@pytest.mark.parametrize("capability, expected", [((9, 0), "bf16"), ((8, 0), "bf16"), ((7, 5), "fp16"),
                                                  ((7, 0), "fp16")])
def test_auto_on_a_gpu_is_bf16_from_ampere_on_and_fp16_before(monkeypatch, capability, expected):
    """A V100 (7.0) or T4 (7.5) emulates bf16, which torch.cuda.is_bf16_supported()
    counts as support: auto must still pick fp16 there."""
    fake_gpu(monkeypatch, *capability)
    assert resolve_precision("auto", CUDA) == expected


@pytest.mark.parametrize("capability", [(9, 0), (7, 0)])
def test_auto_on_a_rocm_gpu_is_bf16(monkeypatch, capability):
    """Any ROCm GPU, whatever compute capability it reports (its gfx number)."""
    fake_gpu(monkeypatch, *capability, hip="6.2")
    assert resolve_precision("auto", CUDA) == "bf16"


@pytest.mark.parametrize("device", ["meta", "mps"])
def test_auto_on_another_device_type_is_fp32(device):
    assert resolve_precision("auto", torch.device(device)) == "fp32"


def test_autocast_runs_matmuls_in_the_precision_and_fp32_is_left_alone():
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    with autocast(CPU, "bf16"):
        assert (a @ b).dtype == torch.bfloat16
    with autocast(CPU, "fp16"):
        assert (a @ b).dtype == torch.float16
    with warnings.catch_warnings():  # no autocast at all, not one that torch turns off with a warning at each step
        warnings.simplefilter("error")
        with autocast(CPU, "fp32"):
            assert (a @ b).dtype == torch.float32 and not torch.is_autocast_enabled("cpu")
