"""EngineCore: one loop iteration = schedule -> run -> commit; its throughput intervals: throughput_log.py.

Single-threaded by design: requests and aborts are applied between steps, so the
scheduler and pools never see concurrent mutation. Transports (client.py) drive it.

In steady decode (config.decode_overlap; by default on CUDA) each step() launches the
next decode round before it reads the current one's tokens (Scheduler.schedule_ahead),
so the GPU computes round N+1 while the host commits round N, checks stops and streams;
one round stays in flight between step() calls. A round whose rows' output-constraint masks
follow round N's tokens is computed ahead and sampled once round N is committed
(DeferredSampling), so structured outputs keep the overlap too.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ninfer.config import EngineConfig
from ninfer.contract.output import EngineError, EngineOutput, ErrorCode, FinishReason
from ninfer.contract.request import EngineRequest
from ninfer.engine.cache.context_cache import CacheLimits, ContextCache
from ninfer.engine.cache.context_costs import resolve_context_costs
from ninfer.engine.compiled_grammars import CompiledGrammars
from ninfer.engine.host_detail import HostDetail
from ninfer.engine.kv_pool import KVPool
from ninfer.engine.deferred_sampling import DeferredSampling
from ninfer.engine.engine_description import describe_engine
from ninfer.engine.pending_step import PendingStep
from ninfer.engine.runner import ModelRunner
from ninfer.engine.scheduler import Scheduler, SchedulerLimits, SchedulerStep, StepKind
from ninfer.engine.speculative.round_costs import RoundCosts
from ninfer.engine.state_pool import StatePool
from ninfer.engine.stop_checker import StopChecker
from ninfer.engine.throughput_log import ThroughputLog
from ninfer.frontend.grammar_vocabulary import GrammarVocabulary
from ninfer.frontend.tokenizer import Tokenizer
from ninfer.models.causal_lm import CausalLM
from ninfer.models.dflash import DflashDraftModel
from ninfer.models.kv_cache import kv_bytes_per_token
from ninfer.models.quant.weight_format import weight_format

if TYPE_CHECKING:
    from ninfer.parallel.followers import Followers

log = logging.getLogger("ninfer.engine")

def _work_class(step: SchedulerStep) -> str:
    """host_work's class of a step: decode rounds, steps that compute prompt tokens, and the
    rest (slot moves only)."""
    if not step.chunks:
        return "control"
    return "decode" if step.kind is StepKind.DECODE else "prefill"


# Steps failing one after another mean the engine itself is broken, not one request's step.
MAX_CONSECUTIVE_STEP_FAILURES = 3
# The longest an otherwise idle step waits for a grammar to compile before the loop looks at
# its inbox again.
GRAMMAR_WAIT_SECONDS = 0.01
# With tensor-parallel followers: how often an idle engine looks for a dead one, and how long a
# failed step waits for a follower's exit to show (its closed sockets may fail the step first).
RANK_CHECK_INTERVAL_S = 0.5
RANK_EXIT_WAIT_S = 1.0


def kv_page_bytes(
    model: CausalLM, page_size: int, draft_model: DflashDraftModel | None = None, kv_dtype: str = "bf16"
) -> int:
    """One KV page of every attention layer, keys and values, in --kv-dtype's formats (plain: the
    model's dtype); with a DFlash drafter, its context KV (plain) under the same page id too."""
    spec = model.cache_spec()
    element = next(model.parameters()).element_size()
    per_token = kv_bytes_per_token(spec.num_attention_layers, spec.num_kv_heads, spec.head_dim, element, kv_dtype)
    if draft_model is not None:
        draft = draft_model.config
        per_token += kv_bytes_per_token(draft.num_hidden_layers, draft.num_key_value_heads, draft.head_dim, element)
    return per_token * page_size


def _round_costs(runner: ModelRunner, num_draft_tokens: int) -> RoundCosts:
    """The adaptive draft policy's round costs: the table, at the level this engine's verify
    graphs timed at start-up where they did."""
    verify = getattr(runner, "verify_graphs", None)
    measured = verify.round_cost_ratio if verify is not None else None
    if measured is None or not num_draft_tokens:
        return RoundCosts()
    return RoundCosts.calibrated(num_draft_tokens, measured)


