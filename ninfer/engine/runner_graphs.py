"""The runner's CUDA graphs, captured once at start-up: decode rounds (cuda_graphs.py), speculative
rounds and their commits (verify_graphs.py), prompt and mixed steps (step_graphs.py).

Capture failures are not fatal: an op that is not capture-safe logs the failure and its steps run
eagerly; the warm-up runs' writes to scratch pages and slots are undone either way.
"""

from __future__ import annotations

import logging
import time

import torch

from ninfer.engine.cuda_graphs import DecodeGraphs, graph_blocker
from ninfer.engine.sampler import Sampler
from ninfer.engine.speculative.speculator import Speculator
from ninfer.engine.step_graphs import StepGraphs, token_buckets
from ninfer.engine.verify_graphs import VerifyGraphs
from ninfer.kernels.compile_manifest import counting_compiles
from ninfer.kernels.gemv import MAX_ROWS as GEMV_MAX_ROWS
from ninfer.kernels.gemv import UNQUANTIZED_GEMV_MAX_ROWS
from ninfer.kernels.moe.kernel_choice import token_switches as moe_token_switches
from ninfer.kernels.moe_block import MAX_TOKENS as MOE_BLOCK_MAX_TOKENS
from ninfer.models.causal_lm import CausalLM
from ninfer.models.quant.weight_format import weight_format

log = logging.getLogger("ninfer.engine")
# Replays of each round kind when the start-up times a speculative round against a plain one.
ROUND_TIMING_WARMUP, ROUND_TIMING_REPS = 1, 5  # ~0.2 s of a 27B start with --spec


def step_graph_blocker(model: CausalLM, num_draft_tokens: int, spec_backend: str = "mtp") -> str | None:
    """Why prompt and mixed steps of this configuration run eagerly, or None. The MTP head reads a
    replayed step's final hidden states (its pass runs eagerly after the replay); a DFlash drafter
    also reads residual streams from inside the forward."""
    if num_draft_tokens and spec_backend != "mtp":
        return f"the {spec_backend} drafter (it reads the target's residual streams in every prompt step)"
    if next(model.parameters()).is_cuda:
        return graph_blocker(model)
    return None


