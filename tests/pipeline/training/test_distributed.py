"""pipeline/training/distributed.py: the device a run asks for."""

import pytest
import torch

from pipeline.errors import StageError
from pipeline.training.distributed import DeviceError, pick_device


def test_auto_and_cpu():
    assert pick_device("cpu") == torch.device("cpu")
    assert pick_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_cuda_without_a_gpu_is_a_one_line_stage_error():
    with pytest.raises(DeviceError, match=r"^device 'cuda' was asked for, but torch .* sees no CUDA GPU here; "
                                          r"set the device to auto or cpu"):
        pick_device("cuda")
    assert issubclass(DeviceError, StageError)


def test_a_numbered_or_unknown_device_is_checked_too():
    """cuda:N is a CUDA device (checked like cuda); a name torch does not know, or a
    device the pipeline does not run on, is a DeviceError, never the CPU in its place."""
    if not torch.cuda.is_available():
        with pytest.raises(DeviceError, match=r"^device 'cuda:0' was asked for, but torch .* sees no CUDA GPU here"):
            pick_device("cuda:0")
    else:
        assert pick_device("cuda:0") == torch.device("cuda", 0)
        with pytest.raises(DeviceError, match=r"CUDA GPU\(s\), numbered from 0"):
            pick_device(f"cuda:{torch.cuda.device_count()}")
    with pytest.raises(DeviceError, match=r"^device 'gpu' is not a device name"):
        pick_device("gpu")
    with pytest.raises(DeviceError, match=r"^device 'meta' is not supported"):
        pick_device("meta")
