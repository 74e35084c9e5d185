"""RequestRecord: one generation request's measurement events (see request_events.py).

Created when the request enters preparation (after its body parsed: a schema or model
rejection is not a measurement request). Preparation ends in request_start or
request_rejected; a started request then ends in exactly one request_done or request_error,
whichever comes first (the guard makes later attempts no-ops). Shapes only: counts, flags,
sampler settings and timings — never prompt or output text, tool arguments or stop strings.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import msgspec

from ninfer.contract.output import EngineOutput, SpeculativeCounters
from ninfer.server.errors import APIError
from ninfer.server.request_events import RequestEvents

if TYPE_CHECKING:
    from ninfer.frontend.capabilities import TemplateCapabilities
    from ninfer.server.endpoint import ParsedRequest
    from ninfer.server.generation import Generation

log = logging.getLogger("ninfer.server")

SPECULATIVE_OFF = {
    "backend": None,
    "draft_window": None,
    "rounds": 0,
    "drafted_tokens": 0,
    "accepted_tokens": 0,
    "fallback_steps": 0,
    "accepted_per_position": [],
}


NO_MEDIA = {
    "items": 0,
    "acquisition_seconds": 0.0,
    "preprocess_wall_seconds": 0.0,
    "preprocess_work_seconds": 0.0,
    "cache_hits": 0,
    "cache_misses": 0,
    "single_flight_waits": 0,
    "payload_bytes": 0,
}


class RequestRecord:
    def __init__(self, events: RequestEvents, request_id: str, protocol: str, parsed: ParsedRequest):
        self.events = events
        self.request_id = request_id
        self.request_seq = events.next_seq()
        self.protocol = protocol
        self.started = time.monotonic()  # preparation begins: the engine stamps share this clock
        self.prepared_at: float | None = None
        self.parsed = parsed
        self.shape = _shape(parsed)
        self.media_items = len(parsed.conversation.media_parts)
        # request_start's resolved configuration, repeated by request_error (None until started).
        self.configuration: dict[str, Any] | None = None
        self.finished = False

    def _emit(self, event: str, fields: dict[str, Any]) -> None:
        self.events.emit(event, {"request_id": self.request_id, "request_seq": self.request_seq,
                                 "protocol": self.protocol, **fields})

    def rejected(self, error: APIError) -> None:
        """Preparation failed (capacity, prompt rendering, context ceiling): no start follows."""
        if self.finished:
            return
        self.finished = True
        # Status and code only: a client's message may quote its own input.
        log.info("request %s rejected (%s): %d %s%s · %.2fs", self.request_id, self.protocol, error.status,
                 error.code or error.type, f" ({error.param})" if error.param else "", time.monotonic() - self.started)
        self._emit("request_rejected", {
            "phase": "prepare",
            **self.shape,
            "resolved_reasoning_effort": None,
            "media_items": self.media_items,
            **_error_fields(error),
        })

    def start(self, generation: Generation) -> None:
        self.prepared_at = time.monotonic()
        sampling = generation.sampling
        prepared = generation.prepared
        budget = generation.engine_request.thinking_budget
        self.configuration = {
            **self.shape,
            "prompt_tokens": generation.prompt_tokens,
            "max_output_tokens": generation.max_tokens,
            "sampler": {
                "temperature": sampling.temperature,
                "top_p": sampling.top_p,
                "top_k": sampling.top_k,
                "min_p": sampling.min_p,
                "presence_penalty": sampling.presence_penalty,
                "frequency_penalty": sampling.frequency_penalty,
                "seed": sampling.seed,  # drawn before the request reaches the engine: the one it uses
            },
            "thinking": prepared.thinking,
            "enable_thinking": prepared.enable_thinking,
            "preserve_thinking": prepared.preserve_thinking,
            "thinking_budget": budget.max_thinking_tokens if budget is not None else None,
            "resolved_reasoning_effort": resolved_effort(
                prepared.thinking, self.parsed.conversation.reasoning_effort, generation.serving.capabilities
            ),
            "capture_hints": len(generation.engine_request.capture_hints),
            "responses_semantic_change": self.parsed.semantic_change(prepared),
        }
        self._emit("request_start", {
            **self.configuration,
            "media": {**NO_MEDIA, **prepared.media_stats},
            "tokenizer": {"encode_seconds": prepared.tokenizer_seconds, "encode_calls": prepared.tokenizer_calls},
            "structured_output": answer.kind if (answer := generation.options.answer) is not None else None,
            "top_logprobs": generation.options.top_logprobs,
            "prepare_seconds": self.prepared_at - self.started,
        })

    def done(self, generation: Generation, out: EngineOutput, inter_token_seconds: list[float]) -> None:
        if self.finished:
            return
        self.finished = True
        now = time.monotonic()
        stamps = out.timings
        first, last = (stamps.first_token, stamps.last_token) if stamps is not None else (None, None)
        admitted = stamps.admitted if stamps is not None else None
        prompt_done = stamps.prompt_done if stamps is not None else None
        prepared_at = self.prepared_at if self.prepared_at is not None else self.started
        diagnostics = generation.decoder.diagnostics
        budget = generation.engine_request.thinking_budget
        self._emit("request_done", {
            "finish_reason": out.finish_reason.value if out.finish_reason else None,
            "stop_kind": _stop_kind(out.stop_reason),
            "prompt_tokens": generation.prompt_tokens,
            "completion_tokens": generation.completion_tokens,
            "reasoning_tokens": generation.decoder.reasoning_tokens,
            "prefix_cache_hit_tokens": generation.cached_tokens,
            "computed_prefill_tokens": generation.prompt_tokens - generation.cached_tokens,
            "prefix_reuse_path": str(generation.reuse_path.value),
            "result": {"tool_call_parse": diagnostics.to_dict()},
            "thinking_budget": {
                "max_thinking_tokens": budget.max_thinking_tokens if budget is not None else None,
                "forced_close_tokens": generation.forced_tokens,
            },
            "materialization": msgspec.to_builtins(out.materialization) if out.materialization is not None else None,
            "timings_seconds": {
                "prepare": prepared_at - self.started,
                "queue_wait": (admitted - prepared_at) if admitted is not None else None,
                "ttft": (first - self.started) if first is not None else None,
                "vision": stamps.vision_seconds if stamps is not None else 0.0,
                "prefill": (prompt_done - admitted) if admitted is not None and prompt_done is not None else None,
                "decode": (last - first) if first is not None and last is not None else None,
                "total": now - self.started,
            },
            "inter_token_seconds": inter_token_seconds,
            "engine_timing": msgspec.to_builtins(out.engine_timing) if out.engine_timing is not None else None,
            "speculative": _speculative(out.speculative),
        })

    def error(self, phase: str, error: APIError | None = None, message: str | None = None) -> None:
        """A started request ended without an outcome: admission refused, the engine failed, or
        the client went away (phase "cancelled"). It repeats request_start's configuration, which
        is None when the client went away before preparation resolved it."""
        if self.finished:
            return
        self.finished = True
        elapsed = time.monotonic() - self.started
        if phase == "cancelled":
            log.info("request %s cancelled (%s): the client went away · %.2fs", self.request_id, self.protocol, elapsed)
        else:
            status = f"{error.status} {error.code or error.type}" if error is not None else "no status"
            log.warning("request %s failed in %s (%s): %s · %.2fs", self.request_id, phase, self.protocol, status, elapsed)
        fields: dict[str, Any] = {"phase": phase, "elapsed_seconds": elapsed}
        fields.update(_error_fields(error) if error is not None else
                      {"status": None, "type": None, "code": None, "param": None, "message": message})
        fields["configuration"] = self.configuration
        self._emit("request_error", fields)


def _shape(parsed: ParsedRequest) -> dict[str, Any]:
    conversation = parsed.conversation
    options = parsed.options
    return {
        "stream": parsed.stream,
        "messages": len(conversation.messages),
        "tools": len(conversation.tools),
        "callable_tools": len(options.tools or {}),
        "requested_max_tokens": options.max_tokens,
        "stop_strings": len(options.stop),
        "requested_reasoning_effort": parsed.requested_reasoning_effort,
    }


def resolved_effort(thinking: bool, template_effort: str | None, capabilities: TemplateCapabilities) -> str | None:
    """The effort tier served: "none" without thinking; else the tier rendered (the client's, or
    the tier it was mapped to), or the template's default tier when none was given; None when
    the template has no tiers (or no single default one)."""
    if not thinking:
        return "none"
    if template_effort is not None:
        return template_effort
    return capabilities.default_effort if capabilities.effort_tiers else None


def _stop_kind(stop_reason: int | str | None) -> str | None:
    """Which kind of stop ended it; a stop string itself is the client's text and stays out."""
    if stop_reason is None:
        return None
    return "token" if isinstance(stop_reason, int) else "string"


def _speculative(counters: SpeculativeCounters | None) -> dict[str, Any]:
    """The request's speculative counters; the off shape when the server runs without --spec."""
    if counters is None:
        return {**SPECULATIVE_OFF, "accepted_per_position": []}
    return msgspec.to_builtins(counters)


def _error_fields(error: APIError) -> dict[str, Any]:
    return {"status": error.status, "type": error.type, "code": error.code, "param": error.param,
            "message": error.message}
