"""Build an EngineCore from an artifact path: runs inside the engine process (picklable spec)."""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from dataclasses import dataclass

import torch

from ninfer.config import EngineConfig
from ninfer.engine.core import EngineCore
from ninfer.engine.host_kv import HostKV
from ninfer.models.quant.fp8 import Fp8Linear
from ninfer.models.quant.half_weights import store_half_weights_

log = logging.getLogger("ninfer.engine")

KV_HEADROOM_BYTES = 1 << 30  # --kv-capacity auto leaves this much device memory free


@dataclass(frozen=True)
class EngineSpec:
    artifact_path: str
    engine: EngineConfig
    dtype: str = "auto"
    kv_capacity_auto: bool = False
    speculative: bool = False  # loads the MTP head's weights and KV layer only when speculation uses them


def resolve_dtype(name: str, artifact_dtype: str, device: str) -> torch.dtype:
    """auto: the artifact's dtype on a GPU; float32 on CPU, where bf16 matmuls are slow and inexact."""
    if name == "auto":
        if device.startswith("cuda"):
            return getattr(torch, artifact_dtype, torch.bfloat16)
        return torch.float32
    return getattr(torch, name)


def cpu_half_weights(dtype_name: str, dtype: torch.dtype, device: str) -> bool:
    """Whether a CPU engine stores its Linear weights in float16 (models/quant/half_weights.py):
    for --dtype auto (float32 activations), on x86 CPUs whose float16 GEMV torch vectorizes.
    An explicit --dtype float32 keeps every weight in float32."""
    return (
        dtype_name == "auto"
        and dtype == torch.float32
        and not device.startswith("cuda")
        and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    )


def cpu_threads() -> int:
    """Torch threads for a CPU engine: one per two CPUs it may run on (at least one).

    Decode is memory-bound: threads past one per physical core add no bandwidth (vCPUs are
    often SMT siblings), and each OpenMP thread joins a barrier per op, which stalls for a
    time slice whenever another process holds its CPU. On 2 vCPUs beside one busy process,
    2 threads decode the default model at ~0.6 tok/s and 1 thread at ~27 (idle: 32 and 29;
    2 threads prefill 1.3x faster). The CPU left over serves the API process.
    OMP_NUM_THREADS, when set, wins.
    """
    if os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads()
    available = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, available // 2)


def build_engine_core(spec: EngineSpec) -> EngineCore:
    from ninfer.artifact import open_artifact

    started = time.perf_counter()
    artifact = open_artifact(spec.artifact_path)
    if artifact.config.mtp_num_hidden_layers and not spec.speculative:
        artifact.config = artifact.config.replace(mtp_num_hidden_layers=0)
    device = spec.engine.device
    dtype = resolve_dtype(spec.dtype, artifact.config.torch_dtype, device)
    on_cpu = not device.startswith("cuda")
    if on_cpu:
        torch.set_num_threads(cpu_threads())
    log.info(
        "loading %s (%s, %s) on %s%s",
        artifact.model_id,
        artifact.config.model_type,
        str(dtype).removeprefix("torch."),
        device,
        f" ({torch.get_num_threads()} threads)" if on_cpu else "",
    )
    # The bar is a transient terminal line; redirected stderr gets only the milestone records.
    model = artifact.load_model(dtype=dtype, device=device, progress=sys.stderr.isatty())
    # FP8 weights are buffers of their Fp8Linear layers, not parameters.
    num_params = sum(p.numel() for p in model.parameters()) + sum(
        m.weight.numel() for m in model.modules() if isinstance(m, Fp8Linear)
    )
    log.info("model loaded in %.1fs: %.2fB parameters", time.perf_counter() - started, num_params / 1e9)
    if cpu_half_weights(spec.dtype, dtype, device):
        log.info("Linear weights stored in float16 for decode: %d layers", store_half_weights_(model))
    engine = spec.engine
    if spec.kv_capacity_auto:
        engine = dataclasses.replace(engine, kv_capacity=_auto_kv_tokens(model, engine))
    core = EngineCore(model, artifact.tokenizer, engine)
    kv = core.runner.kv_cache
    host = core.runner.host_states
    log.info(
        "KV pool: %d tokens in %d pages (%.1f MiB) · state slots: %d (%d active + %d checkpoint)"
        " · host state slots: %d (%.1f MiB pinned) · host KV: %d pages (%.1f MiB pinned)",
        engine.num_kv_pages * engine.page_size,
        engine.num_kv_pages,
        kv.k.numel() * kv.k.element_size() * 2 / (1 << 20),
        engine.num_state_slots,
        engine.max_concurrency,
        engine.num_state_slots - engine.max_concurrency,
        host.num_slots,
        host.num_slots * host.bytes_per_slot / (1 << 20),
        core.runner.host_kv.num_pages,
        core.runner.host_kv.num_pages * HostKV.page_bytes(kv) / (1 << 20),
    )
    if engine.prefix_reuse:
        costs = core.context_costs
        log.info(
            "context costs: %s (prefill %.3g s/token, host transfer %.1f GB/s)",
            costs.source,
            costs.prefill_seconds_per_token,
            costs.host_transfer_bytes_per_second / 1e9,
        )
        log.info(
            "context cache limits: %d private continuations · %d shared prefixes · %d long anchors per continuation",
            engine.num_private_continuations,
            engine.num_shared_prefixes,
            engine.num_long_anchors,
        )
    return core


def _auto_kv_tokens(model, engine: EngineConfig) -> int:
    """Free device memory minus headroom, divided by KV bytes per token; CPU follows --max-context."""
    if not engine.device.startswith("cuda"):
        return engine.max_context
    spec = model.cache_spec()
    element = next(model.parameters()).element_size()
    bytes_per_token = 2 * spec.num_attention_layers * spec.num_kv_heads * spec.head_dim * element
    state_bytes = 0
    if spec.num_linear_layers:
        conv = spec.num_linear_layers * spec.conv_dim * (spec.conv_kernel - 1) * element
        recurrent = spec.num_linear_layers * spec.num_v_heads * spec.k_head_dim * spec.v_head_dim * 4
        state_bytes = engine.num_state_slots * (conv + recurrent)
    free, _ = torch.cuda.mem_get_info(torch.device(engine.device))
    budget = free - KV_HEADROOM_BYTES - state_bytes
    return max(engine.page_size, budget // max(bytes_per_token, 1))
