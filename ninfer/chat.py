"""`ninfer chat`: one conversation turn through the same prompt, engine and decoder path as the server."""

from __future__ import annotations

import argparse
import sys
import time

from ninfer.config import EngineConfig, ServeConfig
from ninfer.contract.sampling import SamplingOverrides
from ninfer.frontend.conversation import Conversation, Message, TextPart
from ninfer.frontend.output_decoder import ContentDelta, ReasoningDelta
from ninfer.log import setup_logging
from ninfer.server.api_process import build_serving
from ninfer.server.generation import Generation, GenerationOptions

_DIM, _RESET = "\x1b[2m", "\x1b[0m"


async def run_chat(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    engine = EngineConfig(max_context=8192, log_stats_interval_ms=0, tensor_parallel=args.tensor_parallel)
    config = ServeConfig(
        engine=engine,
        sampling=SamplingOverrides(temperature=args.temperature, seed=args.seed),
        artifact=args.model,
        greedy=args.greedy,
        no_thinking=args.no_thinking,
        dtype=args.dtype,
        device_index=args.device,
        engine_process=False,
        log_level=args.log_level,
    )
    started = time.perf_counter()
    # Loading takes seconds even for the small default model: say so (stderr keeps stdout the answer).
    _status(f"loading {args.model or 'the default model (SmolLM2-135M-Instruct)'} ...")
    serving = build_serving(config)
    await serving.engine.start()
    _status(f"{serving.model_id} ready in {time.perf_counter() - started:.1f}s")
    try:
        messages = [Message("system", [TextPart(args.system)])] if args.system else []
        messages.append(Message("user", [TextPart(args.prompt)]))
        prepared = serving.prompt_builder.build(Conversation(messages))
        with serving.engine.reserve() as ticket:
            generation = Generation(serving, "chat", prepared, GenerationOptions(max_tokens=args.max_tokens), ticket)
            await generation.start()
            color = sys.stdout.isatty()
            async for event in generation.events():
                if isinstance(event, ReasoningDelta):
                    sys.stdout.write(f"{_DIM}{event.text}{_RESET}" if color else event.text)
                elif isinstance(event, ContentDelta):
                    sys.stdout.write(event.text)
                sys.stdout.flush()
            sys.stdout.write("\n")
    finally:
        await serving.engine.shutdown()
    return 0


def _status(line: str) -> None:
    sys.stderr.write(f"{_DIM}{line}{_RESET}\n" if sys.stderr.isatty() else f"{line}\n")
    sys.stderr.flush()
