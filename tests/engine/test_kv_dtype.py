"""--kv-dtype in the engine: pools sized and accounted in each format's bytes, a cached prefix
read from quantized pages gives what recomputing it gives, pages spill to the host tier and come
back byte for byte, a start-up refusal names the option, and the server reports the format."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
import torch

from ninfer.artifact import default_model_path
from ninfer.artifact.packer import pack
from ninfer.config import ConfigValueError, EngineConfig
from ninfer.contract.request import EngineRequest
from ninfer.contract.sampling import SamplingParams
from ninfer.engine.builder import EngineSpec, build_engine_core
from ninfer.engine.cache.host_kv import HostKV
from ninfer.models.kv_cache import KVCache, kv_bytes_per_token
from ninfer.testing.tiny_artifacts import make_tiny_qwen3_5
from tests.server.conftest import serve_config, start_server
from tests.server.test_request_log import SCHEMA

PROMPT = list(range(2000, 2144))  # whole pages


@pytest.fixture(scope="module")
def default_container(tmp_path_factory) -> str:
    """The default model (head_dim 64, which every format holds) packed once: a container opens and
    loads in a fraction of a second, its GGUF in several (each test builds two engines)."""
    out = tmp_path_factory.mktemp("kv-dtype") / "default.ninfer"
    pack(default_model_path(), out, progress=False)
    return str(out)


def _engine(artifact: str, kv_dtype: str, no_reuse: bool = False, **overrides):
    config = EngineConfig(max_context=512, log_stats_interval_ms=0, kv_dtype=kv_dtype, prefix_reuse=not no_reuse,
                          **overrides)
    return build_engine_core(EngineSpec(artifact, config))


def _greedy(core, request_id: str, prompt: list[int], num_tokens: int) -> tuple[list[int], int]:
    core.add_request(EngineRequest(request_id, prompt, SamplingParams(temperature=0.0), max_new_tokens=num_tokens))
    tokens: list[int] = []
    cached = 0
    while core.has_work:
        for output in core.step():
            tokens.extend(output.new_token_ids)
            cached = max(cached, output.cached_tokens)
    return tokens, cached


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8", "nvfp4", "k8v4"])
def test_a_cached_prefix_in_quantized_pages_equals_recomputing_it(default_container: str, kv_dtype: str) -> None:
    """The recompute runs the same chunks (the prompt, then the rest): quantization rounds a value
    computed in another GEMM shape to another code now and then, and the coarse formats turn that
    into another greedy token, so only equal computations can be compared exactly."""
    core = _engine(default_container, kv_dtype)
    cache = core.runner.kv_cache
    assert cache.nbytes == core.memory_ledger["kv_pool"]
    spec = core.runner.model.cache_spec()
    assert cache.bytes_per_token == kv_bytes_per_token(spec.num_attention_layers, spec.num_kv_heads, spec.head_dim, 4, kv_dtype)
    first, _ = _greedy(core, "a", PROMPT, 1)
    extended = PROMPT + first + list(range(3000, 3020))
    reused, cached = _greedy(core, "b", extended, 8)
    assert cached == len(PROMPT)  # read back from the quantized pages
    recompute = _engine(default_container, kv_dtype, prefill_chunk=len(PROMPT), no_reuse=True)
    recomputed, cached_fresh = _greedy(recompute, "b", extended, 8)
    assert cached_fresh == 0 and reused == recomputed


def test_quantized_pages_spill_to_the_host_and_return_byte_for_byte() -> None:
    cache = KVCache.allocate(2, 6, 16, 2, 64, torch.float32, kv_dtype="k8v4")
    generator = torch.Generator().manual_seed(0)
    for store in (cache.k, cache.v):
        store.view(torch.uint8).copy_(torch.randint(0, 256, store.shape, dtype=torch.uint8, generator=generator))
    host = HostKV(cache, 4)
    assert HostKV.page_bytes(cache) == cache.page_bytes == 2 * 2 * 16 * (68 + 40)
    before_k, before_v = cache.k[:, [1, 4]].clone(), cache.v[:, [1, 4]].clone()
    host.spill((1, 4), (0, 3))
    cache.k.view(torch.uint8).zero_()
    cache.v.view(torch.uint8).zero_()
    host.restore((0, 3), (2, 5))
    assert torch.equal(cache.k[:, [2, 5]].view(torch.uint8), before_k.view(torch.uint8))
    assert torch.equal(cache.v[:, [2, 5]].view(torch.uint8), before_v.view(torch.uint8))


def test_the_option_names_are_the_cache_formats() -> None:
    from ninfer.config import KV_DTYPE_NAMES
    from ninfer.models.kv_cache import KV_DTYPES

    assert KV_DTYPE_NAMES == tuple(KV_DTYPES)


def test_a_head_dim_a_format_cannot_hold_is_refused_naming_the_option(tmp_path) -> None:
    tiny = make_tiny_qwen3_5(tmp_path)  # head_dim 32
    config = EngineConfig(max_context=128, log_stats_interval_ms=0, kv_dtype="nvfp4")
    with pytest.raises(ConfigValueError, match="--kv-dtype nvfp4: nvfp4 KV needs a head_dim that is a multiple of 64, not 32"):
        build_engine_core(EngineSpec(str(tiny), config))
    with pytest.raises(ConfigValueError, match="--kv-dtype must be one of bf16, int8, fp8, nvfp4, k8v4"):
        EngineConfig(kv_dtype="int4")
    core = build_engine_core(EngineSpec(str(tiny), EngineConfig(max_context=128, log_stats_interval_ms=0, kv_dtype="int8")))
    assert len(_greedy(core, "r", PROMPT[:40], 4)[0]) == 4


def test_the_server_serves_with_a_quantized_kv_and_logs_its_format(default_container: str, tmp_path) -> None:
    log = tmp_path / "requests.jsonl"
    server = start_server(serve_config(default_container, kv_dtype="k8v4", greedy=True,
                                      request_log_jsonl=str(log), default_max_tokens=8))
    try:
        assert httpx.get(server.base_url + "/health").status_code == 200
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello!"}])
        assert reply.usage.completion_tokens > 0
    finally:
        server.stop()
    events = [json.loads(line) for line in log.read_text().splitlines()]
    start = next(event for event in events if event["event"] == "server_start")
    jsonschema.validate(start, SCHEMA)
    assert start["capacities"]["kv_dtype"] == "k8v4"
