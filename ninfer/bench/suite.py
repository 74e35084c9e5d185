"""The benchmark run: our engine's runner on random-weight real shapes, the roofline, and HF transformers.

What is measured (and stated in the report):
- decode tok/s: decode rounds of B requests at context L through ModelRunner (CUDA-graph
  replay when enabled, sampling included) as the engine runs steady decode: each round is
  launched before the previous round's ids are read (decode overlap), and a round's time is
  the interval between two reads, median of rounds; the note gives the rate with the host
  waiting for every round before launching the next (--no-decode-overlap). KV pages and
  state slots are filled with random data (the values do not change the work);
- prefill tok/s: one request's prompt of P random tokens through the runner in chunks;
- time to first token: the shortest prefill case including its first sampled token (runner only);
- peak GPU memory per case; roofline from bytes streamed per round against the copy bandwidth
  measured in the same run (prefill: FLOPs against the measured bf16 matrix rate);
- HF transformers: the same shape and the same random weights (filled by name), greedy generate;
- the runner is configured as ninfer-serve's engine: KV pages of EngineConfig's page size and,
  unless --prefill-chunk says otherwise, its prefill chunk (both read from EngineConfig, so the
  figures follow the server's defaults);
- the median SM clock over each case's timed part and over the matrix-rate measurement
  (NVML, clocks.py): a power-capped GPU moves it by a third, and prefill follows it;
- speculative verify rounds (--verify-drafts K,...): B requests, each a verification row of
  the pending token and K drafts at context L, with the MTP head drafting (through the
  reduced-vocabulary proposal head unless --no-lm-head-draft) and the commit of a whole
  accepted round before each, as the engine runs them (verify graphs when captured; the host
  reads each round before the next, as speculative decoding does). The round's time against
  the plain decode round of the same B and L (as the engine runs it, overlapped) is the cost
  of speculation; a captured round has fixed shapes, so its time does not depend on what it
  accepts: B(K+1) tokens a round with every draft accepted (the ceiling) and B with none (the
  floor).
"""

from __future__ import annotations

import gc
import gzip
import json
import logging
import shutil
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from ninfer.bench.clocks import ClockSampler, nvml_sm_clock_reader
from ninfer.bench.critical_path import increments_table
from ninfer.bench.random_weights import fill_random_, random_tensors
from ninfer.bench.roofline import (
    DeviceCeilings,
    decode_roofline_tokens_per_s,
    measure_ceilings,
    model_bytes,
    prefill_roofline_tokens_per_s,
)
from ninfer.bench.shapes import shape_config
from ninfer.config import EngineConfig
from ninfer.contract.sampling import SamplingParams
from ninfer.engine.core import kv_page_bytes, state_image_bytes
from ninfer.engine.runner import ModelRunner
from ninfer.engine.scheduler import PENDING_TOKEN, CommitVerified, ScheduledChunk, SchedulerStep, StepKind
from ninfer.models.loader import QUANTIZE_AT_LOAD, build_model, load_weights
from ninfer.models.quant.fp8 import Fp8Linear
from ninfer.models.quant.fp8_experts import Fp8Experts
from ninfer.models.quant.nvfp4 import Nvfp4Linear
from ninfer.models.quant.nvfp4_experts import Nvfp4Experts

log = logging.getLogger("ninfer.bench")
GREEDY = SamplingParams(temperature=0.0, seed=0)
# The server's defaults, so a figure measured here is what ninfer-serve runs.
SERVER_DEFAULTS = EngineConfig()
WEIGHT_FORMATS = ("bf16", "fp8", "fp8-block", "nvfp4")  # fp8: per output channel; fp8-block: Qwen's 128x128 blocks


