"""Open a Hugging Face model directory: config.json, safetensors (single or sharded), tokenizer, template."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from ninfer.artifact.artifact import (
    HF_DIRECTORY,
    MANIFEST_NAME,
    Artifact,
    ArtifactError,
    check_weights,
    read_json,
    read_model_id,
)
from ninfer.frontend.tokenizer import Tokenizer
from ninfer.kernels.nvfp4_gemv import dequantize_nvfp4
from ninfer.models.config import ConfigError, ModelConfig
from ninfer.models.loader import NVFP4_BLOCK_SUFFIX, NVFP4_GLOBAL_SUFFIX

log = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Keys of generation_config.json that are bookkeeping, not defaults.
_GENERATION_BOOKKEEPING = ("transformers_version", "_from_model_config")


_SCALE_SUFFIX = "_scale_inv"
HF_QUANT_CONFIG = "hf_quant_config.json"  # ModelOpt's quantization description beside config.json
# ModelOpt NVFP4: each uint8 weight of e2m1 codes has these companions (input_scale: W4A4 only).
_NVFP4_COMPANIONS = (NVFP4_BLOCK_SUFFIX, NVFP4_GLOBAL_SUFFIX, "input_scale")


def fp8_block_size(hf_config: dict[str, Any]) -> tuple[int, int] | None:
    """Qwen's FP8 checkpoints: e4m3 weights with one inverse scale per weight_block_size block."""
    quant = _quantization_config(hf_config)
    if quant is None or quant.get("quant_method") != "fp8":
        return None
    block = quant.get("weight_block_size") or [128, 128]
    return int(block[0]), int(block[1])


def _quantization_config(hf_config: dict[str, Any]) -> dict[str, Any] | None:
    text = hf_config.get("text_config") if isinstance(hf_config.get("text_config"), dict) else {}
    quant = hf_config.get("quantization_config") or text.get("quantization_config")
    return quant if isinstance(quant, dict) else None


def nvfp4_checkpoint(hf_config: dict[str, Any], directory: Path) -> bool:
    """Whether the directory holds a ModelOpt NVFP4 checkpoint (config.json's quantization_config
    with quant_method "modelopt", or hf_quant_config.json); other ModelOpt algorithms and group
    sizes other than 16 are refused, naming the file."""
    quant = _quantization_config(hf_config)
    source = directory / "config.json"
    if quant is not None and quant.get("quant_method") == "modelopt":
        settings = quant
    elif (directory / HF_QUANT_CONFIG).is_file():
        source = directory / HF_QUANT_CONFIG
        data = read_json(source)
        settings = data.get("quantization") if isinstance(data, dict) else None
        if not isinstance(settings, dict):
            raise ArtifactError(f'{source}: needs a "quantization" object')
    else:
        return False
    algorithm = settings.get("quant_algo")
    if algorithm != "NVFP4":
        raise ArtifactError(f"{source}: ModelOpt quant_algo {algorithm!r} is not supported (NVFP4 is)")
    group_size = settings.get("group_size", 16)
    if group_size != 16:
        raise ArtifactError(f"{source}: NVFP4 group_size {group_size!r}; only 16 (the format's block) is supported")
    return True


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
        self, keep_fp8: bool = False, only: Callable[[str], bool] | None = None, keep_nvfp4: bool = False
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """keep_fp8: yield each fp8_weights entry as stored, right after its `_scale_inv` scales;
        otherwise block-scaled weights come dequantized exactly to bf16. keep_nvfp4: likewise
        each NVFP4 weight after its `_scale` and `_scale_2`; otherwise dequantized (fp32 products,
        rounded once to bf16).
        only: read just the tensors whose names it accepts (e.g. the vision tower's)."""
        file_of = {name: file for file, names in self.names_by_file.items() for name in names}
        kept = self.fp8_weights if keep_fp8 else {}
        nvfp4 = self.nvfp4_weights
        wanted = set(self.names)
        for file, names in self.names_by_file.items():
            names = [name for name in names if name in wanted and (only is None or only(name))]
            if not names:
                continue
            with safe_open(file, framework="pt", device="cpu") as handle:
                for name in names:
                    tensor = handle.get_tensor(name)
                    if name in nvfp4:
                        yield from self._read_nvfp4(name, tensor, file_of, keep_nvfp4)
                        continue
                    scale_name = name + _SCALE_SUFFIX
                    if self.fp8_block is not None and scale_name in file_of:
                        with safe_open(file_of[scale_name], framework="pt", device="cpu") as scales:
                            scale = scales.get_tensor(scale_name)
                        if name in kept:
                            yield scale_name, scale
                        else:
                            tensor = dequantize_block_fp8(tensor, scale, self.fp8_block)
                    yield name, tensor

    def _read_nvfp4(
        self, name: str, codes: torch.Tensor, file_of: dict[str, Path], keep: bool
    ) -> Iterator[tuple[str, torch.Tensor]]:
        scales = {}
        for suffix in (NVFP4_BLOCK_SUFFIX, NVFP4_GLOBAL_SUFFIX):
            with safe_open(file_of[name + suffix], framework="pt", device="cpu") as handle:
                scales[suffix] = handle.get_tensor(name + suffix)
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


