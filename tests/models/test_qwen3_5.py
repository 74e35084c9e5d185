"""Qwen3.5 (dense and MoE, VLM and text-only layouts): logits parity with transformers, caches, MTP.

Tolerances: fp32 logits within atol 1e-4 of transformers (|logits| ~ 5; observed ~1e-5, from
summation order in attention and the chunked delta rule). bf16: both bf16 runs are compared
with the fp32 logits, and ours must be no less accurate than transformers' (random tiny models
amplify bf16 rounding to ~4% relative error dense, 15-25% MoE where routing flips; we keep the
conv accumulation, gates and attention in fp32 where transformers rounds to bf16). Our own
chunked / decode / batched runs agree with our full forward within fp32 atol 1e-4.
"""

from __future__ import annotations

import copy
import math
import tempfile

import pytest
import torch
import torch.nn.functional as F
import transformers as tf

from ninfer.models.config import ModelConfig
from ninfer.models.loader import WeightLoadError
from ninfer.models.verify_scratch import VerifyRows
from tests.models.helpers import (
    Session,
    load_ours,
    normal_init,
    randomize_,
    run_chunked,
    run_full,
    save_hf,
    uniform_init,
)

VOCAB = 1024
TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
)
ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
MROPE = {**ROPE, "mrope_section": [2, 1, 1], "mrope_interleaved": True}
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=96)
VISION = dict(
    depth=1,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    patch_size=4,
    spatial_merge_size=2,
    temporal_patch_size=2,
    out_hidden_size=128,
    num_position_embeddings=16,
)
# Varied decays (A in [0.01, 2]) so some GDN heads remember across the 64-token chunk boundary;
# the GDN output norm is a plain w-norm, so centre it on 1.
GDN_INIT = {"A_log": uniform_init(0.01, 2.0, torch.log), "linear_attn.norm.weight": normal_init(1.0, 0.3)}
FP32_ATOL = 1e-4
BF16_ERROR_VS_HF = 1.25  # our bf16 relative error may be at most this multiple of transformers' bf16 error
BF16_DENSE_REL_ERROR = 0.06  # observed 0.035 (transformers bf16: 0.037)
BF16_DENSE_MEAN_ABS = 0.05  # mean |ours - transformers| in bf16; observed 0.023
SEQ_LEN = 70  # crosses the 64-token chunk of the delta rule


def _hf_models() -> dict[str, torch.nn.Module]:
    return {
        "dense_vlm": lambda: tf.Qwen3_5ForConditionalGeneration(
            tf.Qwen3_5Config(
                text_config=dict(intermediate_size=256, rope_parameters=MROPE, **TEXT), vision_config=VISION
            )
        ),
        "dense_text": lambda: tf.Qwen3_5ForCausalLM(
            tf.Qwen3_5TextConfig(intermediate_size=256, rope_parameters=ROPE, tie_word_embeddings=True, **TEXT)
        ),
        "moe_vlm": lambda: tf.Qwen3_5MoeForConditionalGeneration(
            tf.Qwen3_5MoeConfig(text_config=dict(rope_parameters=MROPE, **MOE, **TEXT), vision_config=VISION)
        ),
        "moe_text": lambda: tf.Qwen3_5MoeForCausalLM(tf.Qwen3_5MoeTextConfig(rope_parameters=MROPE, **MOE, **TEXT)),
    }


class Checkpoint:
    """A random transformers model and what its save_pretrained wrote."""

    def __init__(self, kind: str, seed: int):
        torch.manual_seed(seed)
        self.hf = randomize_(_hf_models()[kind]().eval(), seed, overrides=GDN_INIT)
        with tempfile.TemporaryDirectory() as directory:
            self.config, self.tensors = save_hf(self.hf, directory)


@pytest.fixture(scope="module")
def checkpoints() -> dict[str, Checkpoint]:
    return {kind: Checkpoint(kind, seed) for seed, kind in enumerate(_hf_models())}