@dataclass
class BenchOptions:
    shapes: list[str] = field(default_factory=lambda: ["27b", "35b-a3b"])
    weights: list[str] = field(default_factory=lambda: ["bf16", "fp8"])
    batches: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    contexts: list[int] = field(default_factory=lambda: [4096, 131072])
    prefill_lengths: list[int] = field(default_factory=lambda: [8192, 65536])
    prefill_chunk: int = SERVER_DEFAULTS.prefill_chunk
    decode_rounds: int = 20
    peer: str = "hf"  # "hf" or "none"
    peer_new_tokens: int = 16
    peer_prompt: int = 4096
    cuda_graphs: bool = True
    decode_overlap: bool = True
    seed: int = 0
    profile_dir: str | None = None  # profile-, increments-, trace-* for the smallest decode case and the shortest prefill
    verify_drafts: list[int] = field(default_factory=list)  # speculative verify rounds of K drafts (none: no cases)
    lm_head_draft: bool = True  # verify cases draft through the reduced-vocabulary proposal head
    draft_fp8: bool = False  # verify cases: the drafter's weights in FP8 per row (--draft-fp8)
    kv_dtypes: list[str] = field(default_factory=lambda: ["bf16"])  # --kv-dtype formats: a runner each

    def __post_init__(self) -> None:
        unknown = [w for w in self.weights if w not in WEIGHT_FORMATS]
        if unknown:
            raise ValueError(f"unknown --weights {', '.join(unknown)}; choose from {', '.join(WEIGHT_FORMATS)}")


@dataclass
class CaseResult:
    shape: str
    weights: str
    kind: str  # decode / prefill / ttft / hf_decode / hf_prefill
    batch: int
    tokens: int  # context for decode, prompt for prefill
    tokens_per_s: float
    roofline_tokens_per_s: float | None
    fraction_of_roofline: float | None
    peak_memory_gib: float
    note: str = ""
    sm_clock_mhz: float | None = None  # median SM clock over the timed part (None without NVML)
    draft_tokens: int = 0  # verify cases: drafts per request a round
    round_ratio: float | None = None  # verify cases: round time / the plain decode round's at the same B and L
    kv_dtype: str = "bf16"  # the KV cache's --kv-dtype


_KV_CASES = ("decode", "prefill", "ttft", "verify")  # our cases, which run on the runner's KV format


def fill_kv_(cache, head_dim: int) -> None:
    """Random keys and values in the cache's formats: one page per layer, copied to every page
    (quantizing the whole pool at once would need it in fp32)."""
    from ninfer.kernels.kv_quant import format_of, quantize_rows

    for store in (cache.k, cache.v):
        fmt = format_of(store)
        values = torch.randn(store.shape[0], 1, *store.shape[2:-1], head_dim, device=store.device)
        page = values.to(store.dtype) if fmt is None else quantize_rows(values, fmt)
        raw = store.view(torch.uint8)
        raw.copy_(page.view(torch.uint8).expand_as(raw))


def kv_element_bytes(cache, config) -> float:
    """Bytes the cache holds per K or V element, scales included (2 for bf16)."""
    num_layers, _, _, num_kv_heads, _ = cache.k.shape
    return cache.bytes_per_token / (2 * num_layers * num_kv_heads * config.head_dim)


# Prefill timings per case: the rate moves with the SM clock, so short prompts get more repeats.
_PREFILL_REPEATS = 5
# Device memory a runner needs beside its KV pool and state slots: the longest prompt step's
# activations, the CUDA graphs, the verification scratch.
_RUNNER_RESERVE_BYTES = 6 << 30
_LONG_PREFILL = 16384
_LONG_PREFILL_REPEATS = 3


