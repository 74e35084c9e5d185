"""Scheduler: admission, step planning and commit — pure CPU logic, no tensors.

Contract with the runner: schedule() returns a SchedulerStep (which tokens of which
requests to compute, where their KV pages and state slots are, which rows to sample,
and the slot/page copies to perform before and after the forward); update() takes the
sampled token ids back and returns the EngineOutputs to stream.

Policy (ARCHITECTURE.md, "Engine"): FIFO admission reserving the full prompt plus
effective-output pages and one state slot until completion, no preemption; a step is
either one prefill chunk of one request or one decode round of every decode-ready
request, alternating while both kinds of work exist.

Steady decode runs one round ahead: schedule_ahead(N) plans round N+1 before round N's
tokens are known (each row computes, on the device, the token N sampled for it), so the
engine launches it before reading N. A request that N finishes (end token, stop string,
cancel) has then computed one token more: its pages and slot are released, or kept as its
endpoint checkpoint with that token included, when N+1 lands (update of N+1).
"""

from __future__ import annotations

import collections
import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from ninfer.engine.context_cache import ROOT, CacheHit, Checkpoint, ContextCache
from ninfer.engine.kv_pool import KVPool
from ninfer.engine.sampler import fresh_seed
from ninfer.engine.request import (
    EngineError,
    EngineOutput,
    EngineRequest,
    ErrorCode,
    FinishReason,
    PromptProgress,
    SamplingParams,
    Timings,
)
from ninfer.engine.sequence import Sequence, SequenceStatus
from ninfer.engine.state_pool import StatePool
from ninfer.engine.stop_checker import StopChecker


def _has_penalties(sampling: SamplingParams) -> bool:
    return sampling.presence_penalty != 0.0 or sampling.frequency_penalty != 0.0


@dataclass(frozen=True)
class _AdmissionPlan:
    hit: CacheHit | None
    adopt: bool  # take over the checkpoint's slot and pages instead of copying its state
    num_full_pages: int  # fully reused pages, shared (or, when adopting, taken over)
    own_partial: bool  # the adopted checkpoint's partial last page is written in place
    cow_src: int | None  # partial page to copy into the first private page
    num_private_pages: int
    evict: list[Checkpoint]


class StepKind(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True)
class ResetSlot:
    slot: int


@dataclass(frozen=True)
class CopySlot:
    """Copy a whole StateImage (recurrent + conv state and the stored last logits)."""

    src: int
    dst: int


@dataclass(frozen=True)
class CopyPage:
    src: int
    dst: int


SlotAction = ResetSlot | CopySlot | CopyPage


# The token of a chained chunk: sampled by the previous step, not yet known on the host.
PENDING_TOKEN = -1


@dataclass(frozen=True)
class ScheduledChunk:
    request_id: str
    token_ids: list[int]  # the tokens to compute now (empty: sample from the slot's stored logits)
    num_computed_tokens: int
    page_ids: list[int]
    state_slot: int
    compute_logits: bool  # keep the last row's logits in the slot (for sampling or a capture)
    sample: bool
    sampling: SamplingParams  # seed always set (the engine draws one when the request has none)
    num_generated: int  # RNG position: model-sampled tokens so far
    output_token_ids: list[int]  # for presence/frequency penalties (empty when the request has none)
    # Set by schedule_ahead: token_ids is [PENDING_TOKEN], and the token to compute is the one
    # the previously launched step sampled in this row.
    previous_row: int | None = None


@dataclass(frozen=True)
class SchedulerStep:
    kind: StepKind
    chunks: list[ScheduledChunk]
    # Performed in order before the forward: restores, copy-on-write, resets, and the
    # snapshots captured at the previous step's frontiers (nothing has run since).
    before: list[SlotAction] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)


@dataclass(frozen=True)
class SchedulerLimits:
    max_concurrency: int
    max_context: int
    prefill_chunk: int
    prefix_reuse: bool = True


@dataclass
class SchedulerStats:
    """Counters since the last throughput record (the engine reads and resets them)."""

    prefill_tokens: int = 0
    decode_tokens: int = 0
    decode_rounds: int = 0
    decode_rows: int = 0

    def reset(self) -> SchedulerStats:
        snapshot = SchedulerStats(self.prefill_tokens, self.decode_tokens, self.decode_rounds, self.decode_rows)
        self.prefill_tokens = self.decode_tokens = self.decode_rounds = self.decode_rows = 0
        return snapshot