def _tokens(length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _hf_logits(hf: torch.nn.Module, input_ids: torch.Tensor, **kwargs) -> torch.Tensor:
    return hf(input_ids=input_ids[None], **kwargs).logits[0].float()


# ---- parity with transformers ----------------------------------------------------------------


@pytest.mark.parametrize("kind", list(_hf_models()))
def test_logits_match_transformers_fp32(checkpoints: dict[str, Checkpoint], kind: str) -> None:
    ckpt = checkpoints[kind]
    if kind.endswith("vlm"):
        assert any(name.startswith("model.visual.") for name in ckpt.tensors)
        assert any(name.startswith("model.language_model.") for name in ckpt.tensors)
    ours = load_ours(ckpt.config, ckpt.tensors)
    input_ids = _tokens(SEQ_LEN, seed=1)
    expected = _hf_logits(ckpt.hf, input_ids)
    assert expected.abs().max() > 1.0  # the comparison is not between near-zero numbers
    torch.testing.assert_close(run_full(ours, input_ids), expected, atol=FP32_ATOL, rtol=0)


def test_tied_text_checkpoint_shares_lm_head(checkpoints: dict[str, Checkpoint]) -> None:
    ckpt = checkpoints["dense_text"]
    assert "lm_head.weight" not in ckpt.tensors
    ours = load_ours(ckpt.config, ckpt.tensors)
    assert ours.lm_head.weight is ours.model.embed_tokens.weight


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected).norm() / expected.norm()).item()


@pytest.mark.parametrize("kind", ["dense_text", "moe_vlm"])
def test_bf16_is_as_accurate_as_transformers_bf16(checkpoints: dict[str, Checkpoint], kind: str) -> None:
    """bf16 logits are judged against the fp32 logits: random tiny models amplify bf16 rounding
    (transformers' own bf16 run is off by up to ~0.6 on some logits; MoE routing flips make it
    worse), so we require our bf16 error to be no larger than transformers' bf16 error."""
    ckpt = checkpoints[kind]
    input_ids = _tokens(SEQ_LEN, seed=2)
    exact = _hf_logits(ckpt.hf, input_ids)
    hf_bf16 = _hf_logits(copy.deepcopy(ckpt.hf).to(torch.bfloat16), input_ids)
    ours = run_full(load_ours(ckpt.config, ckpt.tensors, dtype=torch.bfloat16), input_ids)
    assert ours.dtype == torch.bfloat16
    ours_error, hf_error = _relative_error(ours, exact), _relative_error(hf_bf16, exact)
    assert ours_error <= BF16_ERROR_VS_HF * hf_error + 0.005, (ours_error, hf_error)
    if kind.startswith("dense"):  # no routing flips: the two bf16 runs also agree closely
        assert ours_error < BF16_DENSE_REL_ERROR
        assert (ours.float() - hf_bf16).abs().mean() < BF16_DENSE_MEAN_ABS


def test_mrope_positions_match_transformers(checkpoints: dict[str, Checkpoint]) -> None:
    """Distinct t/h/w positions (as inside an image block) go through the interleaved MRoPE."""
    ckpt = checkpoints["moe_text"]
    ours = load_ours(ckpt.config, ckpt.tensors)
    input_ids = _tokens(24, seed=3)
    gen = torch.Generator().manual_seed(3)
    positions = torch.arange(24).expand(3, -1) + torch.randint(0, 6, (3, 24), generator=gen).cumsum(-1)
    expected = _hf_logits(ckpt.hf, input_ids, position_ids=positions[:, None, :])
    session = Session(ours, 24)
    with torch.inference_mode():
        batch = session.batch([0], [24], positions=positions)
        logits = ours.compute_logits(ours(input_ids, batch))
    torch.testing.assert_close(logits, expected, atol=FP32_ATOL, rtol=0)


