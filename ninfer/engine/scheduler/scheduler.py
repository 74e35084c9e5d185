"""Scheduler: step planning and commit — pure CPU logic, no tensors.

Contract with the runner (step.py): schedule() returns a SchedulerStep; update() takes the
sampled token ids back and returns the EngineOutputs to stream. The Scheduler composes small
nouns: Admission (admission.py) decides which waiting requests run and from which checkpoint;
Checkpoints what an active request leaves behind; ActiveRequests holds the admitted requests
and finishes them; chunks.py builds a step's rows; Speculation plans and commits verification
rows; StepCommit and TokenCommit apply a landed step; StepFailures ends what failed steps
touched; RequestTiming charges steps' time to their requests. The slot and page actions they
queue for the next step go through one ActionQueue, and their outputs through one Outbox.

Policy: every step carries one row for each decode-ready request (decode is never starved)
and prompt chunks of prefilling requests in admission order (FIFO) under a token budget:
limits.prefill_chunk tokens when nothing decodes; beside decode rows, the step's tokens, theirs
included, up to limits.mixed_prefill_chunk (limits.mixed_prompt_budget), so a burst's prompts
proceed while the running requests keep streaming at a bounded slowdown. One forward computes
it all (a varlen batch).

Steady decode runs one round ahead: schedule_ahead(N) plans round N+1 before round N's
tokens are known (each row computes, on the device, the token N sampled for it), so the
engine launches it before reading N. A request that N finishes (end token, stop string,
cancel) has then computed one token more: its pages and slot are released, or kept as its
endpoint checkpoint with that token included, when N+1 lands (update of N+1).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from ninfer.contract.output import EngineOutput, FinishReason, TokenLogprobs
from ninfer.contract.request import EngineRequest
from ninfer.engine.cache.context_cache import ContextCache
from ninfer.engine.cache.context_costs import ContextCosts, generic_costs
from ninfer.engine.cache.planner import CachePlanner
from ninfer.engine.compiled_grammars import CompiledGrammars
from ninfer.engine.host_detail import HostDetail
from ninfer.engine.kv_pool import KVPool
from ninfer.engine.scheduler.action_queue import ActionQueue
from ninfer.engine.scheduler.active_requests import ActiveRequests
from ninfer.engine.scheduler.admission import Admission
from ninfer.engine.scheduler.checkpoints import Checkpoints
from ninfer.engine.scheduler.chunks import PromptChunks, chained_chunk
from ninfer.engine.scheduler.limits import SchedulerLimits
from ninfer.engine.scheduler.outputs import Outbox, delta_output, final_output
from ninfer.engine.scheduler.placement import Placement
from ninfer.engine.scheduler.request_timing import RequestTiming
from ninfer.engine.scheduler.speculation import Speculation
from ninfer.engine.scheduler.stats import SchedulerStats
from ninfer.engine.scheduler.step import (
    ScheduledChunk,
    SchedulerStep,
    StepKind,
    VerifyOutcome,
)
from ninfer.engine.scheduler.step_commit import StepCommit
from ninfer.engine.scheduler.step_failures import StepFailures
from ninfer.engine.scheduler.token_commit import TokenCommit
from ninfer.engine.sequence import Sequence
from ninfer.engine.state_pool import StatePool
from ninfer.engine.stop_checker import StopChecker


def _runs_ahead(seq: Sequence, chunk: ScheduledChunk) -> bool:
    """Whether seq's row of the launched step can be followed by a chained row: one sampled
    token and nothing else pending, and no thinking budget that needs the sampled token to plan
    the next row (an output constraint's mask needs it only to sample: the row is computed ahead
    and sampled once the token is committed; penalties count it on the device, as the row's
    input)."""
    return (
        seq.num_steps_in_flight == 1
        and chunk.sample
        and len(chunk.token_ids) == 1
        and seq.num_computed_tokens == chunk.num_computed_tokens
        and seq.num_pending_tokens == 1
        and not _budget_may_close(seq)
    )


def _budget_may_close(seq: Sequence) -> bool:
    """The next model token may reach the thinking budget (forced close tokens follow it)."""
    budget = seq.request.thinking_budget
    return budget is not None and seq.thinking_open and seq.num_thinking_tokens + 1 >= budget.max_thinking_tokens


class Scheduler:
    def __init__(
        self,
        limits: SchedulerLimits,
        kv_pool: KVPool,
        state_pool: StatePool,
        cache: ContextCache,
        make_stop_checker: Callable[[EngineRequest], StopChecker],
        clock: Callable[[], float] = time.monotonic,
        costs: ContextCosts | None = None,
        state_image_bytes: int = 0,
        kv_page_bytes: int = 0,
        detail: HostDetail | None = None,
        grammars: CompiledGrammars | None = None,
        vocab_size: int = 0,
    ):
        """costs, state_image_bytes, kv_page_bytes: what the cache planner weighs (generic CPU
        rates when absent); detail: where admission and context transactions are timed. grammars,
        vocab_size: output constraints' compiler and the logits width their masks cover (none:
        constrained requests are refused)."""
        self.limits = limits
        self.detail = detail if detail is not None else HostDetail()
        self.kv_pool = kv_pool
        self.state_pool = state_pool
        self.cache = cache
        self.clock = clock
        self.actions = ActionQueue()  # slot and page actions for the next step
        self.planner = CachePlanner(cache, costs or generic_costs(), state_image_bytes, kv_page_bytes)
        placement = Placement(cache, self.planner, self.actions)
        self.placement = placement
        self.admission = Admission(
            limits, kv_pool, state_pool, cache, placement, make_stop_checker, clock, self.actions,
            self.detail, grammars, vocab_size,
        )
        self.checkpoints = Checkpoints(
            limits.prefix_reuse, kv_pool, state_pool, cache, placement, self.actions, self.detail
        )
        self.prompt_chunks = PromptChunks(limits, self.checkpoints)
        self.stats = SchedulerStats()
        self.outbox = Outbox()
        self.active = ActiveRequests(self.checkpoints, self.outbox)
        self.timing = RequestTiming(self.active)  # what the engine charges each step's requests
        self.tokens = TokenCommit(self.active)
        self.speculation = Speculation(limits, self.stats, self.actions, self.tokens)
        self.commit = StepCommit(self.active, self.checkpoints, self.stats, self.tokens, self.speculation, clock)
        self.failures = StepFailures(
            self.active, self.checkpoints, self.actions, kv_pool, state_pool, cache, self.outbox
        )

    # ---- requests in ---------------------------------------------------------------
    @property
    def running(self) -> list[Sequence]:
        """Admitted requests that take part in steps, in admission order."""
        return self.active.running

    @property
    def waiting(self):
        return self.admission.waiting

    def add(self, request: EngineRequest) -> EngineOutput | None:
        """Validate and queue a request; returns a terminal error output if it can never run."""
        return self.admission.add(request)

    def abort(self, request_id: str) -> EngineOutput | None:
        seq = self.admission.remove(request_id)
        if seq is not None:
            return final_output(seq, FinishReason.CANCELLED)
        for seq in self.running:
            if seq.request_id == request_id:
                self.active.finish(seq, FinishReason.CANCELLED)
                return self.outbox.take_final(request_id)
        return None

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.admission.compiling)

    @property
    def num_materializing(self) -> int:
        """Admitted requests whose plan's context moves (restores, copies, spills) have not landed."""
        return sum(seq.materializing for seq in self.running)

    @property
    def num_capture_pending(self) -> int:
        """Running requests with a checkpoint still to capture: a prompt frontier ahead of what
        they computed (the prompt end among them), or a snapshot whose step has not landed."""
        return sum(bool(seq.capture_frontiers) or seq.snapshot is not None for seq in self.running)

    @property
    def draining(self) -> list[Sequence]:
        """Finished requests whose pages and slot a launched step still writes."""
        return list(self.active.draining.values())

    def drop_inflight(self) -> None:
        """The engine failed with a step in flight: forget requests waiting for it to land."""
        self.active.draining.clear()

    def fail_steps(self, steps: list[SchedulerStep], message: str) -> list[EngineOutput]:
        """Launched steps failed on the device: end their requests, and every request their slot
        and page actions prepared, with STEP_FAILED (StepFailures); the others go on."""
        self.failures.fail(steps, message)
        return self.outbox.collect(self.running)

    @property
    def num_active(self) -> int:
        return len(self.running)

    # ---- planning ------------------------------------------------------------------
    def schedule(self) -> SchedulerStep | None:
        """The next step: admit what fits, then every decode-ready request's row and prompt
        chunks under the token budget; a step of slot actions only when nothing computes."""
        self._admit()
        decode_ready = [s for s in self.running if not s.is_prefilling]
        chunks = self.speculation.decode_rows(decode_ready)
        if decode_ready:
            budget = self.limits.mixed_prompt_budget(sum(len(c.token_ids) for c in chunks))
        else:
            budget = self.limits.prefill_chunk
        chunks += self._prompt_chunks(budget, beside_decode=bool(decode_ready))
        if chunks:
            kind = StepKind.DECODE if len(chunks) == len(decode_ready) else (
                StepKind.MIXED if decode_ready else StepKind.PREFILL
            )
            return self._step(kind, chunks)
        if self.actions:
            return SchedulerStep(StepKind.DECODE, [], before=self.actions.drain())
        return None

    def _admit(self) -> None:
        """Queue the requests whose grammars compiled, expire the overdue, and admit from the
        head of the queue while lanes are free (their first progress goes out)."""
        self.outbox.extend(self.admission.take_compiled())
        self.outbox.extend(self.admission.expire())
        if not self.waiting or len(self.running) >= self.limits.max_concurrency:
            return
        with self.detail.timed("admission"):
            admitted = self.admission.admit(len(self.running))
        for seq in admitted:
            self.running.append(seq)
            self.outbox.add(delta_output(seq))

    def _prompt_chunks(self, budget: int, beside_decode: bool) -> list[ScheduledChunk]:
        """Prompt chunks of the prefilling requests, in admission order, within `budget` tokens
        (beside_decode: the step carries decode rows, PromptChunks.chunk)."""
        chunks = []
        for seq in self.running:
            if budget <= 0:
                break
            if seq.is_prefilling:
                chunk = self.prompt_chunks.chunk(seq, budget, beside_decode)
                budget -= len(chunk.token_ids)
                chunks.append(chunk)
        return chunks

    def schedule_ahead(self, inflight: SchedulerStep) -> SchedulerStep | None:
        """The decode round after `inflight` (launched, not yet updated), planned before its
        tokens are known: each row computes what inflight sampled for its request.

        Only for steady decode, where no token inflight can sample changes the plan except
        by finishing its request. None while a request waits for a free lane, a request
        prefills or slot actions are pending; None when a row may reach its thinking budget
        at inflight, and when a grammar compiled meanwhile (schedule() queues its request). A request with an output
        constraint runs ahead with its mask left to follow inflight's token
        (ScheduledChunk.mask_follows_previous, masks_after_commit). Rows that reach their
        output limit at inflight are left out."""
        if not self._may_run_ahead(inflight):
            return None
        by_id = self.active.running_by_id()
        chunks = []
        for row, chunk in enumerate(inflight.chunks):
            seq = by_id.get(chunk.request_id)
            if seq is None or not _runs_ahead(seq, chunk):
                return None
            if seq.num_output_tokens + 1 >= seq.max_new_tokens:
                continue  # inflight's token is its last
            chunks.append(chained_chunk(seq, row))
        return self._step(StepKind.DECODE, chunks) if chunks else None

    def masks_after_commit(self, ahead: SchedulerStep) -> dict[int, np.ndarray | None]:
        """The masks of `ahead`'s rows whose mask follows the previous row's token, by row, once
        update() has committed that token: the grammar's next mask, or None where the grammar
        has not started (still thinking) or the request finished meanwhile (that row's draw is
        dropped when it lands)."""
        by_id = self.active.running_by_id()
        masks: dict[int, np.ndarray | None] = {}
        for row, chunk in enumerate(ahead.chunks):
            if not chunk.mask_follows_previous:
                continue
            seq = by_id.get(chunk.request_id)
            masks[row] = seq.constraint.next_token_bitmask() if seq is not None and not seq.is_finished else None
        return masks

    def _may_run_ahead(self, inflight: SchedulerStep) -> bool:
        """Whether nothing but inflight's tokens can change the next decode round's plan."""
        if inflight.kind is not StepKind.DECODE or not inflight.chunks or self.actions:
            return False
        if self.admission.has_compiled():
            return False
        if any(c.speculative for c in inflight.chunks) or self.speculation.drafting(self.running, ahead=True):
            return False  # a speculative round's next input depends on what it accepts
        if self.waiting and len(self.running) < self.limits.max_concurrency:
            return False  # a lane is free: let schedule() admit (full lanes free up only at update)
        return len(self.running) == len(inflight.chunks)

    def _step(self, kind: StepKind, chunks: list[ScheduledChunk]) -> SchedulerStep:
        """A step of chunks of running requests, carrying every queued slot and page action."""
        by_id = self.active.running_by_id()
        for chunk in chunks:
            by_id[chunk.request_id].num_steps_in_flight += 1
        return SchedulerStep(kind, chunks, before=self.actions.drain())

    # ---- commit --------------------------------------------------------------------
    def update(
        self,
        step: SchedulerStep,
        sampled: dict[str, int],
        verified: dict[str, VerifyOutcome] | None = None,
        logprobs: dict[str, TokenLogprobs] | None = None,
    ) -> list[EngineOutput]:
        """Apply the runner's sampled tokens (request id -> token), speculative outcomes and the
        log probabilities of the rows that asked for them, for a finished step (StepCommit);
        returns the outputs to send."""
        self.commit.land(step, sampled, verified, logprobs)
        return self.outbox.collect(self.running)

    def take_pending_outputs(self) -> list[EngineOutput]:
        """Outputs produced outside a step (deadline expiry, progress at admission)."""
        return self.outbox.collect(self.running)