def pages_that_fit(model, wanted: int, max_batch: int, kv_dtype: str, device: torch.device, label: str) -> int:
    """A bench runner's KV pool: `wanted` pages (every case's), or as many as fit in the device's
    free memory beside the state slots and the runner's reserve; the cases that need more are
    skipped (Suite._fits), the others still run."""
    if device.type != "cuda":
        return wanted
    free, _ = torch.cuda.mem_get_info(device)
    page_bytes = kv_page_bytes(model, SERVER_DEFAULTS.page_size, kv_dtype=kv_dtype)
    states = state_image_bytes(model) * (max_batch + 1)
    affordable = max(0, (free - states - _RUNNER_RESERVE_BYTES) // page_bytes)
    if affordable >= wanted:
        return wanted
    log.warning("[%s] KV pool cut to %d of the %d pages its cases need (%.1f GiB free beside the model, "
                "%.1f GiB a case of the longest context at the largest batch would take): cases that need "
                "more are skipped", label, affordable, wanted, free / (1 << 30), wanted * page_bytes / (1 << 30))
    return affordable


def _sync_time(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


class Suite:
    def __init__(self, options: BenchOptions, device: str = "cuda"):
        self.options = options
        self.device = torch.device(device)
        self.results: list[CaseResult] = []
        self.ceilings: DeviceCeilings | None = None
        self.clocks = ClockSampler(None)
        self._plain_rounds: dict[tuple, float] = {}  # (shape, weights, kv, batch, context) -> decode round seconds
        self.skipped: list[str] = []  # cases whose KV does not fit beside the model on this device
        self._num_pages = 0  # the KV pool of the runner being measured
        self.kv_dtype = "bf16"  # the KV format of the runner being measured
        self.expert_bytes = 2.0  # bytes per routed-expert weight of the model being measured

    def run(self) -> dict[str, Any]:
        self.clocks = ClockSampler(nvml_sm_clock_reader(self.device)).start()
        try:
            return self._run_all()
        finally:
            self.clocks.stop()

    def _run_all(self) -> dict[str, Any]:
        log.info("measuring device ceilings (copy bandwidth, bf16 matmul rate)")
        self.ceilings = measure_ceilings(self.device, self.clocks)
        clock = self.ceilings.matmul_sm_clock_mhz
        log.info("%s: copy %.2f TB/s, bf16 matmul %.0f TFLOP/s%s", self.ceilings.name,
                 self.ceilings.copy_bytes_per_s / 1e12, self.ceilings.bf16_flops_per_s / 1e12,
                 f" at SM {clock:.0f} MHz" if clock else "")
        failures: list[str] = []
        for shape in self.options.shapes:
            runs = [(f"{shape} {w}", self._run_ours, (shape, w)) for w in self.options.weights]
            if self.options.peer == "hf":
                runs.append((f"{shape} hf", self._run_hf, (shape,)))
            for label, run, args in runs:
                try:
                    run(*args)
                except Exception as exc:  # noqa: BLE001 - one failing configuration must not lose the others
                    log.exception("[%s] failed", label)
                    failures.append(f"{label}: {type(exc).__name__}: {exc}")
                # The run's model and caches were locals of the run: release their memory now.
                gc.collect()
                torch.cuda.empty_cache()
        return {
            "failures": failures,
            "skipped": self.skipped,
            "device": self.ceilings.name,
            "ceilings": asdict(self.ceilings),
            "options": asdict(self.options),
            "page_size": SERVER_DEFAULTS.page_size,
            "torch": torch.__version__,
            "results": [asdict(r) for r in self.results],
        }

    # ---- ours ----------------------------------------------------------------------
    def _run_ours(self, shape: str, weights: str) -> None:
        hf_config, config = shape_config(shape)
        if self.options.verify_drafts:
            config = config.replace(mtp_num_hidden_layers=1)  # the real checkpoints' MTP head
        log.info("[%s %s] building random weights on %s", shape, weights, self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        # fp8 and nvfp4 quantize each weight as it is made, as --quantize does at load: the bf16
        # model is never whole on the device (a 27B one would not fit beside its quantized copy).
        quantize = weights if weights in QUANTIZE_AT_LOAD else None
        model = build_model(config, torch.bfloat16, self.device, quantize=quantize)
        load_weights(model, random_tensors(config, torch.bfloat16, self.device, self.options.seed),
                     progress=False, source=f"random {shape} weights", dtype=torch.bfloat16)
        model.eval()
        replaced = sum(isinstance(m, (Fp8Linear, Fp8Experts, Nvfp4Linear, Nvfp4Experts)) for m in model.modules())
        weight_bytes = 2.0
        self.expert_bytes = 2.0  # routed MoE experts: in the quantized format, bf16 otherwise
        if weights == "fp8":
            weight_bytes = self.expert_bytes = 1.0  # e4m3; per-channel scales are negligible
            log.info("[%s fp8] %d modules quantized as made (Linear layers and routed experts; routers, embedding "
                     "and lm_head stay bf16); peak %.1f GiB", shape, replaced,
                     torch.cuda.max_memory_allocated(self.device) / (1 << 30))
        elif weights == "fp8-block":
            from ninfer.models.quant.fp8 import quantize_fp8_blocks_

            replaced = quantize_fp8_blocks_(model)
            torch.cuda.empty_cache()
            # Linear layers hold row-block scales (4 bytes per row and 128 weights, read with them);
            # the experts' 128x128 block scales are negligible.
            weight_bytes, self.expert_bytes = 1.0 + 4 / 128, 1.0
            log.info("[%s fp8-block] %d modules quantized in Qwen's 128x128 blocks (routers, embedding and lm_head stay bf16)", shape, replaced)
        elif weights == "nvfp4":
            # e2m1 codes and an e4m3 scale per 16 (row scales are negligible); experts alike
            weight_bytes = self.expert_bytes = 0.5 + 1 / 16
            log.info("[%s nvfp4] %d modules quantized as made (Linear layers and routed experts; routers, embedding "
                     "and lm_head stay bf16); peak %.1f GiB", shape, replaced,
                     torch.cuda.max_memory_allocated(self.device) / (1 << 30))
        options = self.options
        max_batch = max(options.batches)
        max_tokens = max([max(options.contexts) + 1, *options.prefill_lengths])
        page_size = SERVER_DEFAULTS.page_size
        num_pages = max_batch * (-(-max(options.contexts) // page_size) + 1)
        num_pages = max(num_pages, -(-max_tokens // page_size) + 1)
        for kv_dtype in options.kv_dtypes:
            self.kv_dtype = kv_dtype
            runner = self._runner(model, num_pages, max_batch, shape, weights)
            for context in options.contexts:
                for batch in options.batches:
                    self._decode_case(shape, weights, config, runner, batch, context, weight_bytes)
            for prompt in options.prefill_lengths:
                self._prefill_case(shape, weights, config, runner, prompt, weight_bytes)
            for num_drafts in options.verify_drafts:
                # One runner at a time: each holds a KV pool for the longest context at every batch.
                del runner
                gc.collect()
                torch.cuda.empty_cache()
                runner = self._runner(model, num_pages, max_batch, shape, weights, num_drafts)
                for context in options.contexts:
                    for batch in options.batches:
                        self._verify_case(shape, weights, config, runner, batch, context, weight_bytes)
            del runner
            gc.collect()
            torch.cuda.empty_cache()

    def _runner(self, model, num_pages: int, max_batch: int, shape: str, weights: str, num_drafts: int = 0) -> ModelRunner:
        options = self.options
        started = time.perf_counter()
        num_pages = self._num_pages = pages_that_fit(model, num_pages, max_batch, self.kv_dtype, self.device, f"{shape} {weights}")
        # A verification row writes up to K+1 positions past the context (Admission.spare_tokens).
        runner = ModelRunner(model, num_pages, SERVER_DEFAULTS.page_size, num_state_slots=max_batch + 1,
                             cuda_graph_batch_sizes=options.batches if options.cuda_graphs else (),
                             max_context=max(options.contexts) + 1, num_draft_tokens=num_drafts,
                             lm_head_draft=options.lm_head_draft, draft_fp8=options.draft_fp8 and num_drafts > 0,
                             max_batch=max_batch, kv_format=self.kv_dtype)
        graphs = "on" if runner.graphs is not None else "off"
        if num_drafts:
            graphs += f", verify graphs {'on' if runner.verify_graphs is not None else 'off'}"
        log.info("[%s %s] %sKV pool %d pages (%s); CUDA graphs %s (%.1fs)", shape, weights,
                 f"{num_drafts} drafts: " if num_drafts else "", num_pages, self.kv_dtype, graphs,
                 time.perf_counter() - started)
        with torch.no_grad():
            fill_kv_(runner.kv_cache, model.cache_spec().head_dim)
            if runner.state_cache is not None:
                runner.state_cache.conv.normal_()
                runner.state_cache.recurrent.normal_(std=0.01)
        return runner

    def _fits(self, label: str, pages: int) -> bool:
        """Whether a case's pages are in the runner's pool; else it is skipped, and said so."""
        if pages <= self._num_pages:
            return True
        message = f"{label}: skipped, needs {pages} KV pages, the pool that fits this device holds {self._num_pages}"
        log.warning("%s", message)
        self.skipped.append(message)
        return False

    def _decode_case(self, shape, weights, config, runner, batch, context, weight_bytes) -> None:
        pages_per_seq = -(-(context + 1) // SERVER_DEFAULTS.page_size)
        if not self._fits(f"{shape} {weights} decode, batch {batch}, context {context}", batch * pages_per_seq):
            return
        chunks = [
            ScheduledChunk(
                request_id=f"r{b}", token_ids=[1000 + b], num_computed_tokens=context,
                page_ids=list(range(b * pages_per_seq, (b + 1) * pages_per_seq)), state_slot=b,
                compute_logits=True, sample=True, sampling=GREEDY, num_generated=0, output_token_ids=[],
            )
            for b in range(batch)
        ]
        step = SchedulerStep(StepKind.DECODE, chunks)
        # The round the engine launches ahead: each row's token is the one sampled for it in
        # the round before, read on the device (the same position is rewritten every round).
        ahead = SchedulerStep(
            StepKind.DECODE, [replace(c, token_ids=[PENDING_TOKEN], previous_row=row) for row, c in enumerate(chunks)]
        )
        torch.cuda.reset_peak_memory_stats(self.device)
        for _ in range(3):
            runner.execute(step)
        rounds = self.options.decode_rounds
        started = time.perf_counter()
        sync_per_round = statistics.median(_sync_time(lambda: runner.execute(step)) for _ in range(rounds))
        overlapped = self._overlapped_rounds(runner, step, ahead, warmup=3, rounds=rounds)
        window = (started, time.perf_counter())
        per_round = statistics.median(overlapped) if self.options.decode_overlap else sync_per_round
        if self.options.profile_dir and batch == min(self.options.batches) and context == min(self.options.contexts):
            self._profile(f"{shape}-{weights}-b{batch}-{context}", lambda: runner.execute(step), 5, "decode rounds")
        tps = batch / per_round
        mb = model_bytes(config, weight_bytes, kv_element_bytes(runner.kv_cache, config), batch, self.expert_bytes)
        roof = decode_roofline_tokens_per_s(mb, batch, context, self.ceilings)
        if self.options.decode_overlap:
            note = f"decode overlap on; host waiting for each round: {batch / sync_per_round:,.1f} tok/s"
        else:
            note = f"decode overlap off; with it: {batch / statistics.median(overlapped):,.1f} tok/s"
        self._record(shape, weights, "decode", batch, context, tps, roof, note=note, window=window)
        self._plain_rounds[(shape, weights, self.kv_dtype, batch, context)] = per_round

    def _verify_case(self, shape, weights, config, runner, batch, context, weight_bytes) -> None:
        num_drafts = runner.speculator.num_draft_tokens
        width = num_drafts + 1
        pages_per_seq = -(-(context + width + 1) // SERVER_DEFAULTS.page_size)
        if not self._fits(f"{shape} {weights} verify K={num_drafts}, batch {batch}, context {context}",
                          batch * pages_per_seq):
            return
        chunks = [
            ScheduledChunk(
                request_id=f"r{b}", token_ids=[1000 + b] + [2000 + b + j for j in range(num_drafts)],
                num_computed_tokens=context, page_ids=list(range(b * pages_per_seq, (b + 1) * pages_per_seq)),
                state_slot=b, compute_logits=True, sample=True, sampling=GREEDY, num_generated=0,
                output_token_ids=[], speculative=True, num_draft_tokens=num_drafts,
            )
            for b in range(batch)
        ]
        # Each round first commits the previous round's rows, all of them (the most work).
        step = SchedulerStep(StepKind.DECODE, chunks, before=[CommitVerified(b, b * width, width) for b in range(batch)])
        graphed = runner.verify_graphs is not None and runner.verify_graphs.can_run(chunks)
        torch.cuda.reset_peak_memory_stats(self.device)
        for _ in range(3):
            runner.execute(step)
        started = time.perf_counter()
        per_round = statistics.median(_sync_time(lambda: runner.execute(step)) for _ in range(self.options.decode_rounds))
        window = (started, time.perf_counter())
        # Each round launched before the one before it is read, as an engine that plans the next
        # round on the device would run them: what the host between rounds costs.
        ahead = statistics.median(self._overlapped_rounds(runner, step, step, warmup=3, rounds=self.options.decode_rounds))
        if self.options.profile_dir and batch == min(self.options.batches) and context == min(self.options.contexts):
            label = f"{shape}-{weights}-verify{num_drafts}-b{batch}-{context}"
            self._profile(label, lambda: runner.execute(step), 5, "verify rounds")
        plain = self._plain_rounds.get((shape, weights, self.kv_dtype, batch, context))
        ratio = per_round / plain if plain else None
        mb = model_bytes(config, weight_bytes, kv_element_bytes(runner.kv_cache, config), batch, self.expert_bytes)
        roof = decode_roofline_tokens_per_s(mb, batch, context, self.ceilings)
        note = (f"{num_drafts} drafts{', drafter FP8' if self.options.draft_fp8 else ''}, "
                f"{'graphs' if graphed else 'eager'}; round {per_round * 1e3:.2f} ms"
                + (f" = {ratio:.3f}x the plain round" if ratio else "")
                + f"; launched ahead of each read {ahead * 1e3:.2f} ms"
                + (f" = {ahead / plain:.3f}x" if plain else "")
                + f"; all accepted {batch * width / per_round:,.1f} tok/s, none {batch / per_round:,.1f} tok/s"
                + "; roofline: plain decode's")
        self._record(shape, weights, "verify", batch, context, batch * width / per_round, roof, note=note,
                     window=window, draft_tokens=num_drafts, round_ratio=ratio)

    @staticmethod
    def _overlapped_rounds(runner, step, ahead, warmup: int, rounds: int) -> list[float]:
        """Seconds between successive reads of sampled ids, each round launched before the
        previous one is read (as EngineCore runs steady decode)."""
        torch.cuda.synchronize()
        pending = runner.launch(step)
        intervals = []
        last = time.perf_counter()
        for _ in range(warmup + rounds):
            following = runner.launch(ahead)
            pending.result()
            now = time.perf_counter()
            intervals.append(now - last)
            last, pending = now, following
        pending.result()
        return intervals[warmup:]

    def _prefill_case(self, shape, weights, config, runner, prompt, weight_bytes) -> None:
        generator = torch.Generator().manual_seed(prompt)
        tokens = torch.randint(0, min(200_000, config.vocab_size), (prompt,), generator=generator).tolist()
        chunk = self.options.prefill_chunk
        pages = list(range(-(-prompt // SERVER_DEFAULTS.page_size) + 1))
        if not self._fits(f"{shape} {weights} prefill {prompt}", len(pages)):
            return

        def prefill() -> None:
            for start in range(0, prompt, chunk):
                piece = tokens[start : start + chunk]
                last = start + len(piece) == prompt
                step = SchedulerStep(StepKind.PREFILL, [
                    ScheduledChunk("p", piece, start, pages, 0, compute_logits=last, sample=last,
                                   sampling=GREEDY, num_generated=0, output_token_ids=[])
                ])
                runner.execute(step)

        prefill()  # warm-up (compilation, autotuning)
        torch.cuda.reset_peak_memory_stats(self.device)
        repeats = _PREFILL_REPEATS if prompt <= _LONG_PREFILL else _LONG_PREFILL_REPEATS
        started = time.perf_counter()
        elapsed = statistics.median(_sync_time(prefill) for _ in range(repeats))
        window = (started, time.perf_counter())
        mb = model_bytes(config, weight_bytes, kv_element_bytes(runner.kv_cache, config), 1, self.expert_bytes)
        roof = prefill_roofline_tokens_per_s(mb, config, prompt, self.ceilings)
        self._record(shape, weights, "prefill", 1, prompt, prompt / elapsed, roof, window=window,
                     note=f"chunk {chunk}, median of {repeats}; roofline = measured bf16 matmul rate / FLOPs per token")
        if prompt == min(self.options.prefill_lengths):
            self._record(shape, weights, "ttft", 1, prompt, elapsed, None, window=window,
                         note="seconds to first token, runner only")
            if self.options.profile_dir:
                self._profile(f"{shape}-{weights}-prefill-{prompt}", prefill, 1, "prefill")

    def _profile(self, label: str, run, repeats: int, what: str) -> None:
        """Per-kernel GPU time over `repeats` runs (graph replays included), sorted by total time."""
        from pathlib import Path

        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(repeats):
                run()
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=60, max_name_column_width=90)
        out = Path(self.options.profile_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"profile-{label}.txt").write_text(f"{label}: {repeats} {what}\n{table}\n")
        # The timeline too (chrome://tracing, Perfetto): where the GPU waits for the host.
        trace = out / f"trace-{label}.json"
        prof.export_chrome_trace(str(trace))
        # Durations under PDL include waiting for the previous kernel: also tabulate what
        # each kernel adds to the chain (critical_path.py).
        kernels = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("cat") == "kernel"]
        (out / f"increments-{label}.txt").write_text(f"{label}: {repeats} {what}\n" + increments_table(kernels, repeats))
        with open(trace, "rb") as raw, gzip.open(f"{trace}.gz", "wb") as packed:
            shutil.copyfileobj(raw, packed)
        trace.unlink()
        log.info("[%s] kernel profile and timeline written to %s", label, out)

    # ---- peer ----------------------------------------------------------------------
    def _run_hf(self, shape: str) -> None:
        import transformers

        hf_config, _ = shape_config(shape)
        cls_name = "Qwen3_5MoeForCausalLM" if "moe" in hf_config["model_type"] else "Qwen3_5ForCausalLM"
        cfg_cls = transformers.Qwen3_5MoeTextConfig if "moe" in hf_config["model_type"] else transformers.Qwen3_5TextConfig
        fields = {k: v for k, v in hf_config.items() if k not in ("model_type", "dtype", "full_attention_interval")}
        config = cfg_cls(**fields)
        log.info("[%s hf] building transformers %s with the same random weights", shape, cls_name)
        torch.cuda.reset_peak_memory_stats(self.device)
        with torch.device(self.device):
            model = getattr(transformers, cls_name)._from_config(config, dtype=torch.bfloat16)
        fill_random_(model.named_parameters(), self.options.seed)
        model.eval()
        prompt_len = self.options.peer_prompt
        ids = torch.randint(0, min(200_000, config.vocab_size), (1, prompt_len), device=self.device)
        new = self.options.peer_new_tokens

        def generate(n: int) -> None:
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
                           eos_token_id=None)

        with torch.no_grad():
            generate(2)  # warm-up
            started = time.perf_counter()
            first = _sync_time(lambda: generate(1))
            full = _sync_time(lambda: generate(new + 1))
            window = (started, time.perf_counter())
        decode_tps = new / max(full - first, 1e-9)
        _, ours_config = shape_config(shape)
        mb = model_bytes(ours_config, 2.0, 2, 1)
        roof = decode_roofline_tokens_per_s(mb, 1, prompt_len, self.ceilings)
        note = f"transformers {transformers.__version__} generate, greedy, bf16"
        self._record(shape, "bf16", "hf_decode", 1, prompt_len, decode_tps, roof, note=note, window=window)
        self._record(shape, "bf16", "hf_prefill", 1, prompt_len, prompt_len / first, None, window=window,
                     note=note + "; prompt + 1 token")

    def _record(self, shape, weights, kind, batch, tokens, value, roof, note="", window=None, draft_tokens: int = 0,
                round_ratio: float | None = None) -> None:
        peak = torch.cuda.max_memory_allocated(self.device) / (1 << 30)
        fraction = value / roof if roof else None
        clock = self.clocks.median_mhz(*window) if window is not None else None
        result = CaseResult(shape, weights, kind, batch, tokens, value, roof, fraction, peak, note, clock,
                            draft_tokens, round_ratio, self.kv_dtype if kind in _KV_CASES else "bf16")
        self.results.append(result)
        pct = f" ({100 * fraction:.0f}% of {roof:,.1f})" if fraction is not None else ""
        unit = "s" if kind == "ttft" else "tok/s"
        sm = f" · SM {clock:.0f} MHz" if clock else ""
        drafts = f" k={draft_tokens}" if draft_tokens else ""
        ratio = f" · round {round_ratio:.3f}x plain" if round_ratio else ""
        kv = f" kv {result.kv_dtype}" if result.kv_dtype != "bf16" else ""
        log.info(f"[{shape} {weights}{kv}] {kind}{drafts} batch {batch} @ {tokens}: {value:,.2f} {unit}{pct}{ratio}"
                 f" · peak {peak:.1f} GiB{sm}")