def _fused_expert_layout(tensors: dict[str, torch.Tensor], num_experts: int) -> dict[str, torch.Tensor]:
    """Rewrite per-expert trunk tensors into the hub's fused 3-D layout (gate rows, then up rows)."""
    fused = {n: t for n, t in tensors.items() if ".experts." not in n}
    prefixes = sorted({n.split(".experts.")[0] for n in tensors if ".experts." in n})
    for prefix in prefixes:
        gate_up = [
            torch.cat([tensors[f"{prefix}.experts.{e}.{proj}_proj.weight"] for proj in ("gate", "up")])
            for e in range(num_experts)
        ]
        fused[f"{prefix}.experts.gate_up_proj"] = torch.stack(gate_up)
        fused[f"{prefix}.experts.down_proj"] = torch.stack(
            [tensors[f"{prefix}.experts.{e}.down_proj.weight"] for e in range(num_experts)]
        )
    return fused


def test_hub_fused_expert_layout_loads_the_same_model(checkpoints: dict[str, Checkpoint]) -> None:
    ckpt = checkpoints["moe_vlm"]
    assert "model.language_model.layers.0.mlp.experts.3.up_proj.weight" in ckpt.tensors  # save_pretrained layout
    hub = _fused_expert_layout(ckpt.tensors, MOE["num_experts"])
    assert "model.language_model.layers.0.mlp.experts.gate_up_proj" in hub
    from_saved = load_ours(ckpt.config, ckpt.tensors).state_dict()
    from_hub = load_ours(ckpt.config, hub).state_dict()
    assert from_saved.keys() == from_hub.keys()
    for name in from_saved:
        assert torch.equal(from_saved[name], from_hub[name]), name


def test_missing_tensor_is_reported(checkpoints: dict[str, Checkpoint]) -> None:
    ckpt = checkpoints["dense_vlm"]
    tensors = {n: t for n, t in ckpt.tensors.items() if not n.endswith("layers.2.linear_attn.dt_bias")}
    with pytest.raises(WeightLoadError, match="dt_bias"):
        load_ours(ckpt.config, tensors)


# ---- our caches: chunked prefill, decode, batched steps ----------------------------------------


@pytest.mark.parametrize("kind", ["dense_vlm", "moe_text"])
@pytest.mark.parametrize("chunk_sizes", [[1], [5], [16], [3, 64, 1]], ids=lambda c: "-".join(map(str, c)))
def test_chunked_prefill_and_decode_equal_full_forward(
    checkpoints: dict[str, Checkpoint], kind: str, chunk_sizes: list[int]
) -> None:
    ckpt = checkpoints[kind]
    ours = load_ours(ckpt.config, ckpt.tensors)
    input_ids = _tokens(SEQ_LEN, seed=4)
    full = run_full(ours, input_ids)
    torch.testing.assert_close(run_chunked(ours, input_ids, chunk_sizes), full, atol=FP32_ATOL, rtol=0)


@pytest.mark.parametrize("kind", ["dense_text", "moe_vlm"])
def test_batched_steps_equal_requests_run_alone(checkpoints: dict[str, Checkpoint], kind: str) -> None:
    ckpt = checkpoints[kind]
    ours = load_ours(ckpt.config, ckpt.tensors)
    sequences = [_tokens(length, seed=10 + i) for i, length in enumerate((40, 72, 9))]
    expected = [run_full(ours, seq) for seq in sequences]
    # (request, new tokens) per step: prefills of different lengths, a prefill beside decodes,
    # decode-only rounds (the recurrent path), and a request joining late.
    schedule = [
        [(0, 16), (1, 66)],
        [(0, 20), (1, 1)],
        [(1, 1), (0, 1), (2, 5)],
        [(0, 1), (2, 1), (1, 1)],
        [(2, 3), (0, 1), (1, 1)],
        [(1, 2), (0, 1)],
    ]
    session = Session(ours, max_tokens=max(len(s) for s in sequences), num_requests=3)
    got: list[list[torch.Tensor]] = [[], [], []]
    for step in schedule:
        requests = [r for r, _ in step]
        chunks = [sequences[r][session.num_computed[r] : session.num_computed[r] + n] for r, n in step]
        logits, _ = session.step(requests, chunks)
        for r, step_logits in zip(requests, logits):
            got[r].append(step_logits)
    for r, seq in enumerate(sequences):
        assert session.num_computed[r] == len(seq)
        torch.testing.assert_close(torch.cat(got[r]), expected[r], atol=FP32_ATOL, rtol=0)


