"""start_offsets: the packed requests' offsets, one tensor per distinct lengths tuple."""

import torch

from ninfer.kernels.varlen import start_offsets


def test_offsets_are_the_running_sum() -> None:
    offsets = start_offsets((5, 0, 64, 3), torch.device("cpu"), torch.int32)
    assert offsets.dtype == torch.int32
    assert offsets.tolist() == [0, 5, 5, 69, 72]
    assert start_offsets((), torch.device("cpu")).tolist() == [0]


def test_one_tensor_per_lengths_device_and_dtype() -> None:
    cpu = torch.device("cpu")
    first = start_offsets((7, 9), cpu)
    assert start_offsets((7, 9), cpu) is first  # every layer of a step shares it
    assert start_offsets((7, 10), cpu) is not first
    assert start_offsets((7, 9), cpu, torch.int32) is not first
    assert first.dtype == torch.int64
