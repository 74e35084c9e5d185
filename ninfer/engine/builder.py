"""Build an EngineCore from an EngineSpec: runs in the engine process (or an in-process engine's thread).

The start-up checks come first, before any weight is read or the load is logged, so a refused
start reports its one error.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import math
import os
import sys
import time
from pathlib import Path

import torch

from ninfer.assets.qwen_tokenizer import cache_dir
from ninfer.config import EngineConfig, EngineSpec
from ninfer.engine.background_imports import start_background_imports
from ninfer.engine.cache.host_kv import HostKV
from ninfer.engine.compiled_grammars import CompiledGrammars
from ninfer.engine.core import EngineCore, kv_page_bytes, state_image_bytes
from ninfer.engine.faults import install_faults
from ninfer.engine.kv_sizing_record import AutoSizing, KvSizingRecords, ProbeMeasure, probe_key
from ninfer.engine.pinned_allocator import configure_pinned_allocator
from ninfer.engine.speculative.drafter_factory import quantize_drafter_fp8_
from ninfer.engine.start_compiles import StartCompiles, model_identity
from ninfer.engine.startup_checks import check_kv_dtype, check_speculative, check_tensor_parallel, resolve_device
from ninfer.engine.warm_up import WarmUpReport, run_warm_up, warm_up_plan
from ninfer.engine.warm_up_record import WarmUpRecords
from ninfer.frontend.grammar_vocabulary import GrammarVocabulary
from ninfer.kernels.backend import persist_compile_caches
from ninfer.models.quant.fp8 import Fp8Linear
from ninfer.models.quant.fp8_experts import Fp8Experts
from ninfer.models.quant.nvfp4_experts import Nvfp4Experts
from ninfer.models.quant.nvfp4 import Nvfp4Linear
from ninfer.models.quant.half_weights import store_half_weights_
from ninfer.host_cpus import usable_cpus

log = logging.getLogger("ninfer.engine")

KV_HEADROOM_BYTES = 1 << 30  # --kv-capacity auto leaves this much device memory free
# Environment settings a kept KV-sizing record depends on (kernel choice, PDL, the allocator).
_PROBE_SETTINGS = ("NINFER_KERNELS", "NINFER_PDL", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
_AUTO_LEDGER: dict[str, int] = {}  # the last auto sizing's terms, for the server_start record


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
    available = usable_cpus()
    return max(1, available // 2)


def build_engine_core(spec: EngineSpec) -> EngineCore:
    """With --tensor-parallel N this is rank 0: it spawns ranks 1..N-1 (parallel/follower.py), which
    load their shards beside it and then repeat its runner's calls until it stops them."""
    started = time.perf_counter()
    start_background_imports()
    engine, artifact, companion = open_checked(spec)
    # Only now: a refused start prints its one error line and nothing else.
    from ninfer.engine import process

    if process.main_entered_at is not None:
        # The engine process's own start: torch and the engine's modules (seconds on a GPU host).
        log.info("engine process: torch and the engine imported in %.1fs", _IMPORTED_AT - process.main_entered_at)
    log.info("start-up checks passed in %.1fs (the artifact opened, its tensors' names and shapes read)",
             time.perf_counter() - started)
    if engine.tensor_parallel == 1:
        return _build(spec, engine, artifact, companion, started)
    from ninfer.parallel.followers import Followers

    followers = Followers.start(spec, engine.device, log.getEffectiveLevel())
    try:
        return _build(spec, engine, artifact, companion, started, followers)
    except BaseException:
        followers.stop()
        raise


def open_checked(spec: EngineSpec, rank: int = 0):
    """The start-up checks, before any weight is read: -> (the engine config with its device
    resolved for `rank`, the artifact opened with its weights, a DFlash / DFlash2 drafter or None)."""
    engine = spec.engine
    if spec.device_index is not None:
        engine = dataclasses.replace(engine, device=resolve_device(spec.device_index, engine.tensor_parallel))
    if rank:
        engine = dataclasses.replace(engine, device=rank_device(engine.device, rank))
    from ninfer.artifact import open_artifact

    artifact = open_artifact(spec.artifact_path)
    check_kv_dtype(artifact.config, engine)
    check_tensor_parallel(artifact, engine)
    companion = check_speculative(artifact, engine)  # a DFlash / DFlash2 drafter, still unread
    if artifact.config.mtp_num_hidden_layers and engine.spec != "mtp":
        # The MTP head's weights and KV layer are loaded only when speculation uses them.
        artifact.config = artifact.config.replace(mtp_num_hidden_layers=0)
    return engine, artifact, companion