@pytest.mark.parametrize("kind", ["dense_text", "moe_vlm"])
def test_aux_hidden_states_are_the_residual_streams_transformers_reports(
    checkpoints: dict[str, Checkpoint], kind: str
) -> None:
    """ForwardBatch.aux_layer_ids: every row gets the stream after each named layer (unsorted ids,
    the last layer's final-normed), across prompt chunks and decode rows; off by default."""
    ckpt = checkpoints[kind]
    ours = load_ours(ckpt.config, ckpt.tensors)
    input_ids = _tokens(SEQ_LEN, seed=6)
    with torch.no_grad():
        expected = ckpt.hf(input_ids=input_ids[None], output_hidden_states=True).hidden_states
    layer_ids = (2, 0, 3)
    session = Session(ours, SEQ_LEN)
    got, start = [], 0
    for size in (33, 1, 36):
        batch = session.batch([0], [size])
        assert batch.aux_hidden is None
        batch.aux_layer_ids = layer_ids
        batch.aux_hidden = torch.full((size, len(layer_ids), TEXT["hidden_size"]), float("nan"))
        with torch.no_grad():
            ours(input_ids[start : start + size], batch)
        session.num_computed[0] += size
        got.append(batch.aux_hidden)
        start += size
    got = torch.cat(got)
    for column, layer_id in enumerate(layer_ids):
        torch.testing.assert_close(got[:, column], expected[layer_id + 1][0].float(), atol=FP32_ATOL, rtol=0)


def test_fresh_slot_is_a_fresh_sequence(checkpoints: dict[str, Checkpoint]) -> None:
    """After reset(slot) a new sequence reusing slot and pages matches a clean run."""
    ckpt = checkpoints["dense_vlm"]
    ours = load_ours(ckpt.config, ckpt.tensors)
    first, second = _tokens(30, seed=20), _tokens(30, seed=21)
    session = Session(ours, 30)
    session.step([0], [first])
    session.states.reset(session.state_slots[0])
    session.num_computed[0] = 0
    logits, _ = session.step([0], [second])
    torch.testing.assert_close(logits[0], run_full(ours, second), atol=FP32_ATOL, rtol=0)


# ---- MTP head ----------------------------------------------------------------------------------


