"""Open a GGUF file: metadata -> HF-style config, llama.cpp tensor names -> HF names, dequantization.

llama.cpp stores what an HF directory spreads over config.json, tokenizer.json and the
safetensors files in one file, with its own key and tensor names, quantized blocks, and
(llama architecture only) Q/K rows permuted for its interleaved RoPE. We translate all of
that back so the model files and checkpoint rules see an ordinary HF checkpoint.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, LlamaFileType, ReaderTensor
from gguf.quants import dequantize

from ninfer.artifact.artifact import (
    GGUF,
    MANIFEST_NAME,
    Artifact,
    ArtifactError,
    check_weights,
    read_model_id,
    without_weights,
)
from ninfer.artifact.gguf_tokenizer import GGUFTokenizerError, build_gguf_tokenizer
from ninfer.frontend.tokenizer import Tokenizer
from ninfer.models.config import ConfigError, ModelConfig

if TYPE_CHECKING:
    import torch

# general.architecture -> HF model_type
MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe"}

_DENSE_TYPES = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}
# Block formats gguf.quants can unpack with numpy.
SUPPORTED_TYPES = _DENSE_TYPES | {
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q5_0,
    GGMLQuantizationType.Q5_1,
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q2_K,
    GGMLQuantizationType.Q3_K,
    GGMLQuantizationType.Q4_K,
    GGMLQuantizationType.Q5_K,
    GGMLQuantizationType.Q6_K,
}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
}
# Stacked expert tensors [E, rows, cols] become one HF tensor per expert.
_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_BLOCK_TENSOR = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_ROPE_FREQS = "rope_freqs.weight"

# Known llama3 rope scalings, to recognise the factors llama.cpp bakes into rope_freqs.weight.
_LLAMA3_SCALINGS = tuple(
    {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    for factor in (8.0, 32.0, 16.0)
)


def _metadata(reader: GGUFReader) -> dict[str, Any]:
    return {key: field.contents() for key, field in reader.fields.items()}


def _hf_shape(tensor: ReaderTensor) -> tuple[int, ...]:
    """GGUF lists dimensions innermost first; torch wants them outermost first."""
    return tuple(int(d) for d in reversed(tensor.shape.tolist()))


class _Tensors:
    """The file's tensors under HF names, read and dequantized on demand."""

    def __init__(self, path: Path, reader: GGUFReader, architecture: str, hf_config: dict[str, Any]):
        self.path = path
        self.reader = reader
        self.permute_qk = architecture == "llama"
        self.num_heads = int(hf_config["num_attention_heads"])
        self.num_kv_heads = int(hf_config["num_key_value_heads"])
        # (hf_name, gguf tensor, expert index or None) in file order
        self.entries: list[tuple[str, ReaderTensor, int | None]] = []
        for tensor in reader.tensors:
            if tensor.name == _ROPE_FREQS:
                continue  # folded into the config's rope scaling
            if tensor.tensor_type not in SUPPORTED_TYPES:
                raise ArtifactError(
                    f"{path}: tensor {tensor.name!r} has unsupported type {tensor.tensor_type.name} "
                    f"(supported: {', '.join(sorted(t.name for t in SUPPORTED_TYPES))})"
                )
            self.entries.extend(self._map(tensor))

    def _map(self, tensor: ReaderTensor) -> list[tuple[str, ReaderTensor, int | None]]:
        name = tensor.name
        if name in _GLOBAL_NAMES:
            return [(_GLOBAL_NAMES[name], tensor, None)]
        match = _BLOCK_TENSOR.match(name)
        if match is not None:
            layer, leaf, kind = match.groups()
            if leaf in _BLOCK_NAMES:
                return [(f"model.layers.{layer}.{_BLOCK_NAMES[leaf]}.{kind}", tensor, None)]
            if leaf in _EXPERT_NAMES and kind == "weight":
                num_experts = _hf_shape(tensor)[0]
                return [
                    (f"model.layers.{layer}.mlp.experts.{e}.{_EXPERT_NAMES[leaf]}.weight", tensor, e)
                    for e in range(num_experts)
                ]
        raise ArtifactError(f"{self.path}: unsupported tensor {name!r}")

    def shapes(self) -> Iterator[tuple[str, tuple[int, ...]]]:
        for hf_name, tensor, expert in self.entries:
            shape = _hf_shape(tensor)
            yield hf_name, shape if expert is None else shape[1:]

    def read(self) -> Iterator[tuple[str, torch.Tensor]]:
        stacked: dict[str, torch.Tensor] = {}  # dequantize a stacked expert tensor once
        for hf_name, tensor, expert in self.entries:
            if expert is None:
                yield hf_name, self._dequantize(tensor, hf_name)
                stacked.clear()
                continue
            if tensor.name not in stacked:
                stacked = {tensor.name: self._dequantize(tensor, hf_name)}
            yield hf_name, stacked[tensor.name][expert]

    def _dequantize(self, tensor: ReaderTensor, hf_name: str) -> torch.Tensor:
        import torch  # here, not at the top: opening a GGUF file for its metadata only never needs it

        values = dequantize(tensor.data, tensor.tensor_type)
        if values.dtype != np.float32 or not values.flags.writeable:  # F32/F16 come back as views of the mmap
            values = values.astype(np.float32)
        values = torch.from_numpy(values).reshape(_hf_shape(tensor))
        if self.permute_qk:
            if ".self_attn.q_proj." in hf_name:
                values = _unpermute_rope_rows(values, self.num_heads)
            elif ".self_attn.k_proj." in hf_name:
                values = _unpermute_rope_rows(values, self.num_kv_heads)
        return values


