"""Shared by the speculative decoding server tests: the plain server's greedy continuations an
oracle drafter proposes, the oracle server's engine, and a Chat exchange reduced to what must
agree with the plain server's.
"""

from __future__ import annotations

import dataclasses

import openai
import torch

from ninfer.artifact import open_artifact
from ninfer.config import ServeConfig
from ninfer.engine.core import EngineCore
from ninfer.server.served_model import ServedModel
from ninfer.testing.oracle_drafter import OracleDrafter
from tests.server.conftest import RunningServer


class ContinuationBook:
    """The plain server's greedy continuation of each prompt it decoded (keyed by prompt ids),
    read back by the oracle drafter through the request ids of the speculative server."""

    def __init__(self) -> None:
        self.prompts: dict[str, list[int]] = {}  # request id -> prompt ids (both servers)
        self.continuations: dict[tuple[int, ...], list[int]] = {}
        self.outputs: dict[str, list[int]] = {}  # plain request id -> committed ids
        self.last_plain: list[int] = []

    def watch_plain(self, core: EngineCore) -> None:
        add_request, step = core.add_request, core.step

        def add(request):
            self.prompts[request.request_id] = list(request.prompt_token_ids)
            if request.sampling.temperature == 0:
                self.outputs[request.request_id] = []
            return add_request(request)

        def run_step():
            outs = step()
            for out in outs:
                tokens = self.outputs.get(out.request_id)
                if tokens is None:
                    continue
                tokens.extend(out.new_token_ids)
                if out.finished:
                    key = tuple(self.prompts[out.request_id])
                    if len(tokens) > len(self.continuations.get(key, ())):
                        self.continuations[key] = tokens
                    self.last_plain = tokens
            return outs

        core.add_request, core.step = add, run_step

    def watch_spec(self, core: EngineCore) -> None:
        add_request = core.add_request

        def add(request):
            self.prompts[request.request_id] = list(request.prompt_token_ids)
            return add_request(request)

        core.add_request = add

    def get(self, request_id: str, default=()) -> list[int]:  # OracleDrafter's lookup
        prompt = self.prompts.get(request_id)
        if prompt is None:
            return list(default)
        return prompt + self.continuations.get(tuple(prompt), [])


def oracle_core(artifact: str, config: ServeConfig, book: ContinuationBook, num_drafts: int):
    """start_server's build_core for an oracle server: the float32 model with an OracleDrafter
    proposing the plain server's continuation of each prompt (every draft accepted)."""

    def build(serving: ServedModel) -> EngineCore:
        opened = open_artifact(artifact)
        model = opened.load_model(dtype=torch.float32, device="cpu")
        core = EngineCore(model, opened.tokenizer, config.engine, drafter=OracleDrafter(num_drafts, book))
        book.watch_spec(core)
        return core

    return build


def openai_client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)



@dataclasses.dataclass
class Result:
    text: str
    reasoning: str
    finish: tuple  # the protocol's finish fields
    usage: tuple[int, int, int]  # prompt tokens (cache included), completion tokens, cached tokens
    timings: dict | None = None  # Chat only
    request_id: str | None = None  # aggregate Chat: x-request-id, the engine's id of the request

    def key(self) -> tuple:
        return self.text, self.reasoning, self.finish, self.usage


def chat(server: RunningServer, prompt: str, stream: bool = False, client: openai.OpenAI | None = None,
         **kwargs) -> Result:
    """A Chat exchange; a stream's text is its deltas joined, its usage and timings the last chunk's.
    client: one to share between calls (a new client builds a TLS context: ~30 ms of CPU)."""
    client = client or openai_client(server)
    messages = kwargs.pop("messages", None) or [{"role": "user", "content": prompt}]
    request = dict(model=server.serving.model_id, messages=messages, **kwargs)
    if not stream:
        resp = client.chat.completions.create(**request)
        message = resp.choices[0].message
        usage = resp.usage
        return Result(message.content or "", (message.model_extra or {}).get("reasoning_content") or "",
                      (resp.choices[0].finish_reason,),
                      (usage.prompt_tokens, usage.completion_tokens, usage.prompt_tokens_details.cached_tokens),
                      resp.model_extra["timings"], resp._request_id)
    chunks = list(client.chat.completions.create(**request, stream=True, stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    last = chunks[-1]
    assert last.choices == [] and len(finishes) == 1
    # Terminal timings only on the last JSON chunk (no timings_per_token here).
    assert all("timings" not in (c.model_extra or {}) for c in chunks[:-1])
    usage = last.usage
    return Result("".join(d.content or "" for d in deltas),
                  "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas),
                  (finishes[0],),
                  (usage.prompt_tokens, usage.completion_tokens, usage.prompt_tokens_details.cached_tokens),
                  last.model_extra["timings"])
