"""`ninfer-serve` on the GPU as users start it: its own process tree (the API process starts the engine
process by name, which starts CUDA itself), ready after the warm-up, answering the OpenAI SDK
streamed and not, with the engine on the GPU."""

from __future__ import annotations

import openai
import pytest
import torch

from ninfer.testing.tiny_artifacts import make_tiny_qwen3_5
from tests.net import start_ninfer_serve

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

MESSAGES = [{"role": "user", "content": "Count from one to five."}]


def test_ninfer_serve_starts_on_the_gpu_and_answers(tmp_path):
    artifact = str(make_tiny_qwen3_5(tmp_path, mtp=True))
    process, base = start_ninfer_serve(artifact, "--spec", "mtp", "--draft-tokens", "2", "--model-id", "tiny", ready_within_s=300)
    try:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
        reply = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=16, temperature=0)
        assert reply.choices[0].finish_reason in ("stop", "length") and reply.usage.completion_tokens > 0
        stream = client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=16, temperature=0, stream=True, stream_options={"include_usage": True}
        )
        chunks = list(stream)
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed == reply.choices[0].message.content  # greedy: the same answer
        assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens
    finally:
        process.terminate()
        process.wait(timeout=60)
    assert "(qwen3_5_text, bfloat16) on cuda:0" in process.stderr.read()