def _unpermute_rope_rows(values: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's llama conversion, which interleaves each head's two rotary halves.

    llama.cpp stored rows per head as (half, pair) where HF has (pair, half).
    """
    half = values.shape[0] // num_heads // 2
    rest = values.shape[1:]
    return values.reshape(num_heads, half, 2, *rest).transpose(1, 2).reshape(values.shape)


def _llama3_scaling_from_factors(factors: np.ndarray, rope_theta: float, head_dim: int) -> dict[str, Any] | None:
    """Which known llama3 scaling divides the frequencies by exactly these factors, if any."""
    inv_freq = 1.0 / (rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if factors.shape != inv_freq.shape:
        return None
    for scaling in _LLAMA3_SCALINGS:
        old_context = scaling["original_max_position_embeddings"]
        low, high, factor = scaling["low_freq_factor"], scaling["high_freq_factor"], scaling["factor"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_context / wavelen - low) / (high - low)
        expected = np.where(
            wavelen < old_context / high,
            1.0,
            np.where(wavelen > old_context / low, factor, 1 / ((1 - smooth) / factor + smooth)),
        )
        if np.allclose(factors, expected, rtol=1e-4):
            return dict(scaling)
    return None


def _hf_config(path: Path, metadata: dict[str, Any], reader: GGUFReader) -> dict[str, Any]:
    architecture = metadata.get("general.architecture")
    model_type = MODEL_TYPES.get(architecture)
    if model_type is None:
        raise ArtifactError(
            f"{path}: unsupported GGUF architecture {architecture!r} (supported: {', '.join(MODEL_TYPES)})"
        )
    tensors = {t.name: t for t in reader.tensors}

    def key(name: str, default: Any = ...) -> Any:
        value = metadata.get(f"{architecture}.{name}", default)
        if value is ...:
            raise ArtifactError(f"{path}: missing metadata {architecture}.{name}")
        if isinstance(value, list):  # per-layer arrays: only uniform ones describe our models
            if len(set(value)) != 1:
                raise ArtifactError(f"{path}: per-layer {architecture}.{name} values are not supported")
            value = value[0]
        return value

    if "token_embd.weight" not in tensors:
        raise ArtifactError(f"{path}: no token_embd.weight tensor")
    hidden = int(key("embedding_length"))
    num_heads = int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", hidden // num_heads))
    rope_dim = key("rope.dimension_count", None)
    if rope_dim is not None and int(rope_dim) != head_dim:
        raise ArtifactError(f"{path}: partial rotary ({rope_dim} of {head_dim} dims) is not supported")
    rope_theta = float(key("rope.freq_base", 10000.0))
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": rope_theta}
    scaling_type = key("rope.scaling.type", "none")
    if scaling_type == "linear":
        rope = {"rope_type": "linear", "rope_theta": rope_theta, "factor": float(key("rope.scaling.factor"))}
    elif scaling_type != "none":
        raise ArtifactError(f"{path}: unsupported rope scaling {architecture}.rope.scaling.type={scaling_type!r}")
    if _ROPE_FREQS in tensors:
        factors = np.asarray(dequantize(tensors[_ROPE_FREQS].data, tensors[_ROPE_FREQS].tensor_type), np.float64)
        scaling = _llama3_scaling_from_factors(factors.reshape(-1), rope_theta, head_dim)
        if scaling is None:
            raise ArtifactError(f"{path}: {_ROPE_FREQS} does not match a supported llama3 rope scaling")
        rope = {**scaling, "rope_theta": rope_theta}

    hf: dict[str, Any] = {
        "model_type": model_type,
        "vocab_size": _hf_shape(tensors["token_embd.weight"])[0],
        "hidden_size": hidden,
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(key("attention.head_count_kv", num_heads)),
        "head_dim": head_dim,
        "max_position_embeddings": int(key("context_length", 4096)),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_parameters": rope,
        "hidden_act": "silu",
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        # llama.cpp writes output.weight only when it differs from the embedding
        "tie_word_embeddings": "output.weight" not in tensors,
        "torch_dtype": _torch_dtype(metadata.get("general.file_type")),
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
    }
    feed_forward = key("feed_forward_length", None)
    if feed_forward is not None:
        hf["intermediate_size"] = int(feed_forward)
    if model_type == "qwen3_moe":
        layers = range(hf["num_hidden_layers"])
        hf.update(
            num_experts=int(key("expert_count")),
            num_experts_per_tok=int(key("expert_used_count")),
            moe_intermediate_size=int(key("expert_feed_forward_length")),
            # llama.cpp always renormalises the routed weights for qwen3moe
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[i for i in layers if f"blk.{i}.ffn_gate_inp.weight" not in tensors],
        )
    return hf


def _torch_dtype(file_type: Any) -> str:
    """Unquantized files keep their dtype; dequantized blocks load as bfloat16 by default."""
    if file_type == LlamaFileType.ALL_F32:
        return "float32"
    if file_type == LlamaFileType.MOSTLY_F16:
        return "float16"
    return "bfloat16"


def _generation_defaults(metadata: dict[str, Any]) -> dict[str, Any]:
    defaults: dict[str, Any] = {}
    for key, name in (
        ("general.sampling.temp", "temperature"),
        ("general.sampling.top_p", "top_p"),
        ("general.sampling.top_k", "top_k"),
        ("general.sampling.min_p", "min_p"),
        ("general.sampling.penalty_repeat", "repetition_penalty"),
    ):
        if key in metadata:
            defaults[name] = metadata[key]
    # end-of-generation: eos plus the end-of-turn / end-of-message tokens llama.cpp also stops on
    stop_ids = [
        int(metadata[key])
        for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
        if metadata.get(key) is not None
    ]
    if stop_ids:
        defaults["eos_token_id"] = list(dict.fromkeys(stop_ids))
    if metadata.get("tokenizer.ggml.bos_token_id") is not None:
        defaults["bos_token_id"] = int(metadata["tokenizer.ggml.bos_token_id"])
    return defaults


def open_gguf(path: Path, weights: bool = True) -> Artifact:
    """weights=False: config, tokenizer and template only; no tensor is read or checked."""
    try:
        reader = GGUFReader(path)
    # gguf's reader reports a malformed or truncated file with whatever indexing error it hits
    except (OSError, ValueError, IndexError, KeyError) as error:
        raise ArtifactError(f"{path}: not a readable GGUF file ({error})") from error
    metadata = _metadata(reader)
    hf_config = _hf_config(path, metadata, reader)
    try:
        config = ModelConfig.from_hf(hf_config, source=str(path))
    except ConfigError as error:
        raise ArtifactError(str(error)) from error
    tensors = None
    if weights:
        tensors = _Tensors(path, reader, metadata["general.architecture"], hf_config)
        check_weights(config, tensors.shapes(), str(path))

    try:
        backend, tokenizer_config = build_gguf_tokenizer(metadata)
    except GGUFTokenizerError as error:
        raise ArtifactError(f"{path}: {error}") from error
    chat_template = metadata.get("tokenizer.chat_template")
    if chat_template is not None:
        tokenizer_config["chat_template"] = chat_template
    tokenizer = Tokenizer(
        backend,
        bos_token=tokenizer_config["bos_token"],
        eos_token=tokenizer_config["eos_token"],
        pad_token=tokenizer_config["pad_token"],
        add_bos_token=tokenizer_config["add_bos_token"],
        config=tokenizer_config,
    )
    return Artifact(
        path=path,
        kind=GGUF,
        model_id=read_model_id(path.with_name(f"{path.name}.{MANIFEST_NAME}"), path.stem),
        hf_config=hf_config,
        config=config,
        tokenizer=tokenizer,
        chat_template=chat_template,
        generation_defaults=_generation_defaults(metadata),
        num_tensors=0 if tensors is None else len(tensors.entries),
        read_weights=without_weights(path) if tensors is None else tensors.read,
    )
