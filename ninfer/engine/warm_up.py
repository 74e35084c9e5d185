"""Warm-up: before the server reports ready, run through the engine the step shapes its
configuration can produce, so the first request finds every kernel compiled and autotuned.

Triton compiles a kernel per specialization (a size divisible by 16, equal to 1, or neither)
and autotunes per key, at first use: without this the first request after start-up waited
tens of seconds. The phases:
  worst  prompt chunks of several requests filling one step's whole budget (the step with the
         most activations: its peak is what --kv-capacity auto sets aside), then their decode
  ladder single prompts from just under that budget down to 17 tokens by halves; with prefix
         reuse each resumes from the checkpoint of a request for its first third (so its rest
         runs over cached context) and snapshots a checkpoint two thirds of the way in, inside
         its step (a turn closure before a chat's generation prompt)
  tails  prompts whose last 1 to 16 tokens run as a step of their own over cached context, as a
         chat's generation prompt does after its turn-closure checkpoint when that cannot be
         snapshotted inside the step: one per query-block size the attention kernel compiles
         for short rows (1, 2, 4, 8, 16)
  mixed  requests decoding while another's prompt runs beside them in mixed-budget chunks and
         an odd-sized tail over cached context; penalized, greedy and sampled rows throughout
  constrained  a request under a JSON grammar with log probabilities: the vocabulary index and
         the shared rules' masks the grammar compiler builds once (about a second and 0.3 s on
         a 248K vocabulary) and the mask and log-softmax kernels, so the first structured-output
         request waits for none of them
Requests are synthetic token ids; nothing they leave in the context cache survives, and every
pool is back to where it started (checked).

A start whose full warm-up already ran with the same plan, code, device and libraries
(warm_up_record.py) finds every kernel compiled and autotuned in the kernel cache: it runs the
short warm-up, the worst step (its workspace is measured), the mixed phase (the sampling
paths) and the constrained one (the grammar compiler's per-process tables), and leaves the
ladder and the tails, whose eager steps are most of a restart's warm-up, to load their kernels
from the cache at first use.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

from ninfer.contract.constraint import OutputConstraint
from ninfer.contract.request import CaptureHint, EngineRequest
from ninfer.contract.reuse_path import ReusePath
from ninfer.contract.sampling import SamplingParams

log = logging.getLogger("ninfer.engine")

GREEDY = SamplingParams(temperature=0.0, seed=0)
SAMPLED = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, seed=1)
# Qwen's presets carry a presence penalty: its sampling path must be compiled too.
PENALIZED = SamplingParams(temperature=1.0, top_p=0.95, top_k=20, presence_penalty=1.5, frequency_penalty=0.5, seed=2)
ROTATION = (PENALIZED, SAMPLED, GREEDY)  # greedy rows also come from the worst-step phase
MAX_WARM_UP_STEPS = 10_000
# Short-row tails: 1, 2, 3, 5 and 9 tokens round up to the attention kernel's query blocks 1..16.
TAIL_LENGTHS = (1, 2, 3, 5, 9)
# A JSON object whose shortest spelling outlasts the warm-up request's output limit, so the grammar
# never needs an end-of-turn token (the synthetic request has none).
WARM_UP_GRAMMAR = OutputConstraint(
    "warm-up", r'root ::= "{" [ \n\t]* "\"warm_up_field\"" [ \n\t]* ":" [ \n\t]* "\"" [^"\\]* "\"" [ \n\t]* "}"' "\n"
)


@dataclass(frozen=True)
class WarmUpReport:
    seconds: float
    num_steps: int
    worst_step_tokens: int


def _prompt(length: int, salt: int, vocab_size: int) -> list[int]:
    """Distinct ids per request (no prefix is shared, so nothing is reused between them)."""
    base = 1000 + 7919 * salt
    return [(base + 31 * i) % vocab_size for i in range(length)]


def worst_step_requests(config, vocab_size: int) -> list[EngineRequest]:
    """Requests whose prompts fill one step's whole budget: at most max_concurrency of them,
    each within max_context, all of them (with their outputs) within the KV pool."""
    num_output = 2
    free_pages = config.num_kv_pages
    remaining = config.prefill_chunk
    requests: list[EngineRequest] = []
    while remaining > 0 and len(requests) < config.max_concurrency:
        spare = config.spare_kv_tokens  # a speculative engine's draft window past the output
        length = min(remaining, config.max_context - num_output, free_pages * config.page_size - num_output - spare)
        if length < 1:
            break
        prompt = _prompt(length, len(requests), vocab_size)
        requests.append(EngineRequest(f"warm-worst-{len(requests)}", prompt, GREEDY, max_new_tokens=num_output))
        free_pages -= -(-(length + num_output + spare) // config.page_size)
        remaining -= length
    return requests


def prompt_ladder(config) -> list[int]:
    """Single-prompt step sizes from just under the budget down to 17 by halves, none a multiple
    of 16: kernels pick block sizes by how many tokens a step has, and Triton specializes on it."""
    lengths = []
    length = min(config.prefill_chunk, config.max_context - 1, config.num_kv_pages * config.page_size - 1) - 3
    while length >= 17:
        lengths.append(length if length % 16 else length - 1)
        length //= 2
    return lengths


def mixed_step_requests(config, vocab_size: int) -> tuple[list[EngineRequest], EngineRequest]:
    """(requests that decode, one whose prompt runs beside them in mixed chunks then a tail)."""
    num_decoding = max(1, config.max_concurrency - 1)
    prompt_len = min(config.mixed_prefill_chunk + 13, config.max_context - 4)
    decoding = [
        EngineRequest(f"warm-decode-{i}", _prompt(5 + i, 100 + i, vocab_size), ROTATION[i % len(ROTATION)],
                      max_new_tokens=-(-prompt_len // config.mixed_prefill_chunk) + 4)
        for i in range(num_decoding)
    ]
    joining = EngineRequest("warm-joining", _prompt(prompt_len, 200, vocab_size), GREEDY, max_new_tokens=2)
    return decoding, joining


def resumed_requests(name: str, prompt: list[int], resume_at: int, sampling: SamplingParams,
                     hints: list[CaptureHint]) -> tuple[EngineRequest, EngineRequest]:
    """A request for prompt[:resume_at], whose endpoint checkpoint the second, for the whole prompt
    (with `hints`), then resumes from: run one after the other, the second computes only the rest."""
    head = EngineRequest(f"{name}-head", prompt[:resume_at], GREEDY, max_new_tokens=1)
    return head, EngineRequest(name, prompt, sampling, max_new_tokens=1, capture_hints=hints)


def tail_requests(config, tail: int, vocab_size: int) -> tuple[EngineRequest, EngineRequest]:
    """A prompt whose last `tail` tokens are a step's only query rows, over cached context."""
    length = min(67 + tail, config.max_context - 2)
    return resumed_requests(f"warm-tail-{tail}", _prompt(length, 400 + tail, vocab_size), length - tail, GREEDY, [])