def state_image_bytes(model: CausalLM) -> int:
    """One checkpoint StateImage: every linear-attention layer's conv and fp32 recurrent state,
    plus the fp32 logits stored with it (and the last hidden state when an MTP head drafts)."""
    spec = model.cache_spec()
    element = next(model.parameters()).element_size()
    per_layer = spec.conv_dim * (spec.conv_kernel - 1) * element + spec.num_v_heads * spec.k_head_dim * spec.v_head_dim * 4
    hidden = model.config.hidden_size * element if model.config.mtp_num_hidden_layers else 0
    return spec.num_linear_layers * per_layer + model.config.vocab_size * 4 + hidden

class EngineCore:
    def __init__(
        self,
        model: CausalLM,
        tokenizer: Tokenizer,
        config: EngineConfig,
        clock: Callable[[], float] = time.monotonic,
        drafter=None,
        draft_model: DflashDraftModel | None = None,
        vision_tower: torch.nn.Module | None = None,
        followers: Followers | None = None,
        step_graphs_while_idle: bool = False,
        grammars: CompiledGrammars | None = None,
    ):
        """drafter: a stand-in for the speculative backend's drafter (tests); draft_model: the
        DFlash / DFlash2 drafter of --spec dflash|dflash2; vision_tower: with --vision.
        followers: the other tensor-parallel ranks (this is rank 0 and `model` its shard): they
        repeat every runner call on theirs. step_graphs_while_idle: capture the step graphs in
        the loop's idle turns (background_step) instead of now (not with followers). grammars:
        the process's compiled grammars, shared with the KV-sizing probe's engine (its vocabulary
        index and warm-up grammar then compile once a start; default: this engine's own)."""
        self.config = config
        self.followers = followers
        self.tokenizer = tokenizer
        self.clock = clock
        self.kv_pool = KVPool(config.num_kv_pages, config.page_size)
        self.state_pool = StatePool(config.num_state_slots)
        page_bytes = kv_page_bytes(model, config.page_size, draft_model, config.kv_dtype)
        # Every checkpoint holds a StateImage slot, so checkpoints can never hold more pages than
        # this; a larger host tier would only be empty bookkeeping.
        max_checkpoint_pages = (config.num_state_slots + config.num_host_state_slots) * (
            -(-config.max_context // config.page_size)
        )
        # --host-kv-mib bounds what the whole server pins: with tensor-parallel followers every rank
        # pins its part of each host page.
        num_ranks = config.tensor_parallel if followers is not None else 1
        num_host_kv_pages = min(config.host_kv_bytes // (page_bytes * num_ranks), max_checkpoint_pages)
        self.cache = ContextCache(
            self.kv_pool,
            self.state_pool,
            exact_frontier_only=model.config.is_hybrid,
            enabled=config.prefix_reuse,
            host_pool=StatePool(config.num_host_state_slots),
            host_kv_pool=KVPool(num_host_kv_pages, config.page_size) if num_host_kv_pages else None,
            limits=CacheLimits(
                max_private_continuations=config.num_private_continuations,
                max_shared_prefixes=config.num_shared_prefixes,
                max_long_anchors=config.num_long_anchors,
            ),
        )
        device_type = next(model.parameters()).device.type
        detail = HostDetail()  # each throughput interval's slow paths, timed where they run
        self.context_costs = resolve_context_costs(model.config, device_type, config.context_cost_presets)
        if grammars is None:
            grammars = CompiledGrammars(GrammarVocabulary(tokenizer, model.config.vocab_size))
        self.grammars = grammars
        # Plain values only: a follower rank builds its runner from the same arguments.
        runner_arguments = dict(
            num_pages=config.num_kv_pages,
            page_size=config.page_size,
            num_state_slots=config.num_state_slots,
            num_valid_tokens=tokenizer.vocab_size,
            cuda_graph_batch_sizes=range(1, config.max_concurrency + 1) if config.cuda_graphs else (),
            max_context=config.max_context,
            num_host_state_slots=config.num_host_state_slots,
            num_host_kv_pages=num_host_kv_pages,
            num_draft_tokens=config.num_draft_tokens,
            lm_head_draft=config.lm_head_draft,
            draft_fp8=config.draft_fp8,
            draft_extra_token_ids=sorted(tokenizer.backend.get_added_tokens_decoder()),
            max_batch=config.max_concurrency,
            spec_backend=config.spec or "mtp",
            kv_format=config.kv_dtype,
            step_graph_tokens=config.step_graph_tokens if device_type == "cuda" else 0,
        )
        if followers is None:
            self.runner = ModelRunner(
                model, **runner_arguments, drafter=drafter, draft_model=draft_model, vision_tower=vision_tower,
                step_graphs_while_idle=step_graphs_while_idle,
            )
        else:
            from ninfer.parallel.leader_runner import LeaderRunner

            self.runner = LeaderRunner(
                followers, model, **runner_arguments, draft_model=draft_model, vision_tower=vision_tower
            )
        self.scheduler = Scheduler(
            SchedulerLimits(
                config.max_concurrency,
                config.max_context,
                config.prefill_chunk,
                config.prefix_reuse,
                mixed_prefill_chunk=config.mixed_prefill_chunk,
                spec_backend=config.spec,
                num_draft_tokens=config.num_draft_tokens,
                adaptive_drafts=config.adaptive_drafts,
                round_costs=_round_costs(self.runner, config.num_draft_tokens),
            ),
            self.kv_pool,
            self.state_pool,
            self.cache,
            make_stop_checker=lambda r: StopChecker(tokenizer, r.stop_token_ids, r.stop_strings),
            clock=clock,
            costs=self.context_costs,
            state_image_bytes=state_image_bytes(model),
            kv_page_bytes=page_bytes,
            detail=detail,
            grammars=self.grammars,
            vocab_size=model.config.vocab_size,
        )
        # Every rank's memory ledger, by rank, with tensor-parallel followers (the builder gathers them).
        self.rank_memory: list[dict[str, int]] | None = None
        self.runner.host_detail = detail
        self.failed: str | None = None
        overlap = config.decode_overlap
        self.decode_overlap = self.runner.device.type == "cuda" if overlap is None else overlap
        self._inflight: PendingStep | None = None  # launched, not yet committed (sampled by step()'s end)
        self._consecutive_failures = 0
        self._after_background_step: Callable[[bool], None] | None = None
        self.throughput = ThroughputLog(config.log_stats_interval_ms, clock, detail, self.scheduler, self.cache,
                                        self.kv_pool, self.state_pool)  # fmt: skip
        # Device memory by use in bytes (KV pool, state slots, and with --kv-capacity auto the
        # measured worst step, graphs and headroom); the builder fills it.
        self.memory_ledger: dict[str, int] = {}
        # The device memory steps use beyond the resident pools and weights, once measured (the
        # builder's warm-up on CUDA); None where steps allocate from the host heap as they run (CPU).
        self.workspace_bytes: int | None = None
        self.weight_format = weight_format(model)
        self._gauges_due = False  # a step ran since the last idle gauges

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self._inflight is not None

    @property
    def has_background_work(self) -> bool:
        """Work for idle turns: step graphs left to capture."""
        return self.failed is None and self.runner.has_graphs_to_capture

    def background_step(self) -> None:
        """One piece of idle-turn work (one step graph); only when no step is in flight."""
        if self._inflight is not None or self.scheduler.has_work:
            raise RuntimeError("background_step while steps run")
        started = time.perf_counter()
        self.runner.capture_next_graph()
        if self._after_background_step is not None:
            done = not self.has_background_work
            callback = self._after_background_step
            if done:
                self._after_background_step = None
            callback(done)
        self.throughput.work.add("control", "engine_maintenance", time.perf_counter() - started)

    def after_background_steps(self, callback: Callable[[bool], None]) -> None:
        """Call `callback(done)` after each piece of idle-turn work, done once none is left (the
        start's kernel record takes in each capture's kernels, and ends with the last)."""
        self._after_background_step = callback

    def add_request(self, request: EngineRequest) -> list[EngineOutput]:
        if self.failed is not None:
            return [self._failure_output(request.request_id, request)]
        started = time.perf_counter()
        error = self.scheduler.add(request)
        self.throughput.work.add("control", "engine_boundary", time.perf_counter() - started)
        return [error] if error is not None else []

    def abort(self, request_id: str) -> list[EngineOutput]:
        started = time.perf_counter()
        out = self.scheduler.abort(request_id)
        self.throughput.work.add("control", "engine_boundary", time.perf_counter() - started)
        return [out] if out is not None else []

    def step(self) -> list[EngineOutput]:
        """Run one step. A failing step ends only its own requests (STEP_FAILED) and the engine
        goes on; when the device cannot go on, every request ends and `failed` is set.

        A throughput record that falls due is built while the launched step computes, so its
        scheduler snapshot shows the requests that step admits as materializing."""
        if self.failed is not None:
            return []
        self._gauges_due = True
        started = counted_from = time.perf_counter()
        launched: list[SchedulerStep] = []  # the steps whose requests a failure takes down
        try:
            current = self._inflight
            if current is None:
                step = self.scheduler.schedule()
                if step is None:
                    self._wait_for_grammars()
                    outputs = self.scheduler.take_pending_outputs()
                    self.throughput.work.add("control", "engine_maintenance", time.perf_counter() - started)
                    self.throughput.active_seconds += time.perf_counter() - counted_from
                    counted_from = time.perf_counter()
                    self.log_stats_if_due()
                    return outputs
                launched.append(step)
                current = self.runner.launch(step)
            else:
                launched.append(current.step)
            self._inflight = None
            if self.decode_overlap:
                ahead = self.scheduler.schedule_ahead(current.step)
                if ahead is not None:
                    launched.append(ahead)
                    self._inflight = self.runner.launch(ahead)
            work_class = _work_class(current.step)
            submitted = time.perf_counter()
            self.throughput.work.add(work_class, "program_submit", submitted - started)
            # The interval closing here holds this step's submit; the rest belongs to the next one.
            self.throughput.active_seconds += submitted - counted_from
            counted_from = submitted
            self.log_stats_if_due(work_class)
            waited_from = time.perf_counter()
            sampled = current.result()
            verified = current.verified()
            logprobs = current.logprobs()
            read = time.perf_counter()
            timing = self.scheduler.timing
            timing.charge(current.step, "program_submit", submitted - started, device_wait=read - waited_from)
            timing.charge(current.step, "engine_maintenance", waited_from - submitted)
            if self.runner.vision_seconds:
                timing.charge_vision(self.runner.vision_seconds)
                self.runner.vision_seconds = {}
            outputs = self.scheduler.update(current.step, sampled, verified, logprobs)
            if isinstance(self._inflight, DeferredSampling):
                # Its rows' masks follow the tokens just committed: sample it behind its forward.
                masks = self.scheduler.masks_after_commit(self._inflight.step)
                self._inflight = self.runner.sample_deferred(self._inflight, masks)
            committed = time.perf_counter()
            timing.charge(current.step, "engine_commit_output", committed - read)
            self.throughput.work.add(work_class, "device_wait", read - waited_from)
            self.throughput.work.add(work_class, "engine_commit_output", committed - read)
        except Exception as exc:  # noqa: BLE001 - one bad step must not take the server down
            log.exception("engine step failed")
            return self._contain(launched, exc)
        finally:
            self.throughput.active_seconds += time.perf_counter() - counted_from
        self._consecutive_failures = 0
        return outputs

    def _wait_for_grammars(self) -> None:
        """Nothing can run but grammars compile: wait a little for one instead of spinning (the
        loop takes new messages between steps, so the wait stays short)."""
        futures = [future for _, future in self.scheduler.admission.compiling]
        if futures:
            concurrent.futures.wait(
                futures, timeout=GRAMMAR_WAIT_SECONDS, return_when=concurrent.futures.FIRST_COMPLETED
            )

    def _contain(self, launched: list[SchedulerStep], exc: Exception) -> list[EngineOutput]:
        """End the failed steps' requests and go on, unless the device is unusable or steps keep
        failing: then fail engine-wide (the API process restarts the engine)."""
        message = f"{type(exc).__name__}: {exc}"
        self._inflight = None
        self.runner.abandon_launched()
        if self.followers is not None:
            # The ranks stopped at different collectives of the step: no later step can pair them up.
            lost = self.followers.lost_rank(wait_s=RANK_EXIT_WAIT_S)
            return self._fail(lost or f"a tensor-parallel step failed ({message})")
        self._consecutive_failures += 1
        if not self._device_usable():
            return self._fail(f"the device is unusable after a failed step ({message})")
        if self._consecutive_failures >= MAX_CONSECUTIVE_STEP_FAILURES:
            return self._fail(f"{self._consecutive_failures} steps failed in a row; the last: {message}")
        if isinstance(exc, torch.OutOfMemoryError):
            torch.cuda.empty_cache()  # the failed step's activations: return them to the pool's free list
        names = ", ".join(sorted({c.request_id for step in launched for c in step.chunks})) or "none"
        log.error("step failed (%s); ending its requests (%s), the engine goes on", message, names)
        return self.scheduler.fail_steps(
            launched, f"the engine failed while computing this request ({message}); the server goes on: retry"
        )

    def check_ranks(self) -> list[EngineOutput]:
        """With tensor-parallel followers: fail engine-wide once one has died (its peers cannot
        compute without its shard); -> the outputs ending every request. Nothing otherwise."""
        if self.followers is None or self.failed is not None:
            return []
        lost = self.followers.lost_rank()
        return self._fail(lost) if lost is not None else []

    @property
    def seconds_to_rank_check(self) -> float | None:
        """How long an idle loop may wait before it checks the followers again (None: no followers)."""
        return None if self.followers is None else RANK_CHECK_INTERVAL_S

    def close(self) -> None:
        """Stop the tensor-parallel followers, if any (the loop's end)."""
        if self.followers is not None:
            self.followers.stop()

    def _device_usable(self) -> bool:
        """A CUDA error poisons the context: the next synchronize raises it again."""
        if self.runner.device.type != "cuda":
            return True
        try:
            torch.cuda.synchronize(self.runner.device)
        except Exception:  # noqa: BLE001 - any error here means the context is gone
            log.exception("the device does not synchronize after the failed step")
            return False
        return True

    def _fail(self, message: str) -> list[EngineOutput]:
        self.failed = message
        self._inflight = None
        self.scheduler.drop_inflight()
        outputs = []
        compiling = [seq for seq, _ in self.scheduler.admission.compiling]
        for seq in [*self.scheduler.running, *self.scheduler.waiting, *compiling]:
            outputs.append(self._failure_output(seq.request_id, seq.request))
        self.scheduler.running.clear()
        self.scheduler.waiting.clear()
        self.scheduler.admission.compiling.clear()
        return outputs

    def _failure_output(self, request_id: str, request: EngineRequest) -> EngineOutput:
        return EngineOutput(
            request_id=request_id,
            finish_reason=FinishReason.ERROR,
            prompt_tokens=len(request.prompt_token_ids),
            error=EngineError(ErrorCode.ENGINE_FAILURE, "the engine failed and is being restarted; retry the request"),
        )

    def reset_stats(self) -> None:
        """Start the throughput record afresh (the warm-up's synthetic work is not the server's)."""
        self.throughput.reset()

    def seconds_to_stats_boundary(self) -> float | None:
        return self.throughput.seconds_to_boundary()

    def log_stats_if_due(self, work_class: str = "control") -> None:
        self.throughput.close_if_due(work_class)

    def take_stats_records(self) -> list[dict]:
        """Throughput records since the last call (the loop publishes them to the API process)."""
        return self.throughput.take_records()

    def take_idle_gauges(self) -> dict[str, int] | None:
        """Pool occupancy once the engine has turned idle after work; None otherwise."""
        if self.has_work or not self._gauges_due:
            return None
        self._gauges_due = False
        return self.throughput.resource_gauges()

    def describe(self) -> dict:
        """The engine's resolved capacities and device, for the server_start record."""
        return describe_engine(self)

    def pool_accounting(self) -> dict[str, int]:
        """Resource usage for tests and /health diagnostics."""
        return {
            "kv_pages_used": self.kv_pool.num_used,
            "state_slots_free": self.state_pool.num_free,
            "host_state_slots_free": self.cache.host_pool.num_free,
            "host_kv_pages_free": self.cache.host_kv_pool.num_free if self.cache.host_kv_pool else 0,
            "checkpoints": len(self.cache),
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting) + len(self.scheduler.admission.compiling),
        }