def _mtp_tensors(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Random MTP weights in the hub layout (MoE experts per expert, as in the released checkpoints)."""
    gen = torch.Generator().manual_seed(seed)
    hidden, head_dim = config.hidden_size, config.head_dim

    def matrix(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen) * cols**-0.5

    def vector(size: int) -> torch.Tensor:
        return torch.randn(size, generator=gen) * 0.3

    layer = "mtp.layers.0"
    tensors = {
        "mtp.fc.weight": matrix(hidden, 2 * hidden),
        "mtp.pre_fc_norm_embedding.weight": vector(hidden),
        "mtp.pre_fc_norm_hidden.weight": vector(hidden),
        "mtp.norm.weight": vector(hidden),
        f"{layer}.input_layernorm.weight": vector(hidden),
        f"{layer}.post_attention_layernorm.weight": vector(hidden),
        f"{layer}.self_attn.q_proj.weight": matrix(2 * config.num_attention_heads * head_dim, hidden),
        f"{layer}.self_attn.k_proj.weight": matrix(config.num_key_value_heads * head_dim, hidden),
        f"{layer}.self_attn.v_proj.weight": matrix(config.num_key_value_heads * head_dim, hidden),
        f"{layer}.self_attn.o_proj.weight": matrix(hidden, config.num_attention_heads * head_dim),
        f"{layer}.self_attn.q_norm.weight": vector(head_dim),
        f"{layer}.self_attn.k_norm.weight": vector(head_dim),
    }
    if not config.is_moe:
        tensors[f"{layer}.mlp.gate_proj.weight"] = matrix(config.intermediate_size, hidden)
        tensors[f"{layer}.mlp.up_proj.weight"] = matrix(config.intermediate_size, hidden)
        tensors[f"{layer}.mlp.down_proj.weight"] = matrix(hidden, config.intermediate_size)
        return tensors
    inter, shared = config.moe_intermediate_size, config.shared_expert_intermediate_size
    tensors[f"{layer}.mlp.gate.weight"] = matrix(config.num_experts, hidden)
    for e in range(config.num_experts):
        tensors[f"{layer}.mlp.experts.{e}.gate_proj.weight"] = matrix(inter, hidden)
        tensors[f"{layer}.mlp.experts.{e}.up_proj.weight"] = matrix(inter, hidden)
        tensors[f"{layer}.mlp.experts.{e}.down_proj.weight"] = matrix(hidden, inter)
    tensors[f"{layer}.mlp.shared_expert.gate_proj.weight"] = matrix(shared, hidden)
    tensors[f"{layer}.mlp.shared_expert.up_proj.weight"] = matrix(shared, hidden)
    tensors[f"{layer}.mlp.shared_expert.down_proj.weight"] = matrix(hidden, shared)
    tensors[f"{layer}.mlp.shared_expert_gate.weight"] = matrix(1, hidden)
    return tensors


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + weight)


def _swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return (F.silu(x @ gate.T) * (x @ up.T)) @ down.T


def _reference_mtp_logits(
    w: dict[str, torch.Tensor],
    config: ModelConfig,
    embed: torch.Tensor,
    lm_head: torch.Tensor,
    next_ids: torch.Tensor,
    target_hidden: torch.Tensor,
) -> torch.Tensor:
    """The MTP formula in plain fp32 torch, straight from the stored tensors (positions 0..T-1)."""
    eps, layer = config.rms_norm_eps, "mtp.layers.0"
    num_tokens, head_dim = len(next_ids), config.head_dim
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    normed_embeds = _norm(embed[next_ids], w["mtp.pre_fc_norm_embedding.weight"], eps)
    normed_hidden = _norm(target_hidden, w["mtp.pre_fc_norm_hidden.weight"], eps)
    x = torch.cat((normed_embeds, normed_hidden), dim=-1) @ w["mtp.fc.weight"].T

    # gated attention: per head [query | gate] rows in q_proj, (1+w) q/k norms, partial neox RoPE
    h = _norm(x, w[f"{layer}.input_layernorm.weight"], eps)
    q_and_gate = (h @ w[f"{layer}.self_attn.q_proj.weight"].T).view(num_tokens, heads, 2 * head_dim)
    q, gate = q_and_gate[..., :head_dim], q_and_gate[..., head_dim:].reshape(num_tokens, heads * head_dim)
    q = _norm(q, w[f"{layer}.self_attn.q_norm.weight"], eps)
    k = (h @ w[f"{layer}.self_attn.k_proj.weight"].T).view(num_tokens, kv_heads, head_dim)
    k = _norm(k, w[f"{layer}.self_attn.k_norm.weight"], eps)
    v = (h @ w[f"{layer}.self_attn.v_proj.weight"].T).view(num_tokens, kv_heads, head_dim)
    rotary_dim = config.rotary_dim
    inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    angles = torch.arange(num_tokens).float()[:, None] * inv_freq[None]
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]

    def rope(t: torch.Tensor) -> torch.Tensor:
        first, second, rest = t[..., : rotary_dim // 2], t[..., rotary_dim // 2 : rotary_dim], t[..., rotary_dim:]
        return torch.cat((first * cos - second * sin, second * cos + first * sin, rest), dim=-1)

    q, k = rope(q), rope(k)
    k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(head_dim)
    scores = scores.masked_fill(~torch.ones(num_tokens, num_tokens, dtype=torch.bool).tril(), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(num_tokens, heads * head_dim)
    x = x + (attn * torch.sigmoid(gate)) @ w[f"{layer}.self_attn.o_proj.weight"].T

    h = _norm(x, w[f"{layer}.post_attention_layernorm.weight"], eps)
    mlp = f"{layer}.mlp"
    if not config.is_moe:
        ffn = _swiglu(h, w[f"{mlp}.gate_proj.weight"], w[f"{mlp}.up_proj.weight"], w[f"{mlp}.down_proj.weight"])
    else:
        probs = (h @ w[f"{mlp}.gate.weight"].T).softmax(-1)
        top_probs, top_experts = probs.topk(config.num_experts_per_tok, dim=-1)
        top_probs = top_probs / top_probs.sum(-1, keepdim=True)
        ffn = torch.zeros_like(h)
        for t in range(num_tokens):
            for p, e in zip(top_probs[t], top_experts[t].tolist()):
                expert = [w[f"{mlp}.experts.{e}.{proj}_proj.weight"] for proj in ("gate", "up", "down")]
                ffn[t] += p * _swiglu(h[t : t + 1], *expert)[0]
        shared = [w[f"{mlp}.shared_expert.{proj}_proj.weight"] for proj in ("gate", "up", "down")]
        ffn = ffn + torch.sigmoid(h @ w[f"{mlp}.shared_expert_gate.weight"].T) * _swiglu(h, *shared)
    x = x + ffn
    return _norm(x, w["mtp.norm.weight"], eps) @ lm_head.T


@pytest.mark.parametrize("kind", ["dense_vlm", "moe_vlm"])
def test_mtp_matches_reference_formula(checkpoints: dict[str, Checkpoint], kind: str) -> None:
    ckpt = checkpoints[kind]
    hf_config = copy.deepcopy(ckpt.config)
    hf_config["text_config"]["mtp_num_hidden_layers"] = 1
    config = ModelConfig.from_hf(hf_config)
    mtp = _mtp_tensors(config, seed=5)
    ours = load_ours(hf_config, {**ckpt.tensors, **mtp})
    assert ours.cache_spec().num_attention_layers == len(config.attention_layer_ids) + 1

    tokens = _tokens(SEQ_LEN + 1, seed=6)
    input_ids, next_ids = tokens[:-1], tokens[1:]
    session = Session(ours, SEQ_LEN)
    trunk_logits, hidden = session.step([0], [input_ids])
    torch.testing.assert_close(trunk_logits[0], _hf_logits(ckpt.hf, input_ids), atol=FP32_ATOL, rtol=0)
    with torch.inference_mode():
        mtp_logits = ours.compute_logits(ours.forward_mtp(next_ids, hidden[0], session.last_batch))
    embed = ckpt.tensors["model.language_model.embed_tokens.weight"]
    expected = _reference_mtp_logits(mtp, config, embed, ckpt.tensors["lm_head.weight"], next_ids, hidden[0])
    assert expected.abs().max() > 1.0
    torch.testing.assert_close(mtp_logits, expected, atol=FP32_ATOL, rtol=0)

    # Step by step (prefill chunk, then decodes) the MTP layer's own KV gives the same answers.
    stepped = Session(ours, SEQ_LEN)
    pieces = []
    for start, end in ((0, 37), (37, 38), (38, 39), (39, SEQ_LEN)):
        _, step_hidden = stepped.step([0], [input_ids[start:end]])
        with torch.inference_mode():
            mtp_hidden = ours.forward_mtp(next_ids[start:end], step_hidden[0], stepped.last_batch)
            pieces.append(ours.compute_logits(mtp_hidden))
    torch.testing.assert_close(torch.cat(pieces), expected, atol=FP32_ATOL, rtol=0)


def test_mtp_tensors_are_skipped_when_mtp_is_off(checkpoints: dict[str, Checkpoint]) -> None:
    ckpt = checkpoints["moe_text"]
    config = ModelConfig.from_hf(ckpt.config)
    assert config.mtp_num_hidden_layers == 0
    mtp = _mtp_tensors(config.replace(mtp_num_hidden_layers=1), seed=7)
    ours = load_ours(ckpt.config, {**ckpt.tensors, **mtp})
    assert ours.mtp is None
    assert not any(name.startswith("mtp.") for name in ours.state_dict())


# ---- speculative verification rows ------------------------------------------------------------


@pytest.mark.parametrize("kind", ["dense_text", "moe_text"])
@torch.inference_mode()
def test_verify_rows_then_commit_equal_decoding(checkpoints: dict[str, Checkpoint], kind: str) -> None:
    """Verification scores [last token, drafts] without writing the GDN states, beside another
    request's prefill chunk in the same forward; committing the accepted rows then leaves the
    states and logits of decoding those tokens one at a time."""
    ckpt = checkpoints[kind]
    ours = load_ours(ckpt.config, ckpt.tensors)
    prompt, other, rows = _tokens(20, seed=5), _tokens(30, seed=6), _tokens(4, seed=7)
    decoded = Session(ours, 40, num_requests=2)
    decoded.step([0, 1], [prompt, other[:10]])
    plain = [decoded.step([0], [rows[t : t + 1]])[0][0] for t in range(len(rows))]

    verifying = Session(ours, 40, num_requests=2)
    verifying.step([0, 1], [prompt, other[:10]])
    before = verifying.states.recurrent.clone(), verifying.states.conv.clone()
    slot = verifying.state_slots[0]
    scratch = ours.allocate_verify_scratch(max_rows=8)
    batch = verifying.batch([0, 1], [len(rows), 20])
    batch.verify = VerifyRows(1, len(rows), scratch)
    hidden = ours(torch.cat([rows, other[10:]]), batch)
    logits = ours.compute_logits(hidden[: len(rows)])
    torch.testing.assert_close(logits, torch.cat(plain), atol=FP32_ATOL, rtol=0)
    assert torch.equal(verifying.states.recurrent[:, slot], before[0][:, slot])
    assert torch.equal(verifying.states.conv[:, slot], before[1][:, slot])
    # The other request's prefill chunk wrote its state as usual.
    other_slot = verifying.state_slots[1]
    assert not torch.equal(verifying.states.recurrent[:, other_slot], before[0][:, other_slot])

    # Accept two rows: the state must equal decoding two tokens.
    ours.commit_verified(scratch, verifying.states, torch.tensor([slot]), torch.tensor([0]), torch.tensor([2]), 4)
    replay = Session(ours, 40, num_requests=2)
    replay.step([0, 1], [prompt, other[:10]])
    replay.step([0], [rows[:1]])
    replay.step([0], [rows[1:2]])
    torch.testing.assert_close(verifying.states.recurrent[:, slot], replay.states.recurrent[:, replay.state_slots[0]],
                               atol=1e-5, rtol=0)
    torch.testing.assert_close(verifying.states.conv[:, slot], replay.states.conv[:, replay.state_slots[0]],
                               atol=1e-5, rtol=0)
    # Decoding on from the committed state gives the plain continuation's logits.
    verifying.num_computed[0] = len(prompt) + 2
    next_logits, _ = verifying.step([0], [rows[2:3]])
    torch.testing.assert_close(next_logits[0], plain[2], atol=FP32_ATOL, rtol=0)
