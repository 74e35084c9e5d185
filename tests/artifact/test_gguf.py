"""GGUF artifacts: tiny files written with gguf.GGUFWriter, checked against transformers' GGUF loader.

Each file holds a random transformers model in llama.cpp's layout (llama.cpp tensor names,
Q/K rows permuted for the llama architecture, some tensors quantized) and a small byte-level
BPE tokenizer. Both sides dequantize the same blocks, so fp32 logits agree to 2e-5.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import pytest
import tokenizers
import torch
from gguf import GGMLQuantizationType as QType
from tokenizers import pre_tokenizers
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from ninfer.artifact import Artifact, ArtifactError, open_artifact
from ninfer.models.causal_lm import CausalLM
from ninfer.models.forward_batch import ForwardBatch

FP32_ATOL = 2e-5
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_DEFINED = "<think>"
# \r\n and a non-ASCII character check that the template comes back byte for byte
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\r\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}{# café #}"
)
CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "Hello world! Hello there, how are you doing today?",
    "def main():\n    return 12345 + 678\n\n",
    "Numbers like 2024 and 3.14159 appear in text; so do words like don't and it's.",
    "Unicode: café, naïve, Ünïcödé, 日本語のテキスト, emoji 🙂.",
] * 4
TEXTS = [
    "Hello world",
    "The capital of France is Paris.",
    "  two  spaces\n\nnew lines\tand a tab",
    "don't stop 12345 café 日本 🙂",
    "<|im_start|>user\nhi<|im_end|>\n",
    "think: <think>maybe</think>",
]
SMALL = {
    "vocab_size": 0,  # set to the tokenizer's size
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
}


@dataclass(frozen=True)
class Vocabulary:
    tokens: list[str]
    merges: list[str]
    token_types: list[int]


@pytest.fixture(scope="module")
def vocabulary() -> Vocabulary:
    backend = tokenizers.Tokenizer(BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = BpeTrainer(
        vocab_size=400,
        special_tokens=[*SPECIALS, USER_DEFINED, "</think>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS, trainer)
    model = json.loads(backend.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    assert [model["vocab"][t] for t in tokens] == list(range(len(tokens)))
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    token_types = [
        gguf.TokenType.CONTROL
        if t in SPECIALS
        else gguf.TokenType.USER_DEFINED
        if t in (USER_DEFINED, "</think>")
        else gguf.TokenType.NORMAL
        for t in tokens
    ]
    return Vocabulary(tokens, merges, [int(t) for t in token_types])


def _randomize(model: nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * noise)
            elif param.dim() == 1:
                param.copy_(0.1 * noise)
            else:
                param.copy_(noise / param.shape[-1] ** 0.5)


def _llama_cpp_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to llama q/k rows (its rope pairs adjacent dims)."""
    half = weights.shape[0] // num_heads // 2
    return weights.reshape(num_heads, 2, half, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def _gguf_tensors(model: PreTrainedModel, arch: gguf.MODEL_ARCH) -> dict[str, np.ndarray]:
    """The model's state dict under llama.cpp names (gguf's own name map), experts stacked."""
    config = model.config
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    tensors: dict[str, np.ndarray] = {}
    for hf_name, value in model.state_dict().items():
        value = value.float().numpy()
        if hf_name.endswith("experts.gate_up_proj"):
            base = hf_name.removesuffix("gate_up_proj")
            gate, up = np.split(value, 2, axis=1)
            parts = {f"{base}gate_proj.weight": gate, f"{base}up_proj.weight": up}
        elif hf_name.endswith("experts.down_proj"):
            parts = {f"{hf_name}.weight": value}
        else:
            parts = {hf_name: value}
        for name, part in parts.items():
            if name == "lm_head.weight" and config.tie_word_embeddings:
                continue
            gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
            assert gguf_name is not None, name
            if arch == gguf.MODEL_ARCH.LLAMA and ".attn_q." in gguf_name:
                part = _llama_cpp_permute(part, config.num_attention_heads)
            elif arch == gguf.MODEL_ARCH.LLAMA and ".attn_k." in gguf_name:
                part = _llama_cpp_permute(part, config.num_key_value_heads)
            tensors[gguf_name] = np.ascontiguousarray(part)
    return tensors


def write_gguf(
    path: Path,
    model: PreTrainedModel,
    vocabulary: Vocabulary,
    *,
    arch: gguf.MODEL_ARCH,
    pre: str,
    quantize: Callable[[str], QType] = lambda name: QType.F32,
    metadata: Callable[[gguf.GGUFWriter], None] = lambda writer: None,
    tokenizer_model: str = "gpt2",
    drop: tuple[str, ...] = (),
    architecture: str | None = None,  # general.architecture, when it should differ from arch's
) -> Path:
    config = model.config
    writer = gguf.GGUFWriter(str(path), architecture or gguf.MODEL_ARCH_NAMES[arch])
    writer.add_name(path.stem)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if arch == gguf.MODEL_ARCH.QWEN3MOE:
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(vocabulary.tokens)
    writer.add_token_types(vocabulary.token_types)
    writer.add_token_merges(vocabulary.merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_add_space_prefix(False)  # as llama.cpp writes for byte-level vocabularies
    writer.add_chat_template(TEMPLATE)
    metadata(writer)
    for name, values in _gguf_tensors(model, arch).items():
        if name in drop:
            continue
        qtype = quantize(name) if values.ndim > 1 else QType.F32
        if qtype == QType.F32:
            writer.add_tensor(name, values.astype(np.float32))
        elif qtype == QType.F16:
            writer.add_tensor(name, values.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _q8_matrices(name: str) -> QType:
    return QType.Q8_0 if name.startswith("blk.") else QType.F32


def _q4_1_all(name: str) -> QType:
    return QType.Q4_1


@dataclass
class Case:
    make: Callable[[int], tuple[type[PreTrainedModel], object]]
    arch: gguf.MODEL_ARCH
    pre: str
    quantize: Callable[[str], QType]


CASES = {
    # all F32: the file's logits must also equal the original model's (permutation round trip)
    "llama": Case(
        lambda v: (LlamaForCausalLM, LlamaConfig(**{**SMALL, "vocab_size": v})),
        gguf.MODEL_ARCH.LLAMA,
        "gpt-2",
        lambda name: QType.F32,
    ),
    "qwen2": Case(
        lambda v: (Qwen2ForCausalLM, Qwen2Config(**{**SMALL, "vocab_size": v}, tie_word_embeddings=True)),
        gguf.MODEL_ARCH.QWEN2,
        "qwen2",
        _q8_matrices,
    ),
    # transformers' GGUF reader ignores key_length for qwen3, so keep Qwen3Config's default
    # head_dim 128 (!= hidden / heads, as in the real models)
    "qwen3": Case(
        lambda v: (Qwen3ForCausalLM, Qwen3Config(**{**SMALL, "vocab_size": v}, head_dim=128)),
        gguf.MODEL_ARCH.QWEN3,
        "qwen2",
        _q4_1_all,
    ),
    # likewise it ignores expert_feed_forward_length: keep the default moe_intermediate_size 768
    "qwen3moe": Case(
        lambda v: (
            Qwen3MoeForCausalLM,
            Qwen3MoeConfig(
                **{**SMALL, "vocab_size": v},
                head_dim=16,
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=768,
            ),
        ),
        gguf.MODEL_ARCH.QWEN3MOE,
        "qwen2",
        _q8_matrices,
    ),
}


@dataclass
class Written:
    path: Path
    source: PreTrainedModel
    artifact: Artifact
    ours: CausalLM


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory, vocabulary: Vocabulary) -> dict[str, Written]:
    out = {}
    for seed, (name, case) in enumerate(CASES.items()):
        cls, config = case.make(len(vocabulary.tokens))
        source = cls(config).eval()
        _randomize(source, seed)
        path = write_gguf(
            tmp_path_factory.mktemp(name) / f"tiny-{name}.gguf",
            source,
            vocabulary,
            arch=case.arch,
            pre=case.pre,
            quantize=case.quantize,
        )
        artifact = open_artifact(path)
        out[name] = Written(path, source, artifact, artifact.load_model(dtype=torch.float32, progress=False))
    return out


def _logits(model: CausalLM, ids: torch.Tensor) -> torch.Tensor:
    kv_cache, _ = model.allocate_caches(-(-len(ids) // 8), 8, 0)
    pages = torch.arange(kv_cache.num_pages)[None]
    batch = ForwardBatch.build([len(ids)], [0], pages, [0], kv_cache, None, logits_indices=list(range(len(ids))))
    with torch.no_grad():
        return model.compute_logits(model(ids, batch)).float()


def _prompt(vocab_size: int, length: int = 12) -> torch.Tensor:
    return torch.randint(0, vocab_size, (length,), generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_transformers_gguf_loader(written: dict[str, Written], name: str) -> None:
    w = written[name]
    reference = AutoModelForCausalLM.from_pretrained(str(w.path.parent), gguf_file=w.path.name).eval()
    ids = _prompt(w.artifact.config.vocab_size)
    with torch.no_grad():
        expected = reference(ids[None]).logits[0].float()
    assert expected.abs().max() > 1.0
    torch.testing.assert_close(_logits(w.ours, ids), expected, atol=FP32_ATOL, rtol=0)


def test_llama_qk_permutation_round_trips(written: dict[str, Written]) -> None:
    w = written["llama"]  # F32 file: nothing lost, so it equals the model it was written from
    ids = _prompt(w.artifact.config.vocab_size)
    with torch.no_grad():
        expected = w.source(ids[None]).logits[0]
    torch.testing.assert_close(_logits(w.ours, ids), expected, atol=FP32_ATOL, rtol=0)


def test_quantized_tensors_are_dequantized(written: dict[str, Written]) -> None:
    w = written["qwen3"]  # Q4_1 matrices: close to, not equal to, the source weights
    weights = dict(w.artifact.weights())
    q = weights["model.layers.0.self_attn.q_proj.weight"]
    source = w.source.model.layers[0].self_attn.q_proj.weight
    assert q.dtype == torch.float32 and q.shape == source.shape
    assert 0 < (q - source).abs().max() < 0.25 * source.abs().max()


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_tokenizer_matches_transformers_gguf_tokenizer(written: dict[str, Written], name: str) -> None:
    w = written[name]
    reference = AutoTokenizer.from_pretrained(str(w.path.parent), gguf_file=w.path.name)
    for text in TEXTS:
        if USER_DEFINED in text:
            # transformers' GGUF converters drop user-defined tokens; llama.cpp (and we) match
            # them whole, checked in the next test
            continue
        ids = w.artifact.tokenizer.encode(text)
        assert ids == reference(text, add_special_tokens=False)["input_ids"], text
        assert w.artifact.tokenizer.decode(ids) == reference.decode(ids) == text


def test_tokenizer_special_and_user_defined_tokens(written: dict[str, Written], vocabulary: Vocabulary) -> None:
    tokenizer = written["qwen2"].artifact.tokenizer
    im_start, think = vocabulary.tokens.index("<|im_start|>"), vocabulary.tokens.index(USER_DEFINED)
    ids = tokenizer.encode("<|im_start|>user <think>x")
    assert ids[0] == im_start and think in ids
    assert im_start in tokenizer.special_token_ids and think not in tokenizer.special_token_ids
    # control tokens vanish with skip_special_tokens; user-defined ones stay text
    assert tokenizer.decode(ids, skip_special_tokens=True) == "user <think>x"
    assert tokenizer.bos_token_id == 1 and tokenizer.eos_token_id == 2 and not tokenizer.add_bos_token


def test_metadata_config_and_template(written: dict[str, Written], vocabulary: Vocabulary) -> None:
    w = written["qwen3"]
    a = w.artifact
    assert a.kind == "gguf" and a.model_id == "tiny-qwen3"
    assert a.chat_template == TEMPLATE
    assert a.config.model_type == "qwen3" and a.config.qk_norm and a.config.head_dim == 128
    assert a.config.vocab_size == len(vocabulary.tokens) and not a.config.tie_word_embeddings
    assert written["qwen2"].artifact.config.tie_word_embeddings and written["qwen2"].artifact.config.attention_bias
    assert a.generation_defaults["eos_token_id"] == [2] and a.generation_defaults["bos_token_id"] == 1
    moe = written["qwen3moe"].artifact.config
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (4, 2, 768)
    assert moe.norm_topk_prob and moe.mlp_only_layers == ()
    assert written["qwen3moe"].artifact.num_tensors == len(dict(written["qwen3moe"].artifact.weights()))


def test_manifest_and_sampling_metadata(tmp_path: Path, written: dict[str, Written], vocabulary: Vocabulary) -> None:
    def sampling(writer: gguf.GGUFWriter) -> None:
        writer.add_float32(gguf.Keys.General.SAMPLING_TEMP, 0.7)
        writer.add_int32(gguf.Keys.General.SAMPLING_TOP_K, 20)
        writer.add_float32(gguf.Keys.General.SAMPLING_TOP_P, 0.8)
        writer.add_uint32(gguf.Keys.Tokenizer.EOT_ID, 1)

    path = write_gguf(
        tmp_path / "m.gguf",
        written["llama"].source,
        vocabulary,
        arch=gguf.MODEL_ARCH.LLAMA,
        pre="gpt-2",
        metadata=sampling,
    )
    (tmp_path / "m.gguf.ninfer.json").write_text(json.dumps({"model_id": "acme/tiny"}))
    a = open_artifact(path)
    assert a.model_id == "acme/tiny"
    defaults = a.generation_defaults
    assert defaults["temperature"] == pytest.approx(0.7) and defaults["top_p"] == pytest.approx(0.8)
    assert defaults["top_k"] == 20 and defaults["eos_token_id"] == [2, 1]


def test_llama3_rope_scaling_is_read_from_rope_freqs(
    tmp_path: Path, written: dict[str, Written], vocabulary: Vocabulary
) -> None:
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    source = LlamaForCausalLM(
        LlamaConfig(
            **{**SMALL, "vocab_size": len(vocabulary.tokens)}, rope_parameters={**scaling, "rope_theta": 500000.0}
        )
    ).eval()
    inv_freq = source.model.rotary_emb.inv_freq
    plain = 1.0 / (500000.0 ** (torch.arange(0, 16, 2).float() / 16))
    factors = (plain / inv_freq).numpy().astype(np.float32)
    assert factors.min() == pytest.approx(1.0) and factors.max() == pytest.approx(8.0)

    def rope_freqs(writer: gguf.GGUFWriter) -> None:
        writer.add_tensor("rope_freqs.weight", factors)

    path = write_gguf(
        tmp_path / "l3.gguf", source, vocabulary, arch=gguf.MODEL_ARCH.LLAMA, pre="llama-bpe", metadata=rope_freqs
    )
    a = open_artifact(path)
    assert a.config.rope_scaling == scaling and a.config.rope_theta == 500000.0
    assert a.tokenizer.add_bos_token is False  # the file says so, overriding llama-bpe's default
    ids = _prompt(len(vocabulary.tokens))
    with torch.no_grad():
        expected = source(ids[None]).logits[0]
    torch.testing.assert_close(
        _logits(a.load_model(dtype=torch.float32, progress=False), ids), expected, atol=FP32_ATOL, rtol=0
    )


def _open_error(path: Path) -> str:
    with pytest.raises(ArtifactError) as error:
        open_artifact(path)
    return str(error.value)


def test_errors_name_the_file_and_the_problem(
    tmp_path: Path, written: dict[str, Written], vocabulary: Vocabulary
) -> None:
    source = written["llama"].source
    llama = {"arch": gguf.MODEL_ARCH.LLAMA, "pre": "gpt-2"}

    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 16)
    message = _open_error(garbage)
    assert str(garbage) in message and "GGUF" in message

    not_gguf = tmp_path / "weights.bin"
    not_gguf.write_bytes(b"\x00" * 64)
    assert str(not_gguf) in _open_error(not_gguf)

    mamba = write_gguf(tmp_path / "mamba.gguf", source, vocabulary, architecture="mamba", **llama)
    message = _open_error(mamba)
    assert str(mamba) in message and "unsupported GGUF architecture 'mamba'" in message

    missing = write_gguf(tmp_path / "missing.gguf", source, vocabulary, drop=("blk.1.ffn_down.weight",), **llama)
    message = _open_error(missing)
    assert str(missing) in message and "model.layers.1.mlp.down_proj.weight" in message

    spm = write_gguf(tmp_path / "spm.gguf", source, vocabulary, tokenizer_model="llama", **llama)
    message = _open_error(spm)
    assert str(spm) in message and "tokenizer.ggml.model='llama'" in message

    odd_pre = write_gguf(tmp_path / "pre.gguf", source, vocabulary, arch=gguf.MODEL_ARCH.LLAMA, pre="no-such-pre")
    message = _open_error(odd_pre)
    assert str(odd_pre) in message and "no-such-pre" in message

    def unsupported_block(writer: gguf.GGUFWriter) -> None:
        # Q8_K blocks (llama.cpp's internal dot-product format, 292 bytes per 256 values): no unpacker
        writer.add_tensor("blk.0.extra.weight", np.zeros((4, 292), np.uint8), raw_dtype=QType.Q8_K)

    q8k = write_gguf(tmp_path / "q8k.gguf", source, vocabulary, metadata=unsupported_block, **llama)
    message = _open_error(q8k)
    assert str(q8k) in message and "Q8_K" in message and "blk.0.extra.weight" in message