def _tokenizer(directory: Path) -> tuple[Tokenizer, dict[str, Any]]:
    tokenizer_json = directory / "tokenizer.json"
    if not tokenizer_json.is_file():
        raise ArtifactError(f"{tokenizer_json}: missing (the artifact needs a tokenizers-format tokenizer.json)")
    config_path = directory / "tokenizer_config.json"
    tokenizer_config: dict[str, Any] = {}
    if config_path.is_file():
        tokenizer_config = read_json(config_path)
        if not isinstance(tokenizer_config, dict):
            raise ArtifactError(f"{config_path}: expected a JSON object")
    try:
        tokenizer = Tokenizer.from_files(tokenizer_json, tokenizer_config)
    except Exception as error:  # tokenizers signals every parse problem with a bare Exception
        raise ArtifactError(f"{tokenizer_json}: cannot load tokenizer ({error})") from error
    return tokenizer, tokenizer_config


def _chat_template(directory: Path, tokenizer_config: dict[str, Any]) -> str | None:
    """chat_template.jinja wins over tokenizer_config.json's chat_template, as in transformers."""
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        try:
            # bytes, not read_text: universal newlines would rewrite \r\n inside the template
            return jinja.read_bytes().decode("utf-8")
        except UnicodeDecodeError as error:
            raise ArtifactError(f"{jinja}: not UTF-8 ({error})") from error
    template = tokenizer_config.get("chat_template")
    source = directory / "tokenizer_config.json"
    if template is None:
        legacy = directory / "chat_template.json"  # processor-style artifacts
        if not legacy.is_file():
            return None
        data = read_json(legacy)
        template, source = (data.get("chat_template") if isinstance(data, dict) else None), legacy
    if isinstance(template, str):
        return template
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise ArtifactError(f'{source}: named chat templates {sorted(map(str, named))} include no "default"')
    raise ArtifactError(f"{source}: chat_template must be a string or a list of named templates")


def _generation_defaults(directory: Path, config: ModelConfig) -> dict[str, Any]:
    path = directory / "generation_config.json"
    defaults: dict[str, Any] = {}
    if path.is_file():
        data = read_json(path)
        if not isinstance(data, dict):
            raise ArtifactError(f"{path}: expected a JSON object")
        defaults = {k: v for k, v in data.items() if k not in _GENERATION_BOOKKEEPING}
    eos = defaults.get("eos_token_id", list(config.eos_token_id) or None)
    if eos is not None:
        defaults["eos_token_id"] = [int(t) for t in (eos if isinstance(eos, list) else [eos])]
    return defaults


def open_hf_directory(directory: Path) -> Artifact:
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ArtifactError(f"{config_path}: missing (not a Hugging Face model directory)")
    hf_config = read_json(config_path)
    if not isinstance(hf_config, dict):
        raise ArtifactError(f"{config_path}: expected a JSON object")
    try:
        config = ModelConfig.from_hf(hf_config, source=str(config_path))
    except ConfigError as error:
        raise ArtifactError(str(error)) from error

    weights = SafetensorsWeights(directory, fp8_block_size(hf_config), nvfp4_checkpoint(hf_config, directory))
    if config.mtp_num_hidden_layers and not any(name.startswith("mtp.") for name in weights.shapes):
        # Published checkpoints often strip the MTP head; serve without speculative MTP.
        log.info(
            "%s: config declares %d MTP layers but holds no mtp.* tensors; loading without MTP",
            directory,
            config.mtp_num_hidden_layers,
        )
        config = config.replace(mtp_num_hidden_layers=0)
    check_weights(config, weights.logical_shapes(), str(directory))

    tokenizer, tokenizer_config = _tokenizer(directory)
    return Artifact(
        path=directory,
        kind=HF_DIRECTORY,
        model_id=read_model_id(directory / MANIFEST_NAME, directory.name),
        hf_config=hf_config,
        config=config,
        tokenizer=tokenizer,
        chat_template=_chat_template(directory, tokenizer_config),
        generation_defaults=_generation_defaults(directory, config),
        num_tensors=len(weights.names),
        read_weights=weights.read,
        fp8_weights=weights.fp8_weights,
        nvfp4_weights=weights.nvfp4_weights,
    )