def build_step_graphs(
    model: CausalLM, kv, state_cache, slot_logits: torch.Tensor, num_valid_tokens: int, decode: DecodeGraphs | None,
    device: torch.device, max_tokens: int, max_requests: int, max_context: int, scratch_slot: int, scratch_page: int,
    while_idle: bool = False, keep_hidden: bool = False,
) -> StepGraphs | None:  # fmt: skip
    """Step graphs over token buckets up to max_tokens, captured on CUDA into the decode graphs'
    pool (on the CPU, tests run their padded forward uncaptured); None if capture failed.
    while_idle: capture none now; the runner captures them one by one while the engine is idle
    (capture_next_step_graph). keep_hidden: for a drafter that reads the step's hidden states."""
    max_pages = min(kv.num_pages, -(-max_context // kv.page_size))
    # Layers hand over from the GEMV to a matmul at a row count: 16-bit (and NVFP4) ones above
    # 16 rows (cuBLAS, the NVFP4 GEMM), FP8 ones above the GEMV's limit (the FP8 matmul). A
    # bucket ends at each, so a padded step runs the products its eager step runs (routers and
    # other 16-bit layers run at the bucket's rows in FP8 models too).
    switches = (UNQUANTIZED_GEMV_MAX_ROWS,) + ((GEMV_MAX_ROWS,) if weight_format(model) == "fp8" else ())
    if model.config.is_moe:
        # The fused decode block up to its token limit, then each change of expert kernels or tiles.
        switches += (MOE_BLOCK_MAX_TOKENS,) + moe_token_switches(model.config.num_experts, model.config.num_experts_per_tok)
    buckets = token_buckets(max_tokens, switches)
    graphs = StepGraphs(model, kv, state_cache, slot_logits, num_valid_tokens, buckets, max_requests, max_pages,
                        scratch_slot, scratch_page, keep_hidden)  # fmt: skip
    # Into the decode graphs' pool: a replay's intermediates are free by the next replay.
    pool = decode.pool if decode is not None else None
    if device.type == "cuda" and while_idle:
        graphs.begin_capture(pool)
        log.info("CUDA graphs for prompt and mixed steps of %s tokens: captured while the engine is idle",
                 ", ".join(map(str, buckets)))  # fmt: skip
    elif device.type == "cuda":
        started = time.perf_counter()
        try:
            graphs.capture(pool)
        except Exception:  # noqa: BLE001 - as for the decode graphs: such steps run eagerly instead
            log.exception("step graph capture failed; prompt and mixed steps run eagerly")
            return None
        log.info("CUDA graphs captured for prompt and mixed steps of %s tokens in %.1f s",
                 ", ".join(map(str, buckets)), time.perf_counter() - started)  # fmt: skip
    return graphs


def capture_decode_graphs(
    model: CausalLM, kv, state_cache, slot_logits: torch.Tensor, num_valid_tokens: int, batch_sizes: list[int],
    max_context: int, sampler: Sampler, speculator: Speculator | None,
) -> tuple[DecodeGraphs | None, VerifyGraphs | None]:  # fmt: skip
    """Decode graphs for batch_sizes, and with a speculator its verify graphs: (decode, verify),
    None where the model, the drafter or a capture does not allow them."""
    blocker = graph_blocker(model)
    if blocker is not None:
        log.info("CUDA graphs off: %s", blocker)
        return None, None
    if speculator is not None and not getattr(speculator.drafter, "capturable", False):
        log.info("CUDA graphs off: the drafter cannot be captured")
        return None, None
    max_pages = min(kv.num_pages, -(-max_context // kv.page_size))
    graphs = DecodeGraphs(model, kv, state_cache, slot_logits, num_valid_tokens, batch_sizes, max_pages, sampler,
                          speculator=speculator)  # fmt: skip
    started = time.perf_counter()
    try:
        graphs.capture()
    except Exception:  # noqa: BLE001 - an op that is not capture-safe must not stop the server
        log.exception("CUDA graph capture failed; decoding eagerly")
        graphs.discard_warmup_writes()
        if speculator is not None:
            for slot in range(graphs.max_batch):
                speculator.reset_slot(slot)  # the drafter's context pass wrote their hidden
        return None, None
    log.info("CUDA graphs captured for decode batch sizes %s in %.1f s", ", ".join(map(str, batch_sizes)),
             time.perf_counter() - started)  # fmt: skip
    verify = _capture_verify_graphs(model, kv, state_cache, graphs, speculator, batch_sizes, max_context) if speculator else None
    return graphs, verify


def _capture_verify_graphs(
    model: CausalLM, kv, state_cache, decode: DecodeGraphs, speculator: Speculator, batch_sizes: list[int], max_context: int
) -> VerifyGraphs | None:
    """Speculative rounds of every batch size, and the commits before them, when the drafter
    can be captured (test drafters that read the host cannot)."""
    # A round writes K+1 positions past the last committed token (Admission.spare_tokens).
    width = max_context + speculator.num_draft_tokens + 1
    max_pages = min(kv.num_pages, -(-width // kv.page_size))
    batch_sizes = [b for b in batch_sizes if b <= speculator.max_batch]
    graphs = VerifyGraphs(model, kv, state_cache, speculator, batch_sizes, max_pages)
    pool = torch.cuda.graph_pool_handle()
    try:
        speculator.capture_commit_graphs(pool)
        graphs.capture(pool)
        graphs.round_cost_ratio = time_round_ratio(decode, graphs, speculator)
    except Exception:  # noqa: BLE001 - as for the decode graphs: verify eagerly instead
        log.exception("verify graph capture failed; speculative rounds run eagerly")
        speculator.discard_commit_graphs()
        return None
    finally:
        # The warm-up runs wrote KV page 0 and slots 0..max_batch-1 (states, logits, hidden).
        decode.discard_warmup_writes()
        for slot in range(graphs.max_batch):
            speculator.reset_slot(slot)
    log.info("CUDA graphs captured for speculative rounds of %d drafts, batch sizes %s%s",
             speculator.num_draft_tokens, ", ".join(map(str, batch_sizes)),
             "" if graphs.round_cost_ratio is None else
             f"; a round of batch 1 costs {graphs.round_cost_ratio:.2f} plain rounds")  # fmt: skip
    return graphs


def time_round_ratio(decode: DecodeGraphs, verify: VerifyGraphs, speculator: Speculator) -> float | None:
    """A batch-1 speculative round's time over a plain decode round's: the captured graphs
    replayed on their capture inputs (a near-empty context), the commit before the verification
    included; None where either is not captured. Their writes land where the captures' did."""
    commit = speculator.commit_graph(1)
    plain = [decode.graphs.get(1), decode.sample_graphs.get((1, True))]
    speculative = [commit, verify.forward_graphs.get(1), verify.judge_graphs.get((1, True))]
    if any(graph is None for graph in plain + speculative):
        return None

    def elapsed_ms(graphs: list[torch.cuda.CUDAGraph]) -> float:
        for _ in range(ROUND_TIMING_WARMUP):
            for graph in graphs:
                graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(ROUND_TIMING_REPS):
            for graph in graphs:
                graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    try:
        return elapsed_ms(speculative) / elapsed_ms(plain)
    except Exception:  # noqa: BLE001 - the graphs stay; the draft policy keeps its table's level
        log.warning("speculative round not timed; the adaptive draft policy uses its measured table", exc_info=True)
        return None


def capture_next_step_graph(graphs: StepGraphs) -> None:
    """Capture one pending step graph (the engine is idle); a failure leaves the buckets not yet
    captured eager, the captured ones keep replaying."""
    bucket, snapshots = graphs.pending[0]
    started = time.perf_counter()
    try:
        with counting_compiles() as compiled:
            graphs.capture_next()
    except Exception:  # noqa: BLE001 - as at start-up: those steps run eagerly instead
        log.exception("step graph capture failed; prompt and mixed steps of the buckets left run eagerly")
        graphs.pending.clear()
        return
    # A request that arrives meanwhile waits for the capture: its time bounds that wait, and
    # kernels compiled inside it are what a slow capture usually costs.
    phases = ", ".join(f"{name} {seconds:.2f} s" for name, seconds in graphs.last_phases.items())
    log.debug("step graph of %d tokens%s captured in %.2f s while idle (%s; %d GPU kernels compiled or loaded)",
              bucket, " with a checkpoint inside" if snapshots else "", time.perf_counter() - started, phases,
              compiled[0])  # fmt: skip
    if not graphs.pending:
        log.info("CUDA graphs captured for prompt and mixed steps of %s tokens in %.1f s, while idle",
                 ", ".join(map(str, graphs.buckets)), graphs.capture_seconds)  # fmt: skip
