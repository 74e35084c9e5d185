"""A Hugging Face directory's safetensors weights: names and shapes from the headers, data read lazily.

Reading tensors needs torch: an artifact opened for its metadata only (the API process) never
imports this module.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ninfer.artifact.artifact import ArtifactError, read_json
from ninfer.artifact.pinned_reader import TORCH_DTYPES, PinnedReader, reader_threads, tensor_extents
from ninfer.kernels.nvfp4_gemv import dequantize_nvfp4
from ninfer.models.checkpoint_scales import NVFP4_BLOCK_SUFFIX, NVFP4_GLOBAL_SUFFIX

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SCALE_SUFFIX = "_scale_inv"
# ModelOpt NVFP4: each uint8 weight of e2m1 codes has these companions (input_scale: W4A4 only).
_NVFP4_COMPANIONS = (NVFP4_BLOCK_SUFFIX, NVFP4_GLOBAL_SUFFIX, "input_scale")


def dequantize_block_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """weight [out, in] e4m3, scale_inv [ceil(out/b0), ceil(in/b1)] -> bf16 weight * scale of its block."""
    rows, cols = weight.shape[-2:]
    scale = scale_inv.float().repeat_interleave(block[0], dim=-2)[..., :rows, :]
    scale = scale.repeat_interleave(block[1], dim=-1)[..., :cols]
    return (weight.float() * scale).to(torch.bfloat16)


class SafetensorsWeights:
    """Tensor names and shapes from the safetensors headers; data read lazily (mmap) by file.

    Block-scaled FP8 checkpoints are dequantized exactly to bf16 as they are read: the
    inverse-scale tensors are consumed with their weights and never reach the model.
    """

    def __init__(self, directory: Path, fp8_block: tuple[int, int] | None = None, nvfp4: bool = False):
        self.fp8_block = fp8_block
        self.nvfp4 = nvfp4
        self.names_by_file: dict[Path, list[str]] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, str] = {}
        index_path = directory / INDEX_FILE
        if index_path.is_file():
            self._read_index(index_path)
        elif (directory / SINGLE_FILE).is_file():
            file = directory / SINGLE_FILE
            self.names_by_file[file] = list(self._read_header(file))
        else:
            raise ArtifactError(
                f"{directory}: no {SINGLE_FILE} or {INDEX_FILE} (only safetensors weights are supported)"
            )

    def _read_index(self, index_path: Path) -> None:
        index = read_json(index_path)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ArtifactError(f'{index_path}: no "weight_map" of tensor name -> shard file')
        for name, shard in weight_map.items():
            self.names_by_file.setdefault(index_path.parent / str(shard), []).append(name)
        for file, names in self.names_by_file.items():
            if not file.is_file():
                raise ArtifactError(f"{index_path}: shard {file.name!r} is missing")
            stored = self._read_header(file)
            absent = [name for name in names if name not in stored]
            if absent:
                raise ArtifactError(f"{file}: lacks {len(absent)} tensors listed in {INDEX_FILE}, e.g. {absent[0]!r}")

    def _read_header(self, file: Path) -> set[str]:
        try:
            with safe_open(file, framework="pt", device="cpu") as handle:
                names = set(handle.keys())
                for name in names:
                    tensor_slice = handle.get_slice(name)
                    self.shapes[name] = tuple(tensor_slice.get_shape())
                    self.dtypes[name] = tensor_slice.get_dtype()
        except (SafetensorError, OSError) as error:
            raise ArtifactError(f"{file}: unreadable safetensors file ({error})") from error
        return names

    @property
    def names(self) -> list[str]:
        names = [name for names in self.names_by_file.values() for name in names]
        if self.fp8_block is not None:
            names = [name for name in names if not name.endswith(_SCALE_SUFFIX)]
        if self.nvfp4:
            companions = {f"{weight}{suffix}" for weight in self.nvfp4_weights for suffix in _NVFP4_COMPANIONS}
            companions |= {weight.removesuffix("weight") + "input_scale" for weight in self.nvfp4_weights}
            names = [name for name in names if name not in companions]
        return names

    @property
    def nvfp4_weights(self) -> dict[str, tuple[int, ...]]:
        """NVFP4 weights (uint8 codes with both scales) -> their unpacked shape [.., out, in]."""
        if not self.nvfp4:
            return {}
        return {
            name: (*shape[:-1], shape[-1] * 2)
            for name, shape in self.shapes.items()
            if self.dtypes[name] == "U8"
            and name + NVFP4_BLOCK_SUFFIX in self.shapes
            and name + NVFP4_GLOBAL_SUFFIX in self.shapes
        }

    def logical_shapes(self) -> Iterator[tuple[str, tuple[int, ...]]]:
        """(name, shape) of every weight the model reads, NVFP4 ones unpacked."""
        nvfp4 = self.nvfp4_weights
        for name in self.names:
            yield name, nvfp4.get(name, self.shapes[name])

    @property
    def fp8_weights(self) -> dict[str, tuple[int, ...]]:
        """Block-scaled e4m3 weights the model can keep in FP8 (128 x 128 blocks, what the GEMV takes)."""
        if self.fp8_block != (128, 128):
            return {}
        stored = set(self.shapes)
        return {name: self.shapes[name] for name in self.names if name + _SCALE_SUFFIX in stored}

    def read(
        self,
        keep_fp8: bool = False,
        only: Callable[[str], bool] | None = None,
        keep_nvfp4: bool = False,
        device: torch.device | str | None = None,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """keep_fp8: yield each fp8_weights entry as stored, right after its `_scale_inv` scales;
        otherwise block-scaled weights come dequantized exactly to bf16. keep_nvfp4: likewise
        each NVFP4 weight after its `_scale` and `_scale_2`; otherwise dequantized (fp32 products,
        rounded once to bf16).
        only: read just the tensors whose names it accepts (e.g. the vision tower's).
        device: yield every tensor on this device, read by threads through pinned chunks
        (pinned_reader.py; companions such as scales are moved there too); None: tensors
        memory-mapped on the CPU."""
        file_of = {name: file for file, names in self.names_by_file.items() for name in names}
        kept = self.fp8_weights if keep_fp8 else {}
        nvfp4 = self.nvfp4_weights
        wanted = set(self.names)
        order = [
            (file, name)
            for file, names in self.names_by_file.items()
            for name in names
            if name in wanted and (only is None or only(name))
        ]
        device = None if device is None else torch.device(device)
        stored = self._mapped(order) if device is None else self._read_onto(order, device)
        for name, tensor in stored:
            if name in nvfp4:
                yield from self._read_nvfp4(name, tensor, file_of, keep_nvfp4, device)
                continue
            scale_name = name + _SCALE_SUFFIX
            if self.fp8_block is not None and scale_name in file_of:
                scale = _read_one(file_of[scale_name], scale_name, device)
                if name in kept:
                    yield scale_name, scale
                else:
                    tensor = dequantize_block_fp8(tensor, scale, self.fp8_block)
            yield name, tensor

    @staticmethod
    def _mapped(order: list[tuple[Path, str]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors memory-mapped, one file open at a time."""
        for file, entries in itertools.groupby(order, key=lambda entry: entry[0]):
            with safe_open(file, framework="pt", device="cpu") as handle:
                for _, name in entries:
                    yield name, handle.get_tensor(name)

    @staticmethod
    def _read_onto(order: list[tuple[Path, str]], device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors on `device`, read by threads through pinned chunks (memory-mapped, for the
        loader to copy, when a tensor's dtype is one the reader does not know)."""
        extents = {}
        for file in dict.fromkeys(file for file, _ in order):
            extents.update({(file, extent.name): extent for extent in tensor_extents(file)})
        if any(extents[key].dtype not in TORCH_DTYPES for key in order):
            yield from SafetensorsWeights._mapped(order)
            return
        with PinnedReader(device, threads=reader_threads()) as reader:
            for extent, raw in reader.read(extents[key] for key in order):
                yield extent.name, extent.view(raw)

    def _read_nvfp4(
        self, name: str, codes: torch.Tensor, file_of: dict[str, Path], keep: bool, device: torch.device | None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        scales = {
            suffix: _read_one(file_of[name + suffix], name + suffix, device)
            for suffix in (NVFP4_BLOCK_SUFFIX, NVFP4_GLOBAL_SUFFIX)
        }
        if keep:
            for suffix, scale in scales.items():
                yield name + suffix, scale
            yield name, codes
            return
        flat = codes.reshape(-1, codes.shape[-1])
        rows = flat.shape[0]
        row_scale = scales[NVFP4_GLOBAL_SUFFIX].float().reshape(-1)[:1].expand(rows)
        dense = dequantize_nvfp4(flat, scales[NVFP4_BLOCK_SUFFIX].reshape(rows, -1), row_scale)
        yield name, dense.reshape(*codes.shape[:-1], codes.shape[-1] * 2).to(torch.bfloat16)


def _read_one(file: Path, name: str, device: torch.device | None) -> torch.Tensor:
    """One small companion tensor (scales), on `device` (None: memory-mapped)."""
    with safe_open(file, framework="pt", device="cpu") as handle:
        tensor = handle.get_tensor(name)
    return tensor if device is None else tensor.to(device)