def load_trunk(spec: EngineSpec, engine: EngineConfig, artifact, started: float, shard=None, announce: bool = True,
               compiles: StartCompiles | None = None):
    """The model's weights on engine.device (one rank's part with `shard`), stored as the engine
    runs them; announce: log the load's milestones at info (a follower rank logs them at debug);
    compiles: rank 0's kernel manifest, begun once CUDA started and waited for after the load."""
    say = log.info if announce else log.debug
    device = engine.device
    dtype = resolve_dtype(spec.dtype, artifact.config.torch_dtype, device)
    on_cpu = not device.startswith("cuda")
    if on_cpu:
        torch.set_num_threads(cpu_threads())
    else:
        # A fresh engine process starts CUDA here: the memory statistics below need its allocator,
        # and Triton launches on the current device (a tensor-parallel rank's own).
        cuda_began = time.perf_counter()
        index = torch.device(device).index  # "cuda" alone: the current device
        torch.cuda.set_device(torch.cuda.current_device() if index is None else index)
        configure_pinned_allocator()
        say("CUDA started on %s in %.1fs", device, time.perf_counter() - cuda_began)
        persist_compile_caches(str(cache_dir()))
        # A restart loads the compiled kernels and autotuning choices from here instead of redoing them.
        say("compiled GPU kernels cached in %s ($NINFER_CACHE_DIR names another folder)", os.environ["TRITON_CACHE_DIR"])
        if compiles is not None:
            compiles.begin(launches_during_load=spec.quantize is not None)
    say(
        "loading %s (%s, %s) on %s%s%s",
        artifact.model_id,
        artifact.config.model_type,
        str(dtype).removeprefix("torch."),
        device,
        f" ({torch.get_num_threads()} threads)" if on_cpu else "",
        f", rank {shard.rank}'s part of {shard.size}" if shard is not None else "",
    )
    # The bar is a transient terminal line; redirected stderr gets only the milestone records.
    # --quantize keeps a checkpoint already in that format as stored, on any device, and
    # quantizes every other weight as it arrives: only the quantized model is ever resident.
    keep_fp8 = True if spec.quantize == "fp8" else None
    keep_nvfp4 = True if spec.quantize == "nvfp4" else None
    if not on_cpu:
        torch.cuda.reset_peak_memory_stats(device)
    load_began = time.perf_counter()
    model = artifact.load_model(
        dtype=dtype,
        device=device,
        progress=announce and sys.stderr.isatty(),
        keep_fp8=keep_fp8,
        keep_nvfp4=keep_nvfp4,
        quantize=spec.quantize,
        shard=shard,
    )
    num_params = _num_weights(model)
    load_seconds, weight_gb = time.perf_counter() - load_began, model_bytes(model) / 1e9
    # Since the engine's start (what a restart waits for), then the weights' own read and placement.
    say("model loaded in %.1fs: %.2fB parameters (%.1f GB of weights placed in %.1f s, %.1f GB/s)",
        time.perf_counter() - started, num_params / 1e9, weight_gb, load_seconds,
        weight_gb / max(load_seconds, 1e-9))  # fmt: skip
    if spec.quantize is not None:
        say("--quantize %s: %s", spec.quantize, describe_quantized(model))
    if compiles is not None:
        compiles.loaded()
    if not on_cpu:
        say(
            "load peak %.2f GiB of device memory for a model of %.2f GiB",
            torch.cuda.max_memory_allocated(device) / (1 << 30),
            model_bytes(model) / (1 << 30),
        )
        # The tensors read onto the device on their way to the weights: free for the KV sizing to see.
        torch.cuda.empty_cache()
    if cpu_half_weights(spec.dtype, dtype, device):
        say("Linear weights stored in float16 for decode: %d layers", store_half_weights_(model))
    return model, dtype


def _build(spec: EngineSpec, engine: EngineConfig, artifact, companion, started: float, followers=None) -> EngineCore:
    device = engine.device
    on_cpu = not device.startswith("cuda")
    stored = "fp8" if artifact.fp8_weights else "nvfp4" if artifact.nvfp4_weights else "plain"
    compiles = None
    if not on_cpu:
        # The dtype the weights run in, however it was asked for (--dtype auto or bfloat16: one manifest).
        dtype = str(resolve_dtype(spec.dtype, artifact.config.torch_dtype, device)).removeprefix("torch.")
        compiles = StartCompiles(model_identity(artifact.config, dtype, spec.quantize, stored), cache_dir())
    try:
        core = _build_core(spec, engine, artifact, companion, started, followers, compiles)
    except BaseException:
        if compiles is not None:
            compiles.end(keep=False)
        raise
    if compiles is not None and core.has_background_work:
        # Step graphs captured in idle turns compile kernels too (the final engine's first capture
        # can meet specializations the sizing probe did not): the record goes on until they are
        # done and is kept after each, so a process that ends before still keeps what it met.
        compiles.save()
        core.after_background_steps(lambda done: compiles.end(keep=True) if done else compiles.save())
    elif compiles is not None:
        compiles.end(keep=True)
    return core


