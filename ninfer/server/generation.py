"""Generation: one request's life from prepared prompt to final usage, for every endpoint.

It sends the EngineRequest, waits for admission (so preparation errors become ordinary
HTTP errors before any stream starts), feeds committed output through the output
decoder, and keeps the counters that usage and llama.cpp-style timings report.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from ninfer.contract.constraint import OutputConstraint
from ninfer.contract.output import EngineOutput, ErrorCode, FinishReason, PromptProgress
from ninfer.contract.request import CaptureHint, EngineRequest
from ninfer.contract.reuse_path import ReusePath
from ninfer.contract.sampling import SamplingOverrides, fresh_seed
from ninfer.frontend.answer_format import AnswerFormat
from ninfer.frontend.output_decoder import OutputDecoder
from ninfer.frontend.prompt_builder import PreparedPrompt
from ninfer.frontend.tool_call_parser import FallbackReason
from ninfer.server.answer_logprobs import AnswerLogprobs
from ninfer.server.engine_client import EngineUnavailable, Ticket
from ninfer.server.errors import APIError
from ninfer.server.served_model import ServedModel

if TYPE_CHECKING:
    from ninfer.server.request_record import RequestRecord
from ninfer.server.timings import Timings, compute_timings

# The largest integer the engine process receives (msgpack signed 64-bit).
MAX_WIRE_INT = 2**63 - 1

log = logging.getLogger("ninfer.server")
# A wait for admission shorter than this goes unnamed in the done line (the scheduler's own turn).
_NOTED_WAIT_SECONDS = 0.05


@dataclass
class GenerationOptions:
    max_tokens: int | None = None  # None: --default-max-tokens
    sampling: SamplingOverrides = field(default_factory=SamplingOverrides)
    stop: list[str] = field(default_factory=list)
    tools: dict[str, dict | None] | None = None  # callable tools for the decoder; None: calls stay text
    thinking_budget: int | None = None  # request-specific cap (Anthropic); None: the process default
    extra_capture_hints: list[CaptureHint] = field(default_factory=list)
    session_key: str | None = None
    endpoint_path: ReusePath = ReusePath.PRIVATE_ENDPOINT  # label of the checkpoints this request leaves
    answer: AnswerFormat | None = None  # structured outputs: the grammar the answer follows
    top_logprobs: int | None = None  # answer tokens' log probabilities with this many alternatives; None: none


@dataclass
class ProgressEvent:
    progress: PromptProgress


@dataclass
class FinishEvent:
    reason: FinishReason
    stop_reason: int | str | None


@dataclass
class Usage:
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    reasoning_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def engine_error_to_api(output: EngineOutput) -> APIError:
    error = output.error
    if error is None:
        return APIError(500, "the engine ended the request without a result", code="internal_error")
    if error.code is ErrorCode.CONTEXT_LENGTH_EXCEEDED:
        return APIError(400, error.message, code=error.code.value, param="messages")
    if error.code is ErrorCode.THINKING_BUDGET_CAPACITY:
        return APIError(400, error.message, code=error.code.value, param="max_tokens")
    if error.code is ErrorCode.QUEUE_TIMEOUT:
        return APIError(503, "the request waited longer than --pending-timeout-ms for admission", code=error.code.value)
    if error.code is ErrorCode.OVERLOADED:
        return APIError(429, error.message, code=error.code.value)
    if error.code is ErrorCode.INVALID_REQUEST:
        return APIError(400, error.message, code="invalid_prompt")
    if error.code is ErrorCode.ENGINE_FAILURE:
        # The engine process is being restarted: retrying shortly succeeds.
        return APIError(503, error.message, code="engine_unavailable")
    return APIError(500, error.message, code=error.code.value, type="server_error")


class Generation:
    def __init__(
        self,
        serving: ServedModel,
        request_id: str,
        prepared: PreparedPrompt,
        options: GenerationOptions,
        ticket: Ticket,
        record: RequestRecord | None = None,
        constraint: OutputConstraint | None = None,
    ):
        """constraint: options.answer compiled for this prompt (endpoint.compile_answer)."""
        self.serving = serving
        self.record = record  # its measurement events (request_done is emitted here)
        self.forced_tokens = 0  # committed without sampling (a thinking budget's close)
        self._inter_token_seconds: list[float] = []
        self._last_token_at: float | None = None
        self.request_id = request_id
        self.prepared = prepared
        self.options = options
        self.ticket = ticket
        config = serving.config
        sampling = serving.sampling_defaults.resolve(
            prepared.thinking, serving.process_sampling, options.sampling, greedy=config.greedy
        )
        # Drawn here rather than by the engine, so request_start logs the seed that reproduces the output.
        self.sampling = sampling if sampling.seed is not None else msgspec.structs.replace(sampling, seed=fresh_seed())
        self.max_tokens = config.default_max_tokens if options.max_tokens is None else options.max_tokens
        self.decoder = OutputDecoder(
            thinking=prepared.thinking,
            tools=options.tools,
            tolerant=config.tolerant_tool_calls,
            think_end_token_id=serving.think_end_token_id,
        )
        self.engine_request = EngineRequest(
            request_id=request_id,
            prompt_token_ids=prepared.token_ids,
            sampling=self.sampling,
            # Any limit past the context is clamped by the engine; past int64 it could not even be sent.
            max_new_tokens=min(self.max_tokens, MAX_WIRE_INT),
            stop_token_ids=serving.stop_token_ids,
            stop_strings=options.stop,
            thinking_budget=serving.thinking_budget(
                prepared.thinking, None if options.thinking_budget is None else min(options.thinking_budget, MAX_WIRE_INT)
            ),
            capture_hints=[*prepared.capture_hints, *options.extra_capture_hints],
            session_key=options.session_key,
            endpoint_path=options.endpoint_path,
            deadline=ticket.deadline,
            media=prepared.media,
            constraint=constraint,
            top_logprobs=options.top_logprobs,
        )
        self.logprobs = (
            AnswerLogprobs(serving.vocabulary, prepared.thinking, serving.think_end_token_id)
            if options.top_logprobs is not None else None
        )
        self.prompt_tokens = len(prepared.token_ids)
        self.cached_tokens = 0
        self.completion_tokens = 0
        self.reuse_path = ReusePath.ROOT
        self.last: EngineOutput | None = None
        self._stream: AsyncIterator[EngineOutput] | None = None
        self._first: EngineOutput | None = None

    @staticmethod
    def new_id(prefix: str) -> str:
        return f"{prefix}{uuid.uuid4().hex}"

    def check_fits(self) -> None:
        """Part of preparation: a prompt beyond the context ceiling never reaches the engine."""
        if self.prompt_tokens > self.serving.max_model_len:
            raise APIError(
                400,
                f"the prompt has {self.prompt_tokens} tokens; the context ceiling is {self.serving.max_model_len}",
                code="context_length_exceeded",
                param="messages",
            )

    async def start(self) -> None:
        """Send the request and wait for admission; engine preparation errors raise APIError."""
        self.check_fits()
        try:
            self._stream = self.serving.engine.generate(self.engine_request)
            first = await self._stream.__anext__()
        except EngineUnavailable as exc:
            # While the engine restarts, Retry-After says when it should be back: a client that
            # retried every second would spend its retries long before a large model has loaded.
            raise APIError(503, str(exc), code="engine_unavailable", retry_after_s=exc.retry_after_s) from exc
        if first.error is not None:
            await self.close()
            raise engine_error_to_api(first)
        self._first = first
        self._absorb(first)
        log.info(
            "request %s admitted: prompt %d tok (cache %d, %s), max %d%s",
            self.request_id,
            self.prompt_tokens,
            first.cached_tokens,
            first.reuse_path,
            self.max_tokens,
            ", thinking" if self.prepared.thinking else "",
        )

    async def events(self) -> AsyncIterator[object]:
        """Progress, decoder events (reasoning/content/tool calls), then one FinishEvent."""
        assert self._stream is not None, "start() first"
        pending = [self._first] if self._first is not None else []
        self._first = None
        try:
            while True:
                out = pending.pop() if pending else await self._stream.__anext__()
                if out is not self.last:
                    self._absorb(out)
                if out.error is not None:
                    raise engine_error_to_api(out)
                if out.progress is not None:
                    yield ProgressEvent(out.progress)
                if self.logprobs is not None and out.logprobs is not None:
                    stop_token = out.stop_reason if isinstance(out.stop_reason, int) else None
                    self.logprobs.add(out.new_token_ids, out.logprobs, stop_token)
                for event in self.decoder.feed(out.new_token_ids, out.text, out.forced_token_count):
                    yield event
                if out.finished:
                    for event in self.decoder.finish():
                        yield event
                    self._log_done(out)
                    if self.record is not None:
                        self.record.done(self, out, self._inter_token_seconds)
                    yield FinishEvent(out.finish_reason, out.stop_reason)
                    return
        finally:
            await self.close()

    async def close(self) -> None:
        if self._stream is not None:
            stream, self._stream = self._stream, None
            await stream.aclose()  # aborts the request in the engine if it is still running

    def _absorb(self, out: EngineOutput) -> None:
        if out.new_token_ids:
            now = time.monotonic()
            if self._last_token_at is not None:
                self._inter_token_seconds.append(now - self._last_token_at)
            self._last_token_at = now
        self.forced_tokens += out.forced_token_count
        self.last = out
        self.cached_tokens = out.cached_tokens
        self.completion_tokens = out.completion_tokens
        self.reuse_path = out.reuse_path

    def take_logprobs(self) -> list[dict] | None:
        """Answer-token log probabilities not yet sent (answer_logprobs.py); None when not asked."""
        return self.logprobs.take() if self.logprobs is not None else None

    @property
    def usage(self) -> Usage:
        return Usage(self.prompt_tokens, self.cached_tokens, self.completion_tokens, self.decoder.reasoning_tokens)

    def timings(self, terminal: bool = True) -> Timings:
        """The request's timings so far; draft_n and draft_n_accepted are terminal only. A running
        snapshot (timings_per_token) has no draft keys, even one sent with the text of the final
        output, which already carries the speculative counters."""
        stamps = self.last.timings if self.last is not None else None
        speculative = self.last.speculative if terminal and self.last is not None else None
        return compute_timings(stamps, self.prompt_tokens, self.cached_tokens, self.completion_tokens, speculative)

    def _log_done(self, out: EngineOutput) -> None:
        timings = self.timings()
        pct = 100.0 * self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        reason = out.finish_reason.value if out.finish_reason else "?"
        log.info(
            "request %s done: %s · prompt %d (cache %d, %.0f%%, %s) · completion %d · ttft %s · %.1f tok/s",
            self.request_id,
            reason,
            self.prompt_tokens,
            self.cached_tokens,
            pct,
            self.reuse_path.replace("_", " "),
            self.completion_tokens,
            self._ttft_text(out, timings.prompt_ms / 1000.0),
            timings.predicted_per_second,
        )
        fallback = self.decoder.diagnostics.fallback_reason
        if fallback is not FallbackReason.NONE:
            # Only the classification: never the generated markup.
            log.warning("request %s: tool-call markup returned as text (%s)", self.request_id, fallback.value)

    def _ttft_text(self, out: EngineOutput, prompt_seconds: float) -> str:
        """From the request's start to its first token, as the request log's ttft, with the wait
        for the engine's admission named when it took a share a reader should see (a step graph
        captured in an idle turn, a full engine); the prompt's own time without a record."""
        stamps = out.timings
        if self.record is None or stamps is None or stamps.first_token is None:
            return f"{prompt_seconds:.2f}s"
        ttft = stamps.first_token - self.record.started
        prepared = self.record.prepared_at if self.record.prepared_at is not None else self.record.started
        waited = stamps.admitted - prepared if stamps.admitted is not None else 0.0
        return f"{ttft:.2f}s (admitted after {waited:.2f}s)" if waited >= _NOTED_WAIT_SECONDS else f"{ttft:.2f}s"


async def race_disconnect(receive, awaitable):
    """Run `awaitable`, cancelling it if the HTTP client disconnects first."""
    task = asyncio.ensure_future(awaitable)

    async def watch() -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        try:
            await task
        except (asyncio.CancelledError, Exception):  # noqa: BLE001 - the client is gone
            pass
        raise ClientDisconnected()
    finally:
        watcher.cancel()


class ClientDisconnected(Exception):
    """The HTTP client went away; its request was cancelled in the engine."""
