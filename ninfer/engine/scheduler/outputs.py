"""EngineOutputs built from a sequence's unsent delta, terminal error outputs, and the Outbox
that holds them until the engine sends them."""

from __future__ import annotations

from ninfer.contract.output import EngineError, EngineOutput, ErrorCode, FinishReason
from ninfer.contract.request import EngineRequest
from ninfer.engine.sequence import Sequence


def delta_output(seq: Sequence) -> EngineOutput:
    """The tokens, text and progress not yet sent; clears them from the sequence."""
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
        logprobs=seq.unsent_logprobs if seq.request.top_logprobs is not None else None,
    )
    seq.unsent_token_ids, seq.unsent_text, seq.unsent_forced = [], "", 0
    seq.unsent_progress = None
    seq.unsent_logprobs = []
    return out


def final_output(seq: Sequence, reason: FinishReason, stop_reason: int | str | None = None) -> EngineOutput:
    out = delta_output(seq)
    out.finish_reason = reason
    out.stop_reason = stop_reason
    timing = seq.engine_timing
    if seq.timings.admitted is not None:
        timing.queue_wait_seconds = seq.timings.admitted - seq.timings.arrived
    host = timing.host_exposed_seconds
    host.total = (host.engine_boundary + host.program_submit + host.program_post + host.engine_commit_output
                  + host.engine_maintenance)
    out.engine_timing = timing
    out.materialization = seq.materialization
    out.speculative = seq.speculative
    return out


def error_output(
    request: EngineRequest,
    code: ErrorCode,
    message: str,
    prompt_tokens: int | None = None,
    max_context: int | None = None,
) -> EngineOutput:
    return EngineOutput(
        request_id=request.request_id,
        finish_reason=FinishReason.ERROR,
        prompt_tokens=len(request.prompt_token_ids),
        error=EngineError(code, message, prompt_tokens=prompt_tokens, max_context=max_context),
    )


class Outbox:
    """Outputs ready to send: admission progress, finals and errors as they happen, then each
    running request's unsent delta when collected."""

    def __init__(self) -> None:
        self._ready: list[EngineOutput] = []

    def add(self, out: EngineOutput) -> None:
        self._ready.append(out)

    def extend(self, outs: list[EngineOutput]) -> None:
        self._ready.extend(outs)

    def collect(self, running: list[Sequence]) -> list[EngineOutput]:
        """Everything ready, then the deltas of running requests with tokens or progress unsent."""
        outputs, self._ready = self._ready, []
        for seq in running:
            if seq.unsent_token_ids or seq.unsent_progress is not None:
                outputs.append(delta_output(seq))
        return outputs

    def take_final(self, request_id: str) -> EngineOutput | None:
        """The final output of request_id, taken out of the outbox (an abort answers with it)."""
        for i, out in enumerate(self._ready):
            if out.request_id == request_id and out.finished:
                return self._ready.pop(i)
        return None
