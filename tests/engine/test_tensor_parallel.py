"""--tensor-parallel N through the real engine: rank 0 in this process, N - 1 follower processes over
gloo, each loading its shard from the same checkpoint. Greedy decoding equals one process token
for token (batched arrivals, decode overlap's chained rounds, a continuation reusing a
checkpoint), a constrained sampled request's deferred rounds too, and a follower that dies fails
the engine naming its rank.

The tiny models are wider than the other tests' (4 query heads over 2 KV heads, 4 key and 8 value
heads in the Gated DeltaNet) so that 4 ranks split every dimension, and 4 ranks replicate each
KV head on two of them.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import time
from pathlib import Path

import pytest
import transformers as tf

from ninfer.config import ConfigValueError, EngineConfig, EngineSpec
from ninfer.contract.output import ErrorCode, FinishReason
from ninfer.contract.request import EngineRequest
from ninfer.contract.sampling import SamplingParams
from ninfer.engine.builder import build_engine_core
from ninfer.engine.core import EngineCore
from ninfer.frontend.answer_format import AnswerFormat, JsonAnswer
from tests.engine.test_engine_generation import COMMON, GDN_INIT, HYBRID, MOE, PROMPTS, greedy, run_engine
from tests.models.helpers import randomize_
from tests.unit.conftest import make_byte_tokenizer

# Each case starts follower processes (a few seconds each on 2 CPUs; 4 ranks about 12 s).
pytestmark = pytest.mark.slow

BYTE_EOS = 256
# The generation tests' tiny models with twice the linear-attention heads, so 4 ranks split them.
HYBRID = dict(HYBRID, linear_num_key_heads=4, linear_num_value_heads=8)
ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}

ARCHITECTURES = {
    "qwen3_5": lambda: tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**HYBRID, intermediate_size=128, rope_parameters=ROPE)),
    "qwen3_5_moe": lambda: tf.Qwen3_5MoeForCausalLM(tf.Qwen3_5MoeTextConfig(**HYBRID, **MOE, rope_parameters=ROPE)),
    "qwen3_next": lambda: tf.Qwen3NextForCausalLM(
        tf.Qwen3NextConfig(**HYBRID, **MOE, intermediate_size=128, rope_parameters=ROPE, norm_topk_prob=True)
    ),
    # Biases on q/k/v, o_proj and the MLP: rank 0 alone adds the row-parallel layers' biases.
    "llama": lambda: tf.LlamaForCausalLM(
        tf.LlamaConfig(**COMMON, num_hidden_layers=2, intermediate_size=128, attention_bias=True, mlp_bias=True)
    ),
}
CONFIG = dict(max_concurrency=3, prefill_chunk=16, max_context=256, log_stats_interval_ms=0)


def write_artifact(arch: str, directory: Path) -> str:
    """A tiny random checkpoint of `arch` with the byte tokenizer, as an HF directory."""
    hf = randomize_(ARCHITECTURES[arch]().eval(), seed=7, overrides=GDN_INIT)
    hf.save_pretrained(directory)
    make_byte_tokenizer().backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    return str(directory)


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tensor-parallel")
    return {arch: write_artifact(arch, root / arch) for arch in ARCHITECTURES}


def build(artifact: str, tensor_parallel: int, quantize: str | None = None, **overrides) -> EngineCore:
    engine = EngineConfig(**{**CONFIG, **overrides}, tensor_parallel=tensor_parallel)
    return build_engine_core(EngineSpec(artifact, engine, dtype="float32", quantize=quantize))


def scenario(core: EngineCore) -> dict[str, list[int]]:
    """Staggered arrivals over small prefill chunks, then a continuation of the first request that
    resumes from its endpoint checkpoint: -> tokens by request."""
    got = run_engine(core, {0: [greedy("a", PROMPTS[0], 12)], 3: [greedy("b", PROMPTS[1], 12)],
                            5: [greedy("c", PROMPTS[2], 12)]})  # fmt: skip
    tokens = {rid: toks for rid, (toks, _) in got.items()}
    follow = PROMPTS[0] + tokens["a"] + [ord(c) for c in " and then?"]
    (toks, final), = run_engine(core, {0: [greedy("d", follow, 10)]}).values()
    assert final.cached_tokens > 0  # resumed from a's checkpoint on every rank
    tokens["d"] = toks
    accounting = core.pool_accounting()
    assert accounting["running"] == 0 and accounting["waiting"] == 0
    return tokens


@functools.cache
def single_process(artifact: str) -> dict[str, list[int]]:
    core = build(artifact, 1, decode_overlap=True)
    assert core.followers is None
    return scenario(core)


@pytest.mark.parametrize(
    "arch, tensor_parallel",
    [("qwen3_5", 2), ("qwen3_5_moe", 2), ("qwen3_5_moe", 4), ("qwen3_next", 2), ("qwen3_next", 4),
     ("llama", 2)],
)  # fmt: skip
def test_greedy_decoding_equals_one_process(artifacts, arch, tensor_parallel):
    expected = single_process(artifacts[arch])
    # Decode overlap forced on (off by default on the CPU): chained rounds read the ids the ranks agreed on.
    core = build(artifacts[arch], tensor_parallel, decode_overlap=True)
    try:
        assert core.decode_overlap and len(core.followers.pids) == tensor_parallel - 1
        assert core.runner.model.config.num_attention_heads == 4 // tensor_parallel
        assert scenario(core) == expected
        described = core.describe()["tensor_parallel"]
        assert described["size"] == tensor_parallel and len(described["rank_memory"]) == tensor_parallel
        weights = {ledger["weights"] for ledger in described["rank_memory"]}
        assert len(weights) == 1  # every rank holds an equal shard (and the replicated rest)
    finally:
        core.close()
    assert not any(_alive(pid) for pid in described["follower_pids"])


def test_constrained_sampled_rounds_run_ahead_on_every_rank(artifacts):
    """A seeded, sampled request under a JSON grammar with decode overlap: its rounds are computed
    ahead and sampled once their masks are known (SampleDeferred on the followers)."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    request = EngineRequest(
        "j", list(b"Answer in JSON: "), SamplingParams(temperature=1.0, seed=5), max_new_tokens=24,
        stop_token_ids=[BYTE_EOS], constraint=AnswerFormat(json=JsonAnswer(schema, "response_format")).constraint(None),
    )  # fmt: skip
    cores = [build(artifacts["qwen3_5"], size, decode_overlap=True) for size in (1, 2)]
    try:
        deferred = []
        sample_deferred = cores[1].runner.sample_deferred
        cores[1].runner.sample_deferred = lambda *args: deferred.append(args) or sample_deferred(*args)
        runs = [run_engine(core, {0: [request]})["j"] for core in cores]
    finally:
        cores[1].close()
    (one, _), (two, final) = runs
    assert two == one and final.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
    assert deferred  # rounds ran ahead and were sampled late on both ranks