def warm_up_plan(config, vocab_size: int) -> str:
    """What the full warm-up runs, as text: the engine settings that choose kernels (the KV pool's
    size only through the step shapes) and every phase's step shapes."""
    decoding, joining = mixed_step_requests(config, vocab_size)
    shapes = {
        "worst": [len(r.prompt_token_ids) for r in worst_step_requests(config, vocab_size)],
        "ladder": prompt_ladder(config),
        "tails": TAIL_LENGTHS if config.prefix_reuse else (),
        "mixed": (len(decoding), len(joining.prompt_token_ids)),
    }
    settings = replace(config, kv_capacity=None, host_state_slots=None, host_kv_mib=None, log_stats_interval_ms=0)
    return f"{settings!r} {shapes!r}"


def run_warm_up(core, full: bool = True) -> WarmUpReport:
    """Run every phase to the end on `core` (an idle EngineCore), or with full=False the short
    warm-up (module docstring); restores its pools."""
    config = core.config
    vocab_size = core.tokenizer.vocab_size
    baseline = core.pool_accounting()
    started = time.perf_counter()
    worst = worst_step_requests(config, vocab_size)
    worst_tokens = sum(len(r.prompt_token_ids) for r in worst)
    if full:
        log.info(
            "warming up: compiling and autotuning kernels for %d-token steps, mixed steps and decode batches up to %d",
            worst_tokens, config.max_concurrency,
        )
    else:
        log.info("warming up (short: this configuration's kernels are in the kernel cache from an earlier start)")
    # The grammar compiler's tables build on their thread while the steps below run.
    core.grammars.compile(WARM_UP_GRAMMAR)
    num_steps = _run(core, [(0, worst)])
    marks = [("worst", time.perf_counter())]  # each phase's end, for the debug line below
    for i, length in enumerate(prompt_ladder(config) if full else ()):
        prompt, sampling = _prompt(length, 300 + length, vocab_size), ROTATION[i % len(ROTATION)]
        name = f"warm-prompt-{length}"
        if not config.prefix_reuse:
            num_steps += _run(core, [(0, [EngineRequest(name, prompt, sampling, max_new_tokens=1)])])
            continue
        # Resumed a third of the way in, as a conversation's turn is, with a checkpoint inside its step.
        hints = [CaptureHint(2 * length // 3, ReusePath.PRIVATE_TURN_CLOSURE)]
        for request in resumed_requests(name, prompt, length // 3, sampling, hints):
            num_steps += _run(core, [(0, [request])])
    marks.append(("ladder", time.perf_counter()))
    for tail in TAIL_LENGTHS if config.prefix_reuse and full else ():
        for request in tail_requests(config, tail, vocab_size):  # alone: its own query block
            num_steps += _run(core, [(0, [request])])
    marks.append(("tails", time.perf_counter()))
    decoding, joining = mixed_step_requests(config, vocab_size)
    if len(decoding) + 1 <= config.max_concurrency:
        num_steps += _run(core, [(0, decoding), (2, [joining])])  # joins once the others decode
    else:
        num_steps += _run(core, [(0, decoding)])
    marks.append(("mixed", time.perf_counter()))
    constrained = EngineRequest("warm-constrained", _prompt(9, 500, vocab_size), SAMPLED, max_new_tokens=3,
                                constraint=WARM_UP_GRAMMAR, top_logprobs=2)
    num_steps += _run(core, [(0, [constrained])])
    marks.append(("constrained", time.perf_counter()))
    log.debug("warm-up phases: %s", ", ".join(
        f"{name} {end - previous:.2f} s" for (name, end), previous in zip(marks, [started] + [m[1] for m in marks])
    ))  # fmt: skip
    core.scheduler.cache.reset()
    core.reset_stats()
    after = core.pool_accounting()
    if after != baseline:
        raise RuntimeError(f"warm-up left the pools changed: {baseline} -> {after}")
    report = WarmUpReport(time.perf_counter() - started, num_steps, worst_tokens)
    log.info("warm-up done in %.1fs (%d steps)", report.seconds, report.num_steps)
    return report


def _run(core, arrivals: list[tuple[int, list[EngineRequest]]]) -> int:
    """Add each group after the given number of steps, step until idle; -> steps taken."""
    pending = sorted(arrivals, key=lambda a: a[0])
    for step in range(MAX_WARM_UP_STEPS):
        while pending and pending[0][0] <= step:
            for request in pending.pop(0)[1]:
                for out in core.add_request(request):
                    if out.error is not None:
                        raise RuntimeError(f"warm-up request {request.request_id} refused: {out.error.message}")
        if not pending and not core.has_work:
            return step
        for out in core.step():
            if out.error is not None:
                raise RuntimeError(
                    f"warm-up request {out.request_id} failed: {out.error.message} (when the device ran out of"
                    " memory, the configuration does not fit: lower --kv-capacity, --prefill-chunk or --max-concurrency)"
                )
    raise RuntimeError(f"warm-up did not finish in {MAX_WARM_UP_STEPS} steps")
