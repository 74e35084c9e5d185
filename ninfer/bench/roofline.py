"""Rooflines from bytes moved and FLOPs, against ceilings measured on the same device in the same run."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ninfer.bench.clocks import ClockSampler
from ninfer.models.config import ModelConfig


@dataclass(frozen=True)
class DeviceCeilings:
    copy_bytes_per_s: float  # device-to-device copy, bytes read + written
    bf16_flops_per_s: float  # large bf16 matrix product on random data
    name: str
    matmul_sm_clock_mhz: float | None = None  # median SM clock while the matrix rate was measured


def median_ms(fn, repeats: int = 10, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def _copy_bytes_per_s(device: torch.device) -> float:
    """A 4 GiB device-to-device copy, counting bytes read and written."""
    num_elements = 1 << 31
    src = torch.randn(num_elements, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * num_elements * 2 / (ms / 1000.0)


def _bf16_flops_per_s(device: torch.device) -> float:
    size = 8192
    a = torch.randn(size, size, dtype=torch.bfloat16, device=device)
    b = torch.randn(size, size, dtype=torch.bfloat16, device=device)
    ms = median_ms(lambda: a @ b)
    return 2 * size**3 / (ms / 1000.0)


def measure_ceilings(device: torch.device, clocks: ClockSampler | None = None) -> DeviceCeilings:
    """Random data, median of 10 after warm-up; buffers are freed before the models are built."""
    copy_rate = _copy_bytes_per_s(device)
    started = time.perf_counter()
    flops = _bf16_flops_per_s(device)
    clock = clocks.median_mhz(started, time.perf_counter()) if clocks is not None else None
    torch.cuda.empty_cache()
    return DeviceCeilings(copy_bytes_per_s=copy_rate, bf16_flops_per_s=flops, name=torch.cuda.get_device_name(device),
                          matmul_sm_clock_mhz=clock)


@dataclass(frozen=True)
class ModelBytes:
    weight_bytes_per_token: float  # weights streamed once per decode round (embedding rows excluded)
    kv_bytes_per_context_token: float  # all attention layers, K and V
    state_bytes_per_sequence: float  # recurrent state read + written, conv state read + written
    active_params: float  # parameters touched per token (for prefill FLOPs)


def model_bytes(
    config: ModelConfig, weight_bytes: float, kv_element_bytes: int, batch: int, expert_bytes: float = 2.0
) -> ModelBytes:
    """weight_bytes: bytes per Linear weight element (2 for bf16, 1 for FP8); expert_bytes: per
    routed-expert weight element (FP8 experts: 1; NVFP4: 0.5625); lm_head and the MoE
    routers stay bf16 in every mode."""
    h = config.hidden_size
    attn_layers = len(config.attention_layer_ids)
    linear_layers = len(config.linear_layer_ids)
    attn_params = (
        h * config.num_attention_heads * config.head_dim * (2 if config.attn_output_gate else 1)  # q (+gate)
        + 2 * h * config.num_key_value_heads * config.head_dim  # k, v
        + config.num_attention_heads * config.head_dim * h  # o
    )
    gdn_params = (
        h * config.linear_conv_dim  # in_proj_qkv
        + h * config.linear_value_dim  # in_proj_z
        + 2 * h * config.linear_num_value_heads  # in_proj_b, in_proj_a
        + config.linear_value_dim * h  # out_proj
    )
    lm_head = config.vocab_size * h
    if config.is_moe:
        expert = 3 * h * config.moe_intermediate_size
        shared = 3 * h * config.shared_expert_intermediate_size + h
        router = config.num_experts * h
        # Distinct experts a batch touches under uniform routing (exactly top_k at batch 1).
        k, e = config.num_experts_per_tok, config.num_experts
        distinct = e * (1.0 - (1.0 - k / e) ** batch)
        ffn_streamed = distinct * expert + shared + router
        ffn_active = k * expert + shared + router
    else:
        ffn_streamed = ffn_active = 3 * h * config.intermediate_size
    layers = config.num_hidden_layers
    streamed = attn_layers * attn_params + linear_layers * gdn_params + layers * ffn_streamed + lm_head
    active = attn_layers * attn_params + linear_layers * gdn_params + layers * ffn_active + lm_head
    # In an MoE layer the shared expert's projections take weight_bytes and the routed experts
    # expert_bytes; the router and the shared expert's gate (one output) stay bf16.
    routed = layers * (ffn_streamed - shared - router) if config.is_moe else 0
    bf16_only = lm_head + (layers * (router + h) if config.is_moe else 0)
    kv = 2 * attn_layers * config.num_key_value_heads * config.head_dim * kv_element_bytes
    recurrent = linear_layers * config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim * 4
    conv = linear_layers * config.linear_conv_dim * (config.linear_conv_kernel_dim - 1) * 2
    return ModelBytes(
        weight_bytes_per_token=(streamed - bf16_only - routed) * weight_bytes + routed * expert_bytes + bf16_only * 2,
        kv_bytes_per_context_token=kv,
        state_bytes_per_sequence=2 * (recurrent + conv),
        active_params=active,
    )


def decode_roofline_tokens_per_s(mb: ModelBytes, batch: int, context: int, ceilings: DeviceCeilings) -> float:
    """Batch tokens per round / (bytes of one round / copy bandwidth)."""
    round_bytes = mb.weight_bytes_per_token + batch * (context * mb.kv_bytes_per_context_token + mb.state_bytes_per_sequence)
    return batch * ceilings.copy_bytes_per_s / round_bytes


def prefill_roofline_tokens_per_s(mb: ModelBytes, config: ModelConfig, prompt: int, ceilings: DeviceCeilings) -> float:
    """Matrix-unit bound: 2 FLOPs per active parameter per token plus causal attention."""
    attn_layers = len(config.attention_layer_ids)
    attn_flops_per_token = attn_layers * 2 * 2 * config.num_attention_heads * config.head_dim * (prompt / 2)
    flops_per_token = 2 * mb.active_params + attn_flops_per_token
    return ceilings.bf16_flops_per_s / flops_per_token
