"""Admission: requests in, validated into Sequences, admitted FIFO with a legal resource plan.

A request reserves its full prompt plus effective-output pages and one state slot until it
completes; nothing admitted is preempted. The head of the queue is admitted with the best
legal plan (resume from a cache hit by copying its state, or restoring it from the host
tier; adopt a device hit itself; resume from a shorter hit when keeping the best leaves no room;
or start from root; the search is bounded, see MAX_REUSE_TARGETS), evicting the checkpoints whose loss
costs least (planner.py) when that makes room for pages, and freeing a device slot through
placement.py when one is short; later requests wait behind it. The chosen plan is carried out by
PlanCommit (admission_plan.py). A waiting request past its deadline ends with request_queue_timeout.

A request with an output constraint whose grammar is not compiled yet waits outside the queue
while a worker thread compiles it (compiled_grammars.py), and joins the queue's tail once it is.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from concurrent.futures import Future

import msgspec

from ninfer.config import spare_kv_tokens
from ninfer.contract.output import (
    DegradationUnits,
    EngineOutput,
    ErrorCode,
    Materialization,
    Timings,
)
from ninfer.contract.request import EngineRequest
from ninfer.contract.reuse_path import ReusePath
from ninfer.contract.sampling import fresh_seed
from ninfer.engine.cache.context_cache import CacheHit, ContextCache
from ninfer.engine.cache.planner import MAX_CANDIDATES
from ninfer.engine.compiled_grammars import CompiledGrammars
from ninfer.engine.constraint_state import ConstraintState
from ninfer.engine.host_detail import HostDetail
from ninfer.engine.kv_pool import KVPool
from ninfer.engine.scheduler.action_queue import ActionQueue
from ninfer.engine.scheduler.admission_plan import AdmissionPlan, PlanCommit
from ninfer.engine.scheduler.limits import SchedulerLimits
from ninfer.engine.scheduler.outputs import error_output
from ninfer.engine.scheduler.placement import Placement
from ninfer.engine.sequence import Sequence, SequenceStatus
from ninfer.engine.state_pool import StatePool
from ninfer.engine.stop_checker import StopChecker

# The search is bounded; the bound that cut an attempt short is its decision's stop reason.
MAX_REUSE_TARGETS = 4  # reuse targets tried before the root: target_budget
MAX_EXPANSIONS = 32  # victims added one at a time per target, then the rest at once: expansion_capacity
# An attempt's search time, as the engine thread's CPU time (a thread descheduled on a busy host
# has not searched longer); past it only the root is tried: time_budget.
PLANNING_BUDGET_NS = 50_000_000


class Admission:
    def __init__(
        self,
        limits: SchedulerLimits,
        kv_pool: KVPool,
        state_pool: StatePool,
        cache: ContextCache,
        placement: Placement,
        make_stop_checker: Callable[[EngineRequest], StopChecker],
        clock: Callable[[], float],
        actions: ActionQueue,
        detail: HostDetail,
        grammars: CompiledGrammars | None = None,
        vocab_size: int = 0,
    ):
        """actions: where a plan's context moves go, to run before the next forward; detail:
        where committing a plan is timed (a context transaction). grammars: compiles output
        constraints (None: requests with one are refused); vocab_size: the logits width their token
        bitmasks cover."""
        self.limits = limits
        self.kv_pool = kv_pool
        self.state_pool = state_pool
        self.cache = cache
        self.placement = placement
        self.make_stop_checker = make_stop_checker
        self.clock = clock
        self.detail = detail
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.grammars = grammars
        self.vocab_size = vocab_size
        self.compiling: list[tuple[Sequence, Future]] = []  # in arrival order
        self._projection_work = 0  # eviction sets examined by the admission attempt in progress
        self._started_ns = self._started_cpu_ns = 0  # when the attempt in progress began planning (wall, CPU)
        self._bound: str | None = None  # the first search bound it hit
        self.plan_commit = PlanCommit(limits, kv_pool, state_pool, cache, placement, actions, clock)

    def add(self, request: EngineRequest) -> EngineOutput | None:
        """Validate and queue a request; returns a terminal error output if it can never run."""
        now = self.clock()
        refusal = self._refusal(request)
        if refusal is not None:
            return refusal
        sampling = request.sampling
        if sampling.seed is None:
            sampling = msgspec.structs.replace(sampling, seed=fresh_seed())
        seq = Sequence(
            request=request,
            max_new_tokens=self._output_limit(request),
            sampling=sampling,
            stop_checker=self.make_stop_checker(request),
            timings=Timings(arrived=now),
        )
        constraint = request.constraint
        if constraint is None:
            self.waiting.append(seq)
            return None
        compiled = self.grammars.get(constraint)
        if compiled is None:
            self.compiling.append((seq, self.grammars.compile(constraint)))
            return None
        self._constrain(seq, compiled)
        self.waiting.append(seq)
        return None

    def _output_limit(self, request: EngineRequest) -> int:
        """The request's output limit clamped to the context ceiling."""
        return min(request.max_new_tokens, self.limits.max_context - len(request.prompt_token_ids))

    def _refusal(self, request: EngineRequest) -> EngineOutput | None:
        """Why the request can never run (its error output), or None."""
        prompt_len = len(request.prompt_token_ids)
        if prompt_len == 0:
            return error_output(request, ErrorCode.INVALID_REQUEST, "prompt has no tokens")
        if prompt_len > self.limits.max_context:
            return self._context_error(
                request, f"prompt has {prompt_len} tokens; the context ceiling is {self.limits.max_context}"
            )
        if request.max_new_tokens < 0:
            return error_output(request, ErrorCode.INVALID_REQUEST, "max_new_tokens must be >= 0")
        max_new = self._output_limit(request)
        if self.kv_pool.pages_for(prompt_len + max_new + self.spare_tokens) > self.kv_pool.num_pages:
            return self._context_error(
                request,
                f"prompt plus output needs {prompt_len + max_new + self.spare_tokens} KV tokens; "
                f"the KV capacity is {self.kv_pool.num_pages * self.kv_pool.page_size}",
            )
        budget = request.thinking_budget
        if budget is not None:
            if budget.max_thinking_tokens <= 0:
                return error_output(request, ErrorCode.INVALID_REQUEST, "thinking budget must be positive")
            close = len(budget.close_token_ids)
            if budget.max_thinking_tokens < max_new < budget.max_thinking_tokens + close + 1:
                return error_output(
                    request,
                    ErrorCode.THINKING_BUDGET_CAPACITY,
                    f"output capacity {max_new} passes the thinking budget {budget.max_thinking_tokens} "
                    f"but cannot fit the {close}-token close sequence plus one token",
                )
        if request.constraint is not None and self.grammars is None:
            return error_output(request, ErrorCode.INVALID_REQUEST, "this engine takes no output constraints")
        return None

    def has_compiled(self) -> bool:
        """Whether a grammar some request waits for has finished compiling (or failed)."""
        return any(future.done() for _, future in self.compiling)

    def take_compiled(self) -> list[EngineOutput]:
        """Queue the requests whose grammars are compiled; a grammar that failed ends its request."""
        errors: list[EngineOutput] = []
        still: list[tuple[Sequence, Future]] = []
        for seq, future in self.compiling:
            if not future.done():
                still.append((seq, future))
            elif future.exception() is not None:
                seq.status = SequenceStatus.FINISHED
                reason = (str(future.exception()).strip() or type(future.exception()).__name__).splitlines()[0]
                errors.append(error_output(seq.request, ErrorCode.INVALID_REQUEST,
                                           f"the output grammar does not compile: {reason}"))
            else:
                self._constrain(seq, future.result())
                self.waiting.append(seq)
        self.compiling = still
        return errors

    def _constrain(self, seq: Sequence, compiled) -> None:
        constraint = seq.request.constraint
        seq.constraint = ConstraintState(
            compiled, seq.request.stop_token_ids, self.vocab_size, constraint.starts_after_token_id
        )

    @property
    def spare_tokens(self) -> int:
        """KV reserved past prompt + output for a speculative round's draft window."""
        return spare_kv_tokens(self.limits.num_draft_tokens)

    def _context_error(self, request: EngineRequest, message: str) -> EngineOutput:
        return error_output(
            request,
            ErrorCode.CONTEXT_LENGTH_EXCEEDED,
            message,
            prompt_tokens=len(request.prompt_token_ids),
            max_context=self.limits.max_context,
        )

    def remove(self, request_id: str) -> Sequence | None:
        """Take a waiting request out of the queue (cancelled before admission)."""
        for seq in self.waiting:
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                seq.status = SequenceStatus.FINISHED
                return seq
        for entry in self.compiling:
            if entry[0].request_id == request_id:
                self.compiling.remove(entry)
                entry[0].status = SequenceStatus.FINISHED
                return entry[0]
        return None

    def expire(self) -> list[EngineOutput]:
        """Waiting requests past their deadline end with request_queue_timeout."""
        now = self.clock()
        expired = []
        for seq in [*self.waiting, *(seq for seq, _ in self.compiling)]:
            deadline = seq.request.deadline
            if deadline is not None and now >= deadline:
                self.remove(seq.request_id)
                expired.append(
                    error_output(seq.request, ErrorCode.QUEUE_TIMEOUT, "request was not admitted before its deadline")
                )
        return expired

    def admit(self, num_running: int) -> list[Sequence]:
        """Admit from the head while lanes are free and a plan exists; FIFO, so a head that does
        not fit yet holds the others back."""
        admitted: list[Sequence] = []
        while self.waiting and num_running + len(admitted) < self.limits.max_concurrency:
            if not self._try_admit(self.waiting[0]):
                break
            admitted.append(self.waiting.popleft())
        return admitted

    def _try_admit(self, seq: Sequence) -> bool:
        """Admit with the best legal plan, trying targets in order: resume from the best hit
        (copying its state), adopt it, resume from a shorter hit (up to MAX_REUSE_TARGETS reuse
        targets in all), then the root; a hit must never make a fitting request wait forever."""
        hits = self.cache.lookup_all(seq.token_ids, seq.request.session_key) if self.limits.prefix_reuse else []
        targets: list[tuple[CacheHit, bool]] = []
        for i, hit in enumerate(hits):
            targets.append((hit, False))
            if i == 0 and hit.is_exact_frontier and not hit.checkpoint.on_host:
                targets.append((hit, True))
        self._started_ns = time.perf_counter_ns()
        self._started_cpu_ns = time.thread_time_ns()
        self._projection_work = 0
        self._bound = None
        evaluated = 0
        for candidate, adopt in [*targets[:MAX_REUSE_TARGETS], (None, False)]:
            if candidate is None and len(targets) > MAX_REUSE_TARGETS:
                self._note_bound("target_budget")  # shorter hits left untried: the root is next
            elif candidate is not None and evaluated and self._past_time_budget():
                self._note_bound("time_budget")
                continue  # only the root is tried once planning has taken its time
            evaluated += 1
            plan = self._plan(seq, candidate, adopt)
            if plan is not None:
                decision = self._predict(seq, plan)
                spills, drops = self.placement.num_spills, self.placement.num_drops
                with self.detail.timed("context_transaction"):
                    self.plan_commit.commit(seq, plan)
                seq.materialization = self._decision(
                    plan, decision, evaluated, time.perf_counter_ns() - self._started_ns, bool(hits),
                    self.placement.num_spills - spills, self.placement.num_drops - drops,
                )
                self._count(seq)
                return True
        return False

    def _note_bound(self, bound: str) -> None:
        """A search bound cut the attempt short; the first one hit is its stop reason."""
        self._bound = self._bound or bound

    def _past_time_budget(self) -> bool:
        return time.thread_time_ns() - self._started_cpu_ns > PLANNING_BUDGET_NS

    def _count(self, seq: Sequence) -> None:
        """The throughput record's view of the committed decision."""
        counters = self.cache.counters
        decision = seq.materialization
        if self._projection_work:
            counters.pressure_searches += 1
            counters.pressure_stops[decision.stop_reason] += 1
        counters.budget_exhausted += decision.budget_exhausted
        counters.maximal_root_fallbacks += decision.maximal_root_fallback
        counters.last_selection = {
            "target": decision.target,
            "reuse_path": ReusePath(seq.reuse_path).value,
            "reused_tokens": decision.reused_tokens,
            "prompt_tokens": seq.prompt_len,
            "stop_reason": decision.stop_reason,
            "budget_exhausted": decision.budget_exhausted,
            "maximal_root_fallback": decision.maximal_root_fallback,
        }

    def _predict(self, seq: Sequence, plan: AdmissionPlan) -> tuple[float, float]:
        """(immediate, future-loss) seconds of a plan, read before it changes the cache."""
        planner = self.placement.planner
        costs = planner.costs
        ck = plan.hit.checkpoint if plan.hit is not None else None
        reused = plan.hit.num_reused_tokens if plan.hit is not None else 0
        immediate = costs.recompute_seconds(seq.prompt_len - reused)
        if ck is not None and ck.kv_on_host:
            immediate += costs.transfer_seconds(len(ck.host_pages) * planner.kv_page_bytes)
        if ck is not None and ck.on_host:
            immediate += costs.transfer_seconds(planner.state_image_bytes)
        future = 0.0
        if plan.evict:
            loss = planner.loss_seconds()
            for victim in plan.evict:
                if victim in plan.spill_kv:
                    future += costs.transfer_seconds(len(victim.pages) * planner.kv_page_bytes)
                else:
                    future += loss[victim.checkpoint_id]
        return immediate, future

    def _decision(
        self, plan: AdmissionPlan, predicted: tuple[float, float], evaluated: int, planning_ns: int,
        had_hit: bool, state_spills: int, slot_drops: int,
    ) -> Materialization:
        immediate, future = predicted
        if plan.free_device_slot:
            future += self.placement.last_loss_seconds
        immediate_ns, future_ns = round(immediate * 1e9), round(future * 1e9)
        dropped = len(plan.evict) - len(plan.spill_kv) + slot_drops
        return Materialization(
            target="root" if plan.hit is None else "adopted_checkpoint" if plan.adopt else "checkpoint",
            reused_tokens=plan.hit.num_reused_tokens if plan.hit is not None else 0,
            predicted_immediate_ns=immediate_ns,
            predicted_future_loss_ns=future_ns,
            predicted_total_ns=immediate_ns + future_ns,
            evaluated_targets=evaluated,
            projection_work=self._projection_work,
            planning_ns=planning_ns,
            stop_reason=self._bound or plan.stop_reason,
            budget_exhausted=plan.budget_exhausted or self._bound is not None,
            degradation_units=DegradationUnits(dropped, len(plan.spill_kv), state_spills),
            maximal_root_fallback=had_hit and plan.hit is None,
        )

    def _plan(self, seq: Sequence, hit: CacheHit | None, adopt: bool) -> AdmissionPlan | None:
        page_size = self.kv_pool.page_size
        total_pages = self.kv_pool.pages_for(seq.prompt_len + seq.max_new_tokens + self.spare_tokens)
        ck = hit.checkpoint if hit else None
        reused = hit.num_reused_tokens if hit else 0
        num_full = reused // page_size
        # A hit whose KV was spilled comes back into fresh device pages, its own alone.
        restore = len(ck.host_pages) if ck is not None and ck.kv_on_host else 0
        has_partial = ck is not None and reused % page_size != 0
        # A partial last page is copied unless an adopted checkpoint is its only owner: other
        # owners may write past our frontier in it.
        own_partial = adopt and has_partial and (restore > 0 or self.kv_pool.refcount(ck.pages[num_full]) == 1)
        cow = has_partial and not own_partial
        num_private = total_pages - num_full - (1 if own_partial else 0)
        pages_needed = num_private + restore
        slots_needed = 0 if adopt else 1
        if self.kv_pool.num_free >= pages_needed and self.state_pool.num_free >= slots_needed:
            # No pressure: the common case needs no ranking of the checkpoints.
            return AdmissionPlan(hit, adopt, num_full, own_partial, cow, num_private, [], [], False)
        victims = self.placement.planner.drop_order(keep=ck)
        page_gains = [0, *self.cache.pages_freed_by_evicting(victims)]
        budget_exhausted = len(self.cache) > MAX_CANDIDATES
        num_evict = 0
        while num_evict <= len(victims):
            if num_evict < len(victims):
                bound = "expansion_capacity" if num_evict >= MAX_EXPANSIONS else (
                    "time_budget" if self._past_time_budget() else None)
                if bound is not None:
                    self._note_bound(bound)
                    num_evict = len(victims)  # past a bound, the whole remaining queue is projected once
            self._projection_work += 1
            if self.kv_pool.num_free + page_gains[num_evict] < pages_needed:
                num_evict += 1
                continue
            evict = victims[:num_evict]
            spill_kv = self.placement.planner.kv_spills(evict)
            dropped = [c for c in evict if c not in spill_kv]
            free_slots = self.state_pool.num_free + sum(c.state_slot is not None for c in dropped)
            # The cheapest prefix of the drop order that fits: evicting more would only add loss.
            stop = "queue_exhausted" if num_evict == len(victims) and victims else "value_of_next_expansion"
            if free_slots >= slots_needed:
                return AdmissionPlan(hit, adopt, num_full, own_partial, cow, num_private, evict, spill_kv, False,
                                     stop, budget_exhausted)
            if self.placement.can_free_device_slot(ck, dropped):
                return AdmissionPlan(hit, adopt, num_full, own_partial, cow, num_private, evict, spill_kv, True,
                                     stop, budget_exhausted)
            num_evict += 1
        return None