def test_a_dead_follower_fails_the_engine_naming_its_rank(artifacts):
    core = build(artifacts["qwen3_5"], 2)
    try:
        core.add_request(greedy("a", PROMPTS[1], 50))
        core.step()  # the first prompt chunk
        follower = core.followers.pids[0]
        os.kill(follower, signal.SIGKILL)
        outputs = core.step()  # the next step's all-reduce meets a closed socket
        deadline = time.monotonic() + 10
        while core.failed is None and time.monotonic() < deadline:
            outputs += core.check_ranks()
            time.sleep(0.05)
        assert core.failed == f"tensor-parallel rank 1 (pid {follower}) was killed by SIGKILL"
        (ended,) = [out for out in outputs if out.request_id == "a"]
        assert ended.finish_reason is FinishReason.ERROR and ended.error.code is ErrorCode.ENGINE_FAILURE
        assert core.add_request(greedy("b", PROMPTS[0], 4))[0].error.code is ErrorCode.ENGINE_FAILURE
    finally:
        core.close()


def test_an_idle_engine_notices_a_dead_follower(artifacts):
    core = build(artifacts["qwen3_5"], 2)
    try:
        assert core.check_ranks() == [] and core.seconds_to_rank_check is not None
        os.kill(core.followers.pids[0], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while core.failed is None and time.monotonic() < deadline:
            core.check_ranks()
            time.sleep(0.05)
        assert core.failed is not None and "tensor-parallel rank 1" in core.failed
    finally:
        core.close()


def test_a_model_that_does_not_split_is_refused_before_any_rank_starts(artifacts):
    with pytest.raises(ConfigValueError, match=r"^--tensor-parallel 8: .* does not split over 8 ranks: its attention heads \(4\)"):
        build(artifacts["qwen3_5"], 8)


def test_one_rank_starts_no_process_group(artifacts):
    import torch.distributed as dist

    core = build(artifacts["llama"], 1)
    assert core.followers is None and core.runner.ranks is None and not dist.is_initialized()
    assert "tensor_parallel" not in core.describe()


def _alive(pid: int) -> bool:
    try:
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
