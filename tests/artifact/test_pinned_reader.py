"""PinnedReader: every tensor's bytes as safetensors reads them, whatever the chunking."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ninfer.artifact.pinned_reader import PinnedReader, tensor_extents


@pytest.fixture
def shards(tmp_path):
    generator = torch.Generator().manual_seed(0)
    first = {
        "embed": torch.randn(300, 37, generator=generator).to(torch.bfloat16),
        "empty": torch.zeros(0, 4),
        "ids": torch.arange(12345, dtype=torch.int64),
        "codes": torch.randint(0, 255, (129, 7), generator=generator, dtype=torch.uint8),
    }
    second = {
        "fp8": torch.randn(64, 33, generator=generator).to(torch.float8_e4m3fn),
        "half": torch.randn(5, 3, 2, generator=generator).half(),
        "mask": torch.rand(17, generator=generator) > 0.5,
    }
    save_file(first, tmp_path / "a.safetensors")
    save_file(second, tmp_path / "b.safetensors")
    return [tmp_path / "a.safetensors", tmp_path / "b.safetensors"]


def test_extents_follow_the_files_header(shards):
    for file in shards:
        with safe_open(file, framework="pt") as handle:
            expected = {name: handle.get_slice(name) for name in handle.keys()}
            extents = tensor_extents(file)
            assert {extent.name for extent in extents} == set(expected)
            for extent in extents:
                assert extent.shape == tuple(expected[extent.name].get_shape())
                assert extent.dtype == expected[extent.name].get_dtype()
            offsets = [extent.offset for extent in extents]
            assert offsets == sorted(offsets)


@pytest.mark.parametrize("chunk_bytes", [7, 4096, 1 << 20])
@pytest.mark.parametrize("threads", [1, 3])
def test_reads_every_tensor_bit_for_bit_in_order(shards, chunk_bytes, threads):
    extents = [extent for file in shards for extent in tensor_extents(file)]
    extents = extents[::-1]  # any order the caller asks for
    with PinnedReader(torch.device("cpu"), threads=threads, chunk_bytes=chunk_bytes) as reader:
        got = [(extent, extent.view(raw)) for extent, raw in reader.read(extents)]
    assert [extent.name for extent, _ in got] == [extent.name for extent in extents]
    for extent, tensor in got:
        with safe_open(extent.file, framework="pt") as handle:
            expected = handle.get_tensor(extent.name)
        assert tensor.dtype == expected.dtype and tensor.shape == expected.shape
        assert torch.equal(tensor.view(torch.uint8), expected.view(torch.uint8)), extent.name


def test_a_reader_shortens_the_gil_switch_while_open_and_gives_it_back(shards):
    """The chunks' GIL hand-offs must not wait 5 ms each behind a thread importing modules."""
    import sys

    from ninfer.artifact import pinned_reader

    before = sys.getswitchinterval()
    extents = tensor_extents(shards[0])
    with PinnedReader(torch.device("cpu"), threads=2, chunk_bytes=64) as reader:
        assert sys.getswitchinterval() == pytest.approx(min(before, pinned_reader.GIL_SWITCH_SECONDS))
        list(reader.read(extents))
    assert sys.getswitchinterval() == before
    shards_bytes = shards[0].read_bytes()
    shards[0].write_bytes(shards_bytes[:-100])
    try:
        with PinnedReader(torch.device("cpu"), threads=2, chunk_bytes=64) as reader, pytest.raises(OSError):
            list(reader.read(extents))
    finally:
        shards[0].write_bytes(shards_bytes)
    assert sys.getswitchinterval() == before  # also after a failed read


def test_a_truncated_file_is_an_error_naming_the_tensor(shards):
    extents = tensor_extents(shards[0])
    data = shards[0].read_bytes()
    shards[0].write_bytes(data[: len(data) - 100])
    with PinnedReader(torch.device("cpu"), threads=2, chunk_bytes=64) as reader:
        with pytest.raises(OSError, match="ends inside tensor"):
            list(reader.read(extents))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The tiny hybrid model as stored in bf16, Qwen's block-scaled FP8 and ModelOpt NVFP4."""
    from ninfer.testing.tiny_artifacts import make_tiny_qwen3_5
    from ninfer.testing.tiny_quantized import modelopt_nvfp4_copy, qwen_fp8_copy

    root = tmp_path_factory.mktemp("staged")
    source = make_tiny_qwen3_5(root / "bf16")
    return {"bf16": source, "fp8": qwen_fp8_copy(source, root / "fp8"),
            "nvfp4": modelopt_nvfp4_copy(source, root / "nvfp4")}


@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.parametrize("stored", ["bf16", "fp8", "nvfp4"])
def test_weights_read_onto_a_device_equal_the_mapped_ones(checkpoints, stored, keep):
    """The device path (what a GPU load takes, here onto the CPU) yields the mapped path's names
    in its order, every tensor bit for bit, scales before their weights."""
    from ninfer.artifact import open_artifact

    weights = open_artifact(checkpoints[stored]).read_weights.__self__
    options = {"keep_fp8": keep, "keep_nvfp4": keep}
    mapped = list(weights.read(**options))
    staged = list(weights.read(**options, device="cpu"))
    assert [name for name, _ in staged] == [name for name, _ in mapped]
    for (name, expected), (_, got) in zip(mapped, staged):
        assert got.dtype == expected.dtype and got.shape == expected.shape, name
        assert torch.equal(got.reshape(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8)), name


@pytest.mark.parametrize(("device", "quantize", "read_onto"), [
    ("cuda:0", None, "cuda:0"),  # a GPU load reads onto its device
    ("cuda:0", "nvfp4", None),  # quantizing at load keeps the unquantized tensors on the host
    ("cpu", None, None),  # the CPU keeps the memory-mapped tensors
])
def test_a_gpu_load_reads_onto_the_device_unless_it_quantizes(checkpoints, monkeypatch, device, quantize, read_onto):
    from ninfer.artifact import open_artifact
    from ninfer.models import loader

    artifact = open_artifact(checkpoints["bf16"])
    asked = []
    monkeypatch.setattr(artifact, "read_weights", lambda *args, **options: asked.append(options) or iter(()))
    monkeypatch.setattr(loader, "load_model", lambda config, tensors, **options: None)
    artifact.load_model(device=device, quantize=quantize, progress=False)
    assert asked == ([{"device": read_onto}] if read_onto else [{}])


def test_a_dtype_the_reader_does_not_know_keeps_the_mapped_path(checkpoints, monkeypatch):
    from ninfer.artifact import open_artifact
    from ninfer.artifact import pinned_reader

    weights = open_artifact(checkpoints["bf16"]).read_weights.__self__
    monkeypatch.setattr(pinned_reader.PinnedReader, "read", lambda *args: pytest.fail("read through the ring"))
    monkeypatch.delitem(pinned_reader.TORCH_DTYPES, "BF16")
    mapped = dict(weights.read())
    got = dict(weights.read(device="cpu"))
    assert got.keys() == mapped.keys() and all(torch.equal(got[name], mapped[name]) for name in mapped)