def _build_core(spec: EngineSpec, engine: EngineConfig, artifact, companion, started: float, followers,
                compiles: StartCompiles | None) -> EngineCore:
    device = engine.device
    on_cpu = not device.startswith("cuda")
    try:
        shard = None
        if followers is not None:
            from ninfer.parallel.shard_plan import ShardPlan

            shard = ShardPlan(artifact.config, 0, engine.tensor_parallel)
        model, dtype = load_trunk(spec, engine, artifact, started, shard, compiles=compiles)
    except BaseException as error:
        if followers is not None:
            followers.agree_started(error)  # the followers learn that rank 0 failed, and leave
        raise
    if followers is not None:
        from ninfer.parallel.partial_sums import reduce_partial_sums

        followers.agree_started(None)  # raises a follower's start-up error
        reduce_partial_sums(model, followers.group)
    draft_model = None
    if companion is not None:
        draft_model = companion.load_model(dtype=dtype, device=device)
        log.info(
            "%s drafter loaded from %s: %d layers, block %d, %.2fB parameters",
            engine.spec, companion.path, companion.config.num_hidden_layers, companion.config.block_size,
            sum(p.numel() for p in draft_model.parameters()) / 1e9,
        )
    quantize_drafter_at_load(engine, model, draft_model)
    vision_tower = None
    if engine.vision:
        from ninfer.models.vision_loader import load_vision_tower

        vision_tower = load_vision_tower(artifact, device=device, dtype=dtype)
        log.info("vision tower loaded: %.2fB parameters", sum(p.numel() for p in vision_tower.parameters()) / 1e9)
    auto_sizing = None
    # One set for the probe's engine and the served one: the vocabulary index builds once.
    grammars = CompiledGrammars(GrammarVocabulary(artifact.tokenizer, model.config.vocab_size))
    if spec.kv_capacity_auto:
        kv_tokens, auto_sizing = _auto_kv_tokens(
            model, artifact.tokenizer, engine, draft_model, vision_tower, followers, grammars=grammars
        )
        engine = dataclasses.replace(engine, kv_capacity=kv_tokens)
    # A served engine is ready before its step graphs are captured: they are captured while it is
    # idle (a tensor-parallel engine captures them now, every rank in step).
    core = EngineCore(
        model, artifact.tokenizer, engine, draft_model=draft_model, vision_tower=vision_tower, followers=followers,
        step_graphs_while_idle=followers is None, grammars=grammars,
    )
    kv_bytes = sum(cache.nbytes for cache in core.runner.paged_caches)
    core.memory_ledger.update(_AUTO_LEDGER if spec.kv_capacity_auto else {})
    core.memory_ledger.update(
        kv_pool=kv_bytes,
        state_slots=engine.num_state_slots * state_image_bytes(model),
    )
    host = core.runner.host_states
    host_kv_pages = core.runner.host_kvs[0].num_pages
    log.info(
        "KV pool: %d tokens in %d pages (%.1f MiB%s) · state slots: %d (%d active + %d checkpoint)"
        " · host state slots: %d (%.1f MiB pinned) · host KV: %d pages (%.1f MiB pinned)",
        engine.num_kv_pages * engine.page_size,
        engine.num_kv_pages,
        kv_bytes / (1 << 20),
        " on each rank" if followers is not None else "",
        engine.num_state_slots,
        engine.max_concurrency,
        engine.num_state_slots - engine.max_concurrency,
        host.num_slots,
        host.num_slots * host.bytes_per_slot / (1 << 20),
        host_kv_pages,
        host_kv_pages * sum(HostKV.page_bytes(cache) for cache in core.runner.paged_caches) / (1 << 20),
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
    if not on_cpu:
        core.workspace_bytes = _warm_up_measuring_workspace(core, draft_model)
        if auto_sizing is not None:
            auto_sizing.confirm(core.workspace_bytes)
    if followers is not None:
        core.rank_memory = rank_memory_ledgers(core, model)
    install_faults(core.runner)  # tests only: nothing unless NINFER_TEST_FAULTS is set
    return core


def quantize_drafter_at_load(engine: EngineConfig, model, draft_model=None) -> None:
    """--draft-fp8 before any engine measures its memory: the drafter's layers in FP8 now and
    the bf16 ones freed (the runner's own call then finds nothing left to quantize)."""
    if not engine.draft_fp8:
        return
    count = quantize_drafter_fp8_(model, draft_model)
    if not count:
        log.info("--draft-fp8: the drafter's layers are already quantized; nothing to do")
        return
    if engine.device.startswith("cuda"):
        torch.cuda.empty_cache()
    log.info("--draft-fp8: %d drafter layers in FP8 per output channel", count)


def rank_device(device: str, rank: int) -> str:
    """The device of tensor-parallel rank `rank` when rank 0's is `device`: the CPU, or the CUDA
    device `rank` places after rank 0's."""
    if not device.startswith("cuda"):
        return device
    index = int(device.partition(":")[2] or 0)
    return f"cuda:{index + rank}"


def memory_ledger(runner, model) -> dict[str, int]:
    """One rank's resident device memory by use, in bytes: its weights, KV pool and state slots
    (with each slot's stored logits)."""
    states = runner.state_cache
    return {
        "weights": model_bytes(model),
        "kv_pool": sum(cache.nbytes for cache in runner.paged_caches),
        "state_slots": runner.slot_logits.nbytes + (states.conv.nbytes + states.recurrent.nbytes if states else 0),
    }


def rank_memory_ledgers(core: EngineCore, model) -> list[dict[str, int]]:
    """Every rank's memory ledger, by rank (the followers report theirs)."""
    from ninfer.parallel.commands import ReportMemory

    core.followers.send(ReportMemory())
    ledgers = core.followers.group.gather(memory_ledger(core.runner, model))
    for rank, ledger in enumerate(ledgers):
        log.info(
            "rank %d: weights %.1f MiB · KV pool %.1f MiB · state slots %.1f MiB", rank,
            *(ledger[k] / (1 << 20) for k in ("weights", "kv_pool", "state_slots")),
        )
    return ledgers


def describe_quantized(model) -> str:
    """What the model holds quantized, by module kind and scale layout."""
    fp8 = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    experts = [m for m in model.modules() if isinstance(m, Fp8Experts)]
    per_row_experts = sum(m.rows_per_block("down_proj") is None for m in experts)
    counts = {
        "FP8 Linear layers (one scale per output row)": sum(not m.block_scaled for m in fp8),
        "FP8 Linear layers (a checkpoint's block scales)": sum(m.block_scaled for m in fp8),
        "FP8 expert groups (one scale per output row)": per_row_experts,
        "FP8 expert groups (a checkpoint's block scales)": len(experts) - per_row_experts,
        "NVFP4 Linear layers": sum(isinstance(m, Nvfp4Linear) for m in model.modules()),
        "NVFP4 expert groups": sum(isinstance(m, Nvfp4Experts) for m in model.modules()),
    }
    return ", ".join(f"{count} {kind}" for kind, count in counts.items() if count) or "nothing"


def model_bytes(model) -> int:
    """Bytes of the model's parameters and buffers (a tied tensor once)."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _warm_up_measuring_workspace(core: EngineCore, draft_model) -> int:
    """Compile and autotune every step shape before /health turns ready (the short warm-up where
    the full one already ran: warm_up_record.py); -> the device memory the warm-up's steps
    reserved beyond what was resident before it (the step workspace: the worst step is among
    them; pools, weights and decode graphs exist already)."""
    device = core.runner.device
    torch.cuda.synchronize(device)
    resident = torch.cuda.memory_reserved(device)
    torch.cuda.reset_peak_memory_stats(device)
    _run_warm_up_once(core, draft_model)
    torch.cuda.synchronize(device)
    return max(0, torch.cuda.max_memory_reserved(device) - resident)


def _run_warm_up_once(core: EngineCore, draft_model, full: bool | None = None) -> WarmUpReport:
    """The full warm-up (full=None: unless one already ran to the end under the same plan, code,
    device, libraries and kernel cache; then the short one); a full one is recorded."""
    model = core.runner.model
    records = WarmUpRecords(cache_dir() / "warm-up")
    kernel_cache = os.environ.get("TRITON_CACHE_DIR", "")
    key = probe_key(
        "warm-up", warm_up_plan(core.config, core.tokenizer.vocab_size),
        *_probe_inputs(model, draft_model, core.runner.device), kernel_cache,
    )  # fmt: skip
    if full is None:
        # A kernel cache emptied since (its folder removed) needs the full one again.
        full = not (records.has(key) and Path(kernel_cache).is_dir() and any(Path(kernel_cache).iterdir()))
    report = run_warm_up(core, full=full)
    if full:
        records.store(key)
    return report


def _num_weights(model) -> int:
    """Parameters plus quantized weights, which are buffers of their modules (two NVFP4 codes a byte)."""
    return (
        sum(p.numel() for p in model.parameters())
        + sum(m.weight.numel() for m in model.modules() if isinstance(m, Fp8Linear))
        + sum(m.gate_up_proj.numel() + m.down_proj.numel() for m in model.modules() if isinstance(m, Fp8Experts))
        + sum(2 * m.weight.numel() for m in model.modules() if isinstance(m, Nvfp4Linear))
        + sum(m.num_weights for m in model.modules() if isinstance(m, Nvfp4Experts))
    )


def _vision_reserve(tower, device: torch.device) -> tuple[int, int]:
    """(encode peak, kept rows) in bytes: the tower's measured peak over one prompt's whole media
    envelope as one image (its attention spans every row), and the encoded rows MediaEmbeddings
    keeps at most."""
    from ninfer.engine.media_embeddings import DEFAULT_CAPACITY_TOKENS
    from ninfer.media.preparer import RequestMediaLimits

    config = tower.config
    merge = config.spatial_merge_size
    side = merge * math.isqrt(RequestMediaLimits().max_patch_rows // merge**2)  # a square grid of merged tokens
    dtype = next(tower.parameters()).dtype
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_reserved(device)
    torch.cuda.reset_peak_memory_stats(device)
    with torch.no_grad():
        patches = torch.zeros(side * side, config.patch_dim, device=device, dtype=dtype)
        tower(patches, [(1, side, side)])
        del patches
    torch.cuda.synchronize(device)
    peak = max(0, torch.cuda.max_memory_reserved(device) - base)
    torch.cuda.empty_cache()
    kept_rows = DEFAULT_CAPACITY_TOKENS * config.out_hidden_size * dtype.itemsize
    return peak, kept_rows


def _auto_kv_tokens(
    model, tokenizer, engine: EngineConfig, draft_model=None, vision_tower=None, followers=None,
    grammars: CompiledGrammars | None = None,
) -> tuple[int, AutoSizing | None]:
    """The KV pool that leaves room for everything else the runtime needs at its worst, measured:
    a probe engine with a small pool captures the CUDA graphs and runs the warm-up (whose
    largest step is a whole --prefill-chunk); its peak beyond its own pools is set aside with
    the state slots and 1 GiB of headroom, and with --vision the tower's encode peak and the
    encoded rows kept. A restart of the same model, configuration, device and code takes the
    probe's figures from its record (kv_sizing_record.py). CPU follows --max-context.
    With tensor-parallel followers the probe runs on every rank, each rank sizes its own pool from
    its free memory, and the smallest pool wins."""
    if not engine.device.startswith("cuda"):
        return engine.max_context, None
    device = torch.device(engine.device)
    page_bytes = kv_page_bytes(model, engine.page_size, draft_model, engine.kv_dtype)
    slot_bytes = state_image_bytes(model)  # a StateImage slot with its stored logits
    probe_config = dataclasses.replace(
        engine,
        kv_capacity=engine.prefill_chunk + engine.mixed_prefill_chunk + 4 * engine.max_concurrency * engine.page_size,
        host_state_slots=0,
        host_kv_mib=0,
        log_stats_interval_ms=0,
    )
    records = KvSizingRecords(cache_dir() / "kv-sizing")
    key = probe_key(repr(probe_config), *_probe_inputs(model, draft_model, device))
    measure = records.load(key)
    kept = measure is not None
    if measure is None:
        measure = _probe(model, tokenizer, probe_config, draft_model, page_bytes, slot_bytes, followers, grammars)
        records.store(key, measure)
    worst_step, graphs = measure.worst_step_bytes, measure.graph_bytes
    vision_encode, media_rows = _vision_reserve(vision_tower, device) if vision_tower is not None else (0, 0)
    free, _ = torch.cuda.mem_get_info(device)
    states = engine.num_state_slots * slot_bytes
    reserved = KV_HEADROOM_BYTES + worst_step + graphs + states + vision_encode + media_rows
    budget = free - reserved
    # Running requests and device checkpoints each hold a state slot and at most max_context tokens.
    usable = engine.num_state_slots * (engine.max_context + engine.spare_kv_tokens)
    tokens = kv_tokens_in(free, reserved, page_bytes, engine.page_size, usable)
    if followers is not None:
        from ninfer.parallel.commands import AgreeKvTokens

        followers.send(AgreeKvTokens(reserved, page_bytes, engine.page_size, usable))
        tokens = followers.group.min_over_ranks(tokens)
    gib = 1 << 30
    log.info(
        "KV sizing (--kv-capacity auto%s): %.2f GiB free after the weights − worst step (%d tokens) %.2f GiB"
        " − CUDA graphs %.2f GiB − %d state slots %.2f GiB%s − headroom %.2f GiB = %.2f GiB: %d KV tokens%s",
        ", the probe's figures kept from an earlier start" if kept else "",
        free / gib, measure.worst_step_tokens, worst_step / gib, graphs / gib, engine.num_state_slots,
        states / gib,
        f" − vision encode {vision_encode / gib:.2f} GiB − encoded media rows {media_rows / gib:.2f} GiB"
        if vision_tower is not None else "",
        KV_HEADROOM_BYTES / gib, max(0, budget) / gib, tokens,
        f" (all that {engine.num_state_slots} slots x --max-context can use)" if usable < budget // page_bytes * engine.page_size else "",
    )
    if followers is not None:
        log.info("KV sizing: %d KV tokens on every rank (the smallest rank's answer)", tokens)
    _AUTO_LEDGER.update(free_after_weights=free, worst_step=worst_step, decode_graphs=graphs, state_slots=states,
                        headroom=KV_HEADROOM_BYTES, kv_budget=max(0, budget))
    if vision_tower is not None:
        _AUTO_LEDGER.update(vision_encode=vision_encode, media_rows=media_rows)
    return tokens, AutoSizing(records, key, measure)


def kv_tokens_in(free_bytes: int, reserved_bytes: int, page_bytes: int, page_size: int, max_tokens: int) -> int:
    """--kv-capacity auto: the whole pages that fit the free memory less what must stay free (at
    least one page), at most max_tokens."""
    pages = max(1, (free_bytes - reserved_bytes) // page_bytes)
    return min(pages * page_size, max_tokens)


def _probe(
    model, tokenizer, probe_config: EngineConfig, draft_model, page_bytes: int, slot_bytes: int, followers=None,
    grammars: CompiledGrammars | None = None,
) -> ProbeMeasure:
    """Build an engine with the probe's small pool and run the warm-up: the device memory its CUDA
    graphs and its worst step reserve beyond its pools."""
    device = torch.device(probe_config.device)
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_reserved(device)
    probe = EngineCore(model, tokenizer, probe_config, draft_model=draft_model, followers=followers, grammars=grammars)
    probe_pools = probe_config.num_kv_pages * page_bytes + probe_config.num_state_slots * slot_bytes
    graphs = max(0, torch.cuda.memory_reserved(device) - base - probe_pools)
    torch.cuda.reset_peak_memory_stats(device)
    # Always the full warm-up: the probe measures the memory of every step shape.
    report = _run_warm_up_once(probe, draft_model, full=True)
    worst_step = max(0, torch.cuda.max_memory_reserved(device) - base - probe_pools - graphs)
    del probe
    gc.collect()
    torch.cuda.empty_cache()
    return ProbeMeasure(worst_step_bytes=worst_step, graph_bytes=graphs, worst_step_tokens=report.worst_step_tokens)


def _probe_inputs(model, draft_model, device: torch.device) -> tuple[str, ...]:
    """What else the probe's figures depend on: the model's configuration and weight layout, the
    drafter's, the device and the libraries that build the kernels."""
    import triton

    properties = torch.cuda.get_device_properties(device)
    # Settings that change which kernels run or how the allocator reserves memory.
    settings = {name: os.environ.get(name) for name in _PROBE_SETTINGS}
    return (
        repr(model.config),
        describe_quantized(model),
        str(next(model.parameters()).dtype),
        repr(draft_model.config) if draft_model is not None else "",
        f"{properties.name};{properties.total_memory};{properties.multi_processor_count}",
        f"torch={torch.__version__};cuda={torch.version.cuda};triton={triton.__version__}",
        repr(sorted(settings.items())),
    )


_IMPORTED_AT = time.perf_counter()  # this module's imports done (torch and the engine's modules)