class Scheduler:
    def __init__(
        self,
        limits: SchedulerLimits,
        kv_pool: KVPool,
        state_pool: StatePool,
        cache: ContextCache,
        make_stop_checker: Callable[[EngineRequest], StopChecker],
        clock: Callable[[], float] = time.monotonic,
    ):
        self.limits = limits
        self.kv_pool = kv_pool
        self.state_pool = state_pool
        self.cache = cache
        self.make_stop_checker = make_stop_checker
        self.clock = clock
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.stats = SchedulerStats()
        self._pending_actions: list[SlotAction] = []
        self._outbox: list[EngineOutput] = []  # outputs ready to send (admission progress, finals, errors)
        self._last_step_kind: StepKind | None = None
        # Finished requests whose next token a launched step is still computing (by request id).
        self._draining: dict[str, Sequence] = {}

    # ---- requests in ---------------------------------------------------------------
    def add(self, request: EngineRequest) -> EngineOutput | None:
        """Validate and queue a request; returns a terminal error output if it can never run."""
        now = self.clock()
        prompt_len = len(request.prompt_token_ids)
        if prompt_len == 0:
            return self._error(request, ErrorCode.INVALID_REQUEST, "prompt has no tokens")
        if prompt_len > self.limits.max_context:
            return self._error(
                request,
                ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                f"prompt has {prompt_len} tokens; the context ceiling is {self.limits.max_context}",
                prompt_tokens=prompt_len,
            )
        if request.max_new_tokens < 0:
            return self._error(request, ErrorCode.INVALID_REQUEST, "max_new_tokens must be >= 0")
        max_new = min(request.max_new_tokens, self.limits.max_context - prompt_len)
        reserve_pages = self.kv_pool.pages_for(prompt_len + max_new)
        if reserve_pages > self.kv_pool.num_pages:
            return self._error(
                request,
                ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                f"prompt plus output needs {prompt_len + max_new} KV tokens; "
                f"the KV capacity is {self.kv_pool.num_pages * self.kv_pool.page_size}",
                prompt_tokens=prompt_len,
            )
        budget = request.thinking_budget
        if budget is not None:
            if budget.max_thinking_tokens <= 0:
                return self._error(request, ErrorCode.INVALID_REQUEST, "thinking budget must be positive")
            close = len(budget.close_token_ids)
            if budget.max_thinking_tokens < max_new < budget.max_thinking_tokens + close + 1:
                return self._error(
                    request,
                    ErrorCode.THINKING_BUDGET_CAPACITY,
                    f"output capacity {max_new} passes the thinking budget {budget.max_thinking_tokens} "
                    f"but cannot fit the {close}-token close sequence plus one token",
                )
        sampling = request.sampling
        if sampling.seed is None:
            sampling = msgspec.structs.replace(sampling, seed=fresh_seed())
        seq = Sequence(
            request=request,
            max_new_tokens=max_new,
            sampling=sampling,
            stop_checker=self.make_stop_checker(request),
            timings=Timings(arrived=now),
        )
        self.waiting.append(seq)
        return None

    def abort(self, request_id: str) -> EngineOutput | None:
        for seq in self.waiting:
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                seq.status = SequenceStatus.FINISHED
                return self._final_output(seq, FinishReason.CANCELLED)
        for seq in self.running:
            if seq.request_id == request_id:
                self._finish(seq, FinishReason.CANCELLED)
                return self._drain_outbox_for(request_id)
        return None

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def draining(self) -> list[Sequence]:
        """Finished requests whose pages and slot a launched step still writes."""
        return list(self._draining.values())

    def drop_inflight(self) -> None:
        """The engine failed with a step in flight: forget requests waiting for it to land."""
        self._draining.clear()

    @property
    def num_active(self) -> int:
        return len(self.running)

    # ---- planning ------------------------------------------------------------------
    def schedule(self) -> SchedulerStep | None:
        self._expire_waiting()
        self._admit()
        prefilling = [s for s in self.running if s.is_prefilling]
        decode_ready = [s for s in self.running if not s.is_prefilling]
        if prefilling and (not decode_ready or self._last_step_kind is StepKind.DECODE):
            step = self._prefill_step(prefilling[0])
        elif decode_ready:
            step = self._decode_step(decode_ready)
        else:
            step = None
        if step is None and self._pending_actions:
            step = SchedulerStep(StepKind.DECODE, [], before=self._pending_actions)
            self._pending_actions = []
        return step

    def schedule_ahead(self, inflight: SchedulerStep) -> SchedulerStep | None:
        """The decode round after `inflight` (launched, not yet updated), planned before its
        tokens are known: each row computes what inflight sampled for its request.

        Only for steady decode, where no token inflight can sample changes the plan except
        by finishing its request. None while a request waits for a free lane, a request
        prefills or slot actions are pending; None when a row may reach its thinking budget
        at inflight, or has penalties (their token history must include that token). Rows
        that reach their output limit at inflight are left out."""
        if inflight.kind is not StepKind.DECODE or not inflight.chunks or self._pending_actions:
            return None
        if self.waiting and len(self.running) < self.limits.max_concurrency:
            return None  # a lane is free: let schedule() admit (full lanes free up only at update)
        if len(self.running) != len(inflight.chunks):
            return None
        by_id = {s.request_id: s for s in self.running}
        chunks = []
        for row, chunk in enumerate(inflight.chunks):
            seq = by_id.get(chunk.request_id)
            if (
                seq is None
                or seq.num_steps_in_flight != 1
                or not chunk.sample
                or len(chunk.token_ids) != 1
                or seq.num_computed_tokens != chunk.num_computed_tokens
                or seq.num_pending_tokens != 1
                or _has_penalties(seq.sampling)
                or self._budget_may_close(seq)
            ):
                return None
            if seq.num_output_tokens + 1 >= seq.max_new_tokens:
                continue  # inflight's token is its last
            chunks.append(
                ScheduledChunk(
                    request_id=seq.request_id,
                    token_ids=[PENDING_TOKEN],
                    num_computed_tokens=seq.num_computed_tokens + 1,
                    page_ids=seq.pages,
                    state_slot=seq.state_slot,
                    compute_logits=True,
                    sample=True,
                    sampling=seq.sampling,
                    num_generated=seq.num_output_tokens - seq.num_forced_tokens + 1,
                    output_token_ids=[],
                    previous_row=row,
                )
            )
        return self._step(StepKind.DECODE, chunks) if chunks else None

    @staticmethod
    def _budget_may_close(seq: Sequence) -> bool:
        """The next model token may reach the thinking budget (forced close tokens follow it)."""
        budget = seq.request.thinking_budget
        return budget is not None and seq.thinking_open and seq.num_thinking_tokens + 1 >= budget.max_thinking_tokens

    def _prefill_step(self, seq: Sequence) -> SchedulerStep:
        num_tokens = seq.next_prefill_chunk(self.limits.prefill_chunk)
        start = seq.num_computed_tokens
        end = start + num_tokens
        last = end == seq.prompt_len
        captures_here = any(f == end for f, _ in seq.capture_frontiers)
        chunk = self._chunk(seq, seq.token_ids[start:end], compute_logits=last or captures_here, sample=last)
        return self._step(StepKind.PREFILL, [chunk])

    def _decode_step(self, seqs: list[Sequence]) -> SchedulerStep:
        chunks = [
            self._chunk(s, s.token_ids[s.num_computed_tokens :], compute_logits=True, sample=True) for s in seqs
        ]
        return self._step(StepKind.DECODE, chunks)

    def _chunk(self, seq: Sequence, token_ids: list[int], compute_logits: bool, sample: bool) -> ScheduledChunk:
        sample = sample and seq.num_output_tokens < seq.max_new_tokens
        return ScheduledChunk(
            request_id=seq.request_id,
            token_ids=token_ids,
            num_computed_tokens=seq.num_computed_tokens,
            page_ids=seq.pages,
            state_slot=seq.state_slot,
            compute_logits=compute_logits,
            sample=sample,
            sampling=seq.sampling,
            num_generated=seq.num_output_tokens - seq.num_forced_tokens,
            # Copying the history costs O(output) per step; only penalties read it.
            output_token_ids=seq.token_ids[seq.prompt_len :] if _has_penalties(seq.sampling) else [],
        )

    def _step(self, kind: StepKind, chunks: list[ScheduledChunk]) -> SchedulerStep:
        by_id = {s.request_id: s for s in self.running}
        for chunk in chunks:
            by_id[chunk.request_id].num_steps_in_flight += 1
        step = SchedulerStep(kind, chunks, before=self._pending_actions)
        self._pending_actions = []
        self._last_step_kind = kind
        return step

    # ---- admission -----------------------------------------------------------------
    def _expire_waiting(self) -> None:
        now = self.clock()
        for seq in list(self.waiting):
            deadline = seq.request.deadline
            if deadline is not None and now >= deadline:
                self.waiting.remove(seq)
                seq.status = SequenceStatus.FINISHED
                self._outbox.append(
                    self._error(seq.request, ErrorCode.QUEUE_TIMEOUT, "request was not admitted before its deadline")
                )

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.limits.max_concurrency:
            if not self._try_admit(self.waiting[0]):
                return  # FIFO: later requests wait behind the head
            self.running.append(self.waiting.popleft())

    def _try_admit(self, seq: Sequence) -> bool:
        """Admit with the best legal plan: resume from the hit (copying its state), adopt the hit
        itself, or start from root; a hit must never make a fitting request wait forever."""
        hit = self.cache.lookup(seq.token_ids, seq.request.session_key) if self.limits.prefix_reuse else None
        candidates: list[tuple[CacheHit | None, bool]] = []
        if hit is not None:
            candidates.append((hit, False))
            if hit.is_exact_frontier:
                candidates.append((hit, True))
        candidates.append((None, False))
        for candidate, adopt in candidates:
            plan = self._plan_admission(seq, candidate, adopt)
            if plan is not None:
                self._commit_admission(seq, plan)
                return True
        return False

    def _plan_admission(self, seq: Sequence, hit: CacheHit | None, adopt: bool) -> _AdmissionPlan | None:
        page_size = self.kv_pool.page_size
        total_pages = self.kv_pool.pages_for(seq.prompt_len + seq.max_new_tokens)
        ck = hit.checkpoint if hit else None
        reused = hit.num_reused_tokens if hit else 0
        num_full = reused // page_size
        partial = ck.pages[num_full] if ck is not None and reused % page_size else None
        # A partial last page is copied unless an adopted checkpoint is its only owner: other
        # owners may write past our frontier in it.
        own_partial = adopt and partial is not None and self.kv_pool.refcount(partial) == 1
        cow_src = partial if partial is not None and not own_partial else None
        num_private = total_pages - num_full - (1 if own_partial else 0)
        slots_needed = 0 if adopt else 1
        victims = self.cache.victims(keep=ck)
        page_gains = [0, *self.cache.pages_freed_by_evicting(victims)]
        for num_evict in range(len(victims) + 1):
            if (
                self.kv_pool.num_free + page_gains[num_evict] >= num_private
                and self.state_pool.num_free + num_evict >= slots_needed
            ):
                return _AdmissionPlan(hit, adopt, num_full, own_partial, cow_src, num_private, victims[:num_evict])
        return None

    def _commit_admission(self, seq: Sequence, plan: _AdmissionPlan) -> None:
        hit = plan.hit
        ck = hit.checkpoint if hit else None
        reused = hit.num_reused_tokens if hit else 0
        shared = ck.pages[: plan.num_full_pages] if ck is not None else []
        if ck is not None and not plan.adopt:
            self.kv_pool.share(shared)  # hold the prefix before evicting anything that might release it
        for victim in plan.evict:
            self.cache.remove(victim)
        private = self.kv_pool.allocate(plan.num_private_pages)
        if plan.cow_src is not None:
            # Runs before any forward writes, so the source still holds the prefix's tokens.
            self._pending_actions.append(CopyPage(plan.cow_src, private[0]))
        if plan.adopt:
            self.cache.remove(ck, release_resources=False)  # its page references and slot become ours
            if plan.cow_src is not None:
                self.kv_pool.release([plan.cow_src])
            kept = ck.pages[: plan.num_full_pages + (1 if plan.own_partial else 0)]
            seq.pages = kept + private
            seq.state_slot = ck.state_slot
        else:
            seq.pages = shared + private
            seq.state_slot = self.state_pool.allocate()
            if hit is not None and hit.is_exact_frontier:
                self._pending_actions.append(CopySlot(ck.state_slot, seq.state_slot))
                self.cache.touch(ck)
            else:
                self._pending_actions.append(ResetSlot(seq.state_slot))
        seq.reuse_path = ck.path if ck is not None else ROOT
        seq.num_computed_tokens = seq.num_cached_tokens = reused
        if hit is not None and hit.is_exact_frontier:
            seq.logits_frontier = reused
        seq.status = SequenceStatus.RUNNING
        seq.timings.admitted = self.clock()
        if reused == seq.prompt_len:
            seq.timings.prompt_done = seq.timings.admitted
        if self.limits.prefix_reuse and reused < seq.prompt_len:
            frontiers = {seq.prompt_len: seq.request.endpoint_path}
            for capture in seq.request.capture_hints:
                if reused < capture.frontier <= seq.prompt_len:
                    frontiers[capture.frontier] = capture.path
            seq.capture_frontiers = sorted(frontiers.items())
        # The first progress event reports the reuse choice: processed == cache.
        seq.unsent_progress = PromptProgress(seq.prompt_len, reused, reused, 0.0)
        self._outbox.append(self._delta_output(seq))

    # ---- commit --------------------------------------------------------------------
    def update(self, step: SchedulerStep, sampled: dict[str, int]) -> list[EngineOutput]:
        """Apply the runner's sampled tokens (request id -> token) for a finished step."""
        now = self.clock()
        by_id = {s.request_id: s for s in self.running}
        for chunk in step.chunks:
            seq = by_id.get(chunk.request_id) or self._draining.get(chunk.request_id)
            if seq is not None:
                seq.num_steps_in_flight -= 1
                if seq.is_finished and seq.num_steps_in_flight == 0:
                    self._land_after_finish(self._draining.pop(seq.request_id), chunk)
                    continue
            if seq is None or seq.is_finished:
                continue  # cancelled while the step ran
            was_prefilling = seq.is_prefilling
            seq.num_computed_tokens += len(chunk.token_ids)
            if chunk.compute_logits:
                seq.logits_frontier = seq.num_computed_tokens
            if step.kind is StepKind.PREFILL:
                self.stats.prefill_tokens += len(chunk.token_ids)
                self._capture_prompt_frontiers(seq)
            if was_prefilling and not seq.is_prefilling:
                seq.timings.prompt_done = now
            if was_prefilling:
                elapsed_ms = (now - seq.timings.admitted) * 1000.0
                seq.unsent_progress = PromptProgress(
                    seq.prompt_len, seq.num_cached_tokens, min(seq.num_computed_tokens, seq.prompt_len), elapsed_ms
                )
            if chunk.sample:
                if step.kind is StepKind.DECODE:
                    self.stats.decode_tokens += 1
                self._commit(seq, sampled[chunk.request_id], now)
            elif not seq.is_prefilling and seq.num_output_tokens >= seq.max_new_tokens:
                self._finish(seq, FinishReason.LENGTH)  # max_new_tokens 0: prompt processing only
        if step.kind is StepKind.DECODE and step.chunks:
            self.stats.decode_rounds += 1
            self.stats.decode_rows += len(step.chunks)
        return self._collect_outputs()

    def _commit(self, seq: Sequence, token_id: int, now: float) -> None:
        seq.timings.first_token = seq.timings.first_token or now
        seq.timings.last_token = now
        self._append_token(seq, token_id, forced=False)
        if seq.is_finished:
            return
        # The output limit wins over the thinking cap (spec: limits first, then the forced close).
        if seq.num_output_tokens >= seq.max_new_tokens:
            self._finish(seq, FinishReason.LENGTH)
            return
        budget = seq.request.thinking_budget
        if budget is None or not seq.thinking_open:
            return
        if token_id == budget.think_end_token_id:
            seq.thinking_open = False
            return
        seq.num_thinking_tokens += 1
        if seq.num_thinking_tokens >= budget.max_thinking_tokens:
            # Close thinking without sampling; the close tokens are computed with the next step.
            seq.thinking_open = False
            for forced in budget.close_token_ids:
                self._append_token(seq, forced, forced=True)
                if seq.is_finished:
                    return

    def _append_token(self, seq: Sequence, token_id: int, forced: bool) -> None:
        seq.token_ids.append(token_id)
        seq.unsent_token_ids.append(token_id)
        if forced:
            seq.num_forced_tokens += 1
            seq.unsent_forced += 1
        stop = seq.stop_checker.append(token_id)
        seq.unsent_text += stop.text
        if stop.stopped:
            self._finish(seq, FinishReason.STOP, stop.stop_reason)

    def _capture_prompt_frontiers(self, seq: Sequence) -> None:
        while seq.capture_frontiers and seq.capture_frontiers[0][0] <= seq.num_computed_tokens:
            frontier, path = seq.capture_frontiers.pop(0)
            if frontier == seq.num_computed_tokens:
                self._capture_copy(seq, frontier, path)

    def _capture_copy(self, seq: Sequence, frontier: int, path: str) -> None:
        """Snapshot an active sequence at a prompt frontier (state copied after this step)."""
        tokens = seq.token_ids[:frontier]
        existing = self.cache.find_identical(tokens)
        if existing is not None:
            self.cache.touch(existing)
            return
        if self.state_pool.num_free == 0:
            victims = self.cache.victims()
            if not victims:
                return  # every slot is active: skip this capture
            self.cache.remove(victims[0])
        slot = self.state_pool.allocate()
        pages = seq.pages[: self.kv_pool.pages_for(frontier)]
        self.kv_pool.share(pages)
        self.cache.insert(tokens, pages, slot, path, seq.request.session_key)
        # Runs before the next forward, so it still sees the state right after this frontier.
        self._pending_actions.append(CopySlot(seq.state_slot, slot))

    # ---- finishing -----------------------------------------------------------------
    def _finish(self, seq: Sequence, reason: FinishReason, stop_reason: int | str | None = None) -> None:
        if seq.is_finished:
            return
        seq.status = SequenceStatus.FINISHED
        if reason is FinishReason.LENGTH or reason is FinishReason.CANCELLED:
            seq.unsent_text += seq.stop_checker.flush()
        self.running.remove(seq)
        if seq.num_steps_in_flight:
            self._draining[seq.request_id] = seq  # a launched step still writes its pages and slot
        else:
            self._release_or_capture_endpoint(seq)
        self._outbox.append(self._final_output(seq, reason, stop_reason))

    def _land_after_finish(self, seq: Sequence, chunk: ScheduledChunk) -> None:
        """The step launched ahead for a request that finished meanwhile has landed: it
        computed the last committed token (and stored its logits); now release or keep."""
        seq.num_computed_tokens += len(chunk.token_ids)
        if chunk.compute_logits:
            seq.logits_frontier = seq.num_computed_tokens
        self._release_or_capture_endpoint(seq)

    def _release_or_capture_endpoint(self, seq: Sequence) -> None:
        frontier = seq.num_computed_tokens
        keep = (
            self.limits.prefix_reuse
            and frontier > 0
            and seq.logits_frontier == frontier
            and self.cache.find_identical(seq.token_ids[:frontier]) is None
        )
        if keep:
            num_pages = self.kv_pool.pages_for(frontier)
            self.kv_pool.release(seq.pages[num_pages:])
            self.cache.insert(
                seq.token_ids[:frontier], seq.pages[:num_pages], seq.state_slot, seq.request.endpoint_path,
                seq.request.session_key,
            )
        else:
            self.kv_pool.release(seq.pages)
            self.state_pool.release(seq.state_slot)
        seq.pages = []
        seq.state_slot = None

    # ---- outputs -------------------------------------------------------------------
    def _collect_outputs(self) -> list[EngineOutput]:
        outputs = self._outbox
        self._outbox = []
        for seq in self.running:
            if seq.unsent_token_ids or seq.unsent_progress is not None:
                outputs.append(self._delta_output(seq))
        return outputs

    def _drain_outbox_for(self, request_id: str) -> EngineOutput | None:
        for i, out in enumerate(self._outbox):
            if out.request_id == request_id and out.finished:
                return self._outbox.pop(i)
        return None

    def take_pending_outputs(self) -> list[EngineOutput]:
        """Outputs produced outside a step (deadline expiry, progress at admission)."""
        return self._collect_outputs()

    def _delta_output(self, seq: Sequence) -> EngineOutput:
        out = EngineOutput(
            request_id=seq.request_id,
            new_token_ids=seq.unsent_token_ids,
            text=seq.unsent_text,
            forced_token_count=seq.unsent_forced,
            prompt_tokens=seq.prompt_len,
            cached_tokens=seq.num_cached_tokens,
            completion_tokens=seq.num_output_tokens,
            reuse_path=seq.reuse_path,
            progress=seq.unsent_progress,
            timings=seq.timings,
        )
        seq.unsent_token_ids, seq.unsent_text, seq.unsent_forced = [], "", 0
        seq.unsent_progress = None
        return out

    def _final_output(
        self, seq: Sequence, reason: FinishReason, stop_reason: int | str | None = None
    ) -> EngineOutput:
        out = self._delta_output(seq)
        out.finish_reason = reason
        out.stop_reason = stop_reason
        return out

    def _error(
        self, request: EngineRequest, code: ErrorCode, message: str, prompt_tokens: int | None = None
    ) -> EngineOutput:
        return EngineOutput(
            request_id=request.request_id,
            finish_reason=FinishReason.ERROR,
            prompt_tokens=len(request.prompt_token_ids),
            error=EngineError(
                code, message, prompt_tokens=prompt_tokens,
                max_context=self.limits.max_context if code is ErrorCode.CONTEXT_LENGTH_EXCEEDED else None,
            ),
        )
