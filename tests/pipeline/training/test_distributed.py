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
