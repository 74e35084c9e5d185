"""Open a Hugging Face model directory: config.json, safetensors (single or sharded), tokenizer, template."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ninfer.artifact.artifact import (
    HF_DIRECTORY,
    MANIFEST_NAME,
    Artifact,
    ArtifactError,
    check_weights,
    read_json,
    read_model_id,
    without_weights,
)
from ninfer.frontend.tokenizer import Tokenizer
from ninfer.models.config import ConfigError, ModelConfig

if TYPE_CHECKING:
    from ninfer.artifact.safetensors_weights import SafetensorsWeights

log = logging.getLogger(__name__)

# Keys of generation_config.json that are bookkeeping, not defaults.
_GENERATION_BOOKKEEPING = ("transformers_version", "_from_model_config")

HF_QUANT_CONFIG = "hf_quant_config.json"  # ModelOpt's quantization description beside config.json


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


def open_hf_directory(directory: Path, weights: bool = True) -> Artifact:
    """weights=False: config, tokenizer and template only; no tensor is read or checked."""
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
    stored = None
    if weights:
        stored, config = _checked_weights(directory, hf_config, config)

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
        num_tensors=0 if stored is None else len(stored.names),
        read_weights=without_weights(directory) if stored is None else stored.read,
        reads_to_device=stored is not None,
        fp8_weights={} if stored is None else stored.fp8_weights,
        nvfp4_weights={} if stored is None else stored.nvfp4_weights,
    )


def _checked_weights(
    directory: Path, hf_config: dict[str, Any], config: ModelConfig
) -> tuple[SafetensorsWeights, ModelConfig]:
    """The stored tensors, dry-run against the model, and the config (without an MTP head the checkpoint lacks)."""
    # Imported here: reading tensors needs torch, which a metadata-only open never imports.
    from ninfer.artifact.safetensors_weights import SafetensorsWeights

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
    return weights, config
