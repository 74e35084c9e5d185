"""The server_start record's view of a running engine: its resolved capacities, memory ledger,
host tier, vision hand-off, speculative backend and device (EngineCore.describe)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ninfer.engine.cache.host_kv import HostKV

if TYPE_CHECKING:
    from ninfer.engine.core import EngineCore


def describe_engine(core: EngineCore) -> dict:
    """The engine's resolved capacities and device, for the server_start record (with
    --tensor-parallel N > 1 also its ranks: pids and memory ledgers)."""
    config = core.config
    device = core.runner.device
    described = {
        "capacities": {
            "max_concurrency": config.max_concurrency,
            "max_context": config.max_context,
            "kv_tokens": config.num_kv_pages * config.page_size,
            "kv_pages": config.num_kv_pages,
            "page_size": config.page_size,
            "prefill_chunk": config.prefill_chunk,
            "mixed_prefill_chunk": config.mixed_prefill_chunk,
            "device_state_slots": config.num_state_slots,
            "host_state_slots": config.num_host_state_slots,
            "host_kv_pages": core.cache.host_kv_pool.num_pages if core.cache.host_kv_pool else 0,
            "max_private_continuations": config.num_private_continuations,
            "max_shared_prefixes": config.num_shared_prefixes,
            "max_long_anchors_per_continuation": config.num_long_anchors,
            "prefix_reuse": config.prefix_reuse,
            "kv_dtype": config.kv_dtype,
        },
        "cuda_graph_batch_sizes": sorted(core.runner.graphs.batch_sizes) if core.runner.graphs else [],
        "decode_overlap": core.decode_overlap,
        "speculative": _speculative(core),
        "memory": {**core.memory_ledger, "workspace": {
            "capacity_bytes": core.workspace_bytes,
            "source": "warm_up_peak" if core.workspace_bytes is not None else "not_measured",
        }},
        "host_tier": _host_tier(core),
        "weight_format": core.weight_format,
        "vision_encoder": _vision(core),
        "context_costs": {"source": core.context_costs.source,
                          "prefill_seconds_per_token": core.context_costs.prefill_seconds_per_token,
                          "host_transfer_bytes_per_second": core.context_costs.host_transfer_bytes_per_second},
        "device": {
            "type": device.type,
            "name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": str(torch.__version__),
            "cuda": torch.version.cuda,
        },
    }
    if core.followers is not None:
        described["tensor_parallel"] = {
            "size": config.tensor_parallel,
            "follower_pids": core.followers.pids,
            "rank_memory": core.rank_memory,
        }
    return described


def _host_tier(core: EngineCore) -> dict:
    """The pinned host tier's capacity and what it holds now (spilled StateImages and KV)."""
    host_states, host_kvs = core.runner.host_states, core.runner.host_kvs
    host_pool, host_kv = core.cache.host_pool, core.cache.host_kv_pool
    page_bytes = sum(HostKV.page_bytes(cache) for cache in core.runner.paged_caches)
    return {
        "state_slots": host_pool.num_slots,
        "state_slots_used": host_pool.num_slots - host_pool.num_free,
        "state_slot_bytes": host_states.bytes_per_slot,
        "kv_pages": host_kv.num_pages if host_kv else 0,
        "kv_pages_used": host_kv.num_used if host_kv else 0,
        "kv_page_bytes": page_bytes,
        "pinned_bytes": host_states.num_slots * host_states.bytes_per_slot
        + (host_kvs[0].num_pages if host_kvs else 0) * page_bytes,
    }


def _vision(core: EngineCore) -> dict | None:
    """With --vision: the encoder's measured peak (with --kv-capacity auto on CUDA, else None)
    and the hand-off of its output rows to prompt steps (MediaEmbeddings): capacity and use."""
    media = core.runner.media
    if media is None:
        return None
    config = media.tower.config
    row_bytes = config.out_hidden_size * media.dtype.itemsize
    return {
        "encode_peak_bytes": core.memory_ledger.get("vision_encode"),
        "handoff": {
            "capacity_tokens": media.capacity_tokens,
            "row_bytes": row_bytes,
            "capacity_bytes": media.capacity_tokens * row_bytes,
            "used_tokens": media.held_tokens,
        },
    }


def _speculative(core: EngineCore) -> dict | None:
    """The speculative backend as started (None without --spec)."""
    config = core.config
    if config.spec is None:
        return None
    graphs = core.runner.verify_graphs
    return {
        "backend": config.spec,
        "draft_tokens": config.num_draft_tokens,
        "lm_head_draft": config.lm_head_draft,
        "adaptive_drafts": config.adaptive_drafts,
        "verify_graph_batch_sizes": sorted(graphs.forward_graphs) if graphs is not None else [],
    }
