"""The real engine (scheduler + runner + model) against transformers' greedy generate.

Every architecture family on a tiny random checkpoint (fp32): alone, batched with other
requests arriving at staggered steps under small prefill chunks, with prefix reuse
versus recompute, and through both client transports.
"""

from __future__ import annotations

import asyncio
import functools

import pytest
import torch
import transformers as tf

from ninfer.config import EngineConfig
from ninfer.contract.output import FinishReason
from ninfer.contract.request import CaptureHint, EngineRequest
from ninfer.contract.reuse_path import ReusePath
from ninfer.contract.sampling import SamplingParams
from ninfer.engine.core import EngineCore
from ninfer.engine.scheduler import StepKind
from ninfer.server.engine_client import InProcessEngineClient
from tests.models.helpers import load_ours, normal_init, randomize_, save_hf, uniform_init
from tests.unit.conftest import make_byte_tokenizer

VOCAB = 257  # the byte tokenizer's ids
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
HYBRID = dict(
    COMMON,
    num_hidden_layers=4,
    head_dim=16,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
GDN_INIT = {"A_log": uniform_init(0.01, 2.0, torch.log), "linear_attn.norm.weight": normal_init(1.0, 0.3)}


def _rope(partial: float = 1.0) -> dict:
    return {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": partial}


ARCHITECTURES = {
    "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**COMMON, num_hidden_layers=2, intermediate_size=128)),
    "qwen2": lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(**COMMON, num_hidden_layers=2, intermediate_size=128)),
    "qwen3": lambda: tf.Qwen3ForCausalLM(
        tf.Qwen3Config(**COMMON, num_hidden_layers=2, intermediate_size=128, head_dim=16)
    ),
    "qwen3_moe": lambda: tf.Qwen3MoeForCausalLM(
        tf.Qwen3MoeConfig(
            **COMMON, num_hidden_layers=2, intermediate_size=128, head_dim=16, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        )
    ),
    "qwen3_5": lambda: tf.Qwen3_5ForCausalLM(
        tf.Qwen3_5TextConfig(**HYBRID, intermediate_size=128, rope_parameters=_rope(0.25))
    ),
    "qwen3_5_moe": lambda: tf.Qwen3_5MoeForCausalLM(
        tf.Qwen3_5MoeTextConfig(**HYBRID, **MOE, rope_parameters=_rope(0.25))
    ),
    "qwen3_next": lambda: tf.Qwen3NextForCausalLM(
        tf.Qwen3NextConfig(**HYBRID, **MOE, intermediate_size=128, rope_parameters=_rope(0.25), norm_topk_prob=True)
    ),
}


@functools.cache
def _models(arch: str, tmp_root: str):
    hf = randomize_(ARCHITECTURES[arch]().eval(), seed=7, overrides=GDN_INIT)
    config, tensors = save_hf(hf, f"{tmp_root}/{arch}")
    return hf, load_ours(config, tensors)


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("engine-models"))


def hf_greedy(hf, prompt: list[int], max_new: int) -> list[int]:
    out = hf.generate(
        torch.tensor([prompt]), max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False,
        pad_token_id=0, eos_token_id=None,
    )
    return out[0, len(prompt) :].tolist()


def run_engine(core: EngineCore, arrivals: dict[int, list[EngineRequest]], max_steps: int = 5000) -> dict:
    """Feed requests at the given step numbers; collect token ids and the terminal output per request."""
    tokens: dict[str, list[int]] = {}
    finals = {}
    step = 0
    while step < max_steps:
        for request in arrivals.get(step, []):
            tokens[request.request_id] = []
            for out in core.add_request(request):
                finals[out.request_id] = out
        if not core.has_work and step > max(arrivals):
            break
        for out in core.step():
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                finals[out.request_id] = out
        step += 1
    return {rid: (tokens[rid], finals.get(rid)) for rid in tokens}


def greedy(request_id: str, prompt: list[int], max_new: int) -> EngineRequest:
    return EngineRequest(request_id, prompt, SamplingParams(temperature=0.0), max_new_tokens=max_new)


PROMPTS = [
    [ord(c) for c in "Hello there, engine! " * 3],
    [ord(c) for c in "A much longer prompt that spans several prefill chunks. " * 2],
    [ord(c) for c in "short"],
]


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_greedy_matches_transformers_alone_and_batched(arch, tmp_root):
    hf, ours = _models(arch, tmp_root)
    tokenizer = make_byte_tokenizer()
    expected = [hf_greedy(hf, p, 12) for p in PROMPTS]

    alone = EngineCore(ours, tokenizer, EngineConfig(max_concurrency=1, prefill_chunk=16, max_context=256))
    for i, prompt in enumerate(PROMPTS):
        got = run_engine(alone, {0: [greedy(f"r{i}", prompt, 12)]})
        assert got[f"r{i}"][0] == expected[i], f"{arch} alone, prompt {i}"

    # Batched with decode overlap forced on (off by default on the CPU): chained rounds too.
    batched = EngineCore(
        ours, tokenizer,
        EngineConfig(max_concurrency=3, prefill_chunk=7, max_context=256, prefix_reuse=False, decode_overlap=True),
    )
    assert not alone.decode_overlap and batched.decode_overlap
    got = run_engine(batched, {0: [greedy("a", PROMPTS[0], 12)], 3: [greedy("b", PROMPTS[1], 12)],
                               5: [greedy("c", PROMPTS[2], 12)]})
    for rid, want in zip("abc", expected):
        toks, final = got[rid]
        assert toks == want, f"{arch} batched {rid}"
        assert final.finish_reason is FinishReason.LENGTH and final.completion_tokens == 12
    acc = batched.pool_accounting()
    assert acc["kv_pages_used"] == 0 and acc["running"] == 0

    # A burst: several prompts' chunks in one forward, then prompt chunks beside decode rows.
    burst = EngineCore(
        ours, tokenizer,
        EngineConfig(
            max_concurrency=3, prefill_chunk=80, mixed_prefill_chunk=5, max_context=256, kv_capacity=512,
            prefix_reuse=False,
        ),
    )
    launched = []
    launch = burst.runner.launch
    burst.runner.launch = lambda step: launched.append(step) or launch(step)
    got = run_engine(burst, {0: [greedy(rid, p, 12) for rid, p in zip("abc", PROMPTS)]})
    for rid, want in zip("abc", expected):
        assert got[rid][0] == want, f"{arch} burst {rid}"
    assert [len(c.token_ids) for c in launched[0].chunks] == [63, 17]  # a's whole prompt and b's first 17
    assert any(s.kind is StepKind.MIXED for s in launched)
    assert burst.pool_accounting()["kv_pages_used"] == 0


@pytest.mark.parametrize("arch", ["llama", "qwen3_5", "qwen3_next"])
def test_prefix_reuse_equals_recompute(arch, tmp_root):
    hf, ours = _models(arch, tmp_root)
    tokenizer = make_byte_tokenizer()
    core = EngineCore(ours, tokenizer, EngineConfig(max_concurrency=2, prefill_chunk=16, max_context=256))
    first = run_engine(core, {0: [greedy("t1", PROMPTS[0], 8)]})["t1"][0]
    follow = PROMPTS[0] + first + [ord(c) for c in " and then?"]
    toks, final = run_engine(core, {0: [greedy("t2", follow, 10)]})["t2"]
    assert final.cached_tokens == len(PROMPTS[0]) + len(first) - 1
    assert final.reuse_path == "private_endpoint"
    assert toks == hf_greedy(hf, follow, 10)
    again, final = run_engine(core, {0: [greedy("t3", follow, 10)]})["t3"]  # exact full-prompt hit
    assert final.cached_tokens == len(follow) and again == toks


@pytest.mark.parametrize(
    "arch, path",
    [
        ("qwen3_5", ReusePath.PRIVATE_TURN_CLOSURE),
        ("qwen3_next", ReusePath.PRIVATE_TURN_CLOSURE),
        ("qwen3_5", ReusePath.PRIVATE_LONG_ANCHOR),
        ("qwen3_5", ReusePath.SHARED_STABLE_PREFIX),
    ],
)  # hybrids: reuse only at frontiers
def test_a_checkpoint_restored_from_the_host_tier_equals_recompute(arch, path, tmp_root):
    # One lane and the default checkpoint slots: the checkpoint inside the prompt is pushed out
    # of the device by the prompt-end capture and spills to pinned host memory; the next turn,
    # which diverges after it, restores it. Every capture path takes the same route.
    hf, ours = _models(arch, tmp_root)
    core = EngineCore(ours, make_byte_tokenizer(), EngineConfig(max_concurrency=1, prefill_chunk=16, max_context=768))
    baseline = core.pool_accounting()
    opener = [ord(c) for c in "<assistant>"]
    prefix, rest = PROMPTS[1], [ord(c) for c in "<think>"]
    if path is ReusePath.PRIVATE_LONG_ANCHOR:
        # Anchors sit in long prompts, away from the other frontiers (or they are not worth a step).
        prefix, rest = PROMPTS[1] * 3, rest + [ord(c) for c in " Let me think about that at length." * 9]
    frontier = len(prefix)
    turn1 = EngineRequest(
        "t1", prefix + opener + rest, SamplingParams(temperature=0.0),
        max_new_tokens=6, capture_hints=[CaptureHint(frontier, path)],
    )
    run_engine(core, {0: [turn1]})
    assert core.pool_accounting()["host_state_slots_free"] == baseline["host_state_slots_free"] - 1
    follow = prefix + opener + [ord(c) for c in "the answer</assistant> and then?"]
    toks, final = run_engine(core, {0: [greedy("t2", follow, 10)]})["t2"]
    assert final.cached_tokens == frontier and final.reuse_path == path
    assert toks == hf_greedy(hf, follow, 10)
    core.cache.clear()
    assert core.pool_accounting() == baseline


@pytest.mark.parametrize("arch", ["llama", "qwen3_5"])
def test_kv_spilled_to_the_host_and_restored_equals_recompute(arch, tmp_root):
    # A KV pool for little more than one conversation: the second pushes the first's KV pages to
    # the pinned host tier; the first's next turn restores them into fresh pages.
    hf, ours = _models(arch, tmp_root)
    config = EngineConfig(max_concurrency=1, prefill_chunk=16, max_context=256, kv_capacity=160)
    core = EngineCore(ours, make_byte_tokenizer(), config)
    baseline = core.pool_accounting()
    first = run_engine(core, {0: [greedy("a1", PROMPTS[1], 6)]})["a1"][0]
    run_engine(core, {0: [greedy("b1", PROMPTS[0] * 2, 6)]})
    assert any(ck.kv_on_host for ck in core.cache.checkpoints.values())
    follow = PROMPTS[1] + first + [ord(c) for c in " next"]
    toks, final = run_engine(core, {0: [greedy("a2", follow, 8)]})["a2"]
    assert final.cached_tokens >= len(PROMPTS[1])
    assert toks == hf_greedy(hf, follow, 8)
    core.cache.clear()
    assert core.pool_accounting() == baseline


@pytest.mark.parametrize("arch", ["llama", "qwen3_5"])
def test_decode_overlap_stop_then_reuse_equals_recompute(arch, tmp_root):
    # A stop token ends the request while the next round, launched ahead, computes it: with
    # overlap the endpoint includes that token, and resuming from it equals recomputing.
    hf, ours = _models(arch, tmp_root)
    tokenizer = make_byte_tokenizer()
    plain = hf_greedy(hf, PROMPTS[0], 12)
    stop = plain[5]
    num_out = plain.index(stop) + 1
    ran = {}
    for overlap in (False, True):
        config = EngineConfig(max_concurrency=2, prefill_chunk=16, max_context=256, decode_overlap=overlap)
        core = EngineCore(ours, tokenizer, config)
        launches = []
        launch = core.runner.launch
        core.runner.launch = lambda step: launches.append(step) or launch(step)
        request = EngineRequest("t1", PROMPTS[0], SamplingParams(temperature=0.0), max_new_tokens=12, stop_token_ids=[stop])
        toks, final = run_engine(core, {0: [request], 1: [greedy("side", PROMPTS[2], 10)]})["t1"]
        assert toks == plain[:num_out] and final.finish_reason is FinishReason.STOP
        chained = [s for s in launches if any(c.previous_row is not None for c in s.chunks)]
        assert bool(chained) == overlap
        follow = PROMPTS[0] + toks + [ord(c) for c in " and then?"]
        toks2, final2 = run_engine(core, {0: [greedy("t2", follow, 8)]})["t2"]
        assert toks2 == hf_greedy(hf, follow, 8)
        assert final2.reuse_path == "private_endpoint"
        ran[overlap] = final2.cached_tokens
        assert core.pool_accounting()["running"] == 0 and core.scheduler.draining == []
    # The stop token was computed only when its round had been launched ahead.
    assert ran == {False: len(PROMPTS[0]) + num_out - 1, True: len(PROMPTS[0]) + num_out}


def test_seeded_sampling_reproducible_across_batches(tmp_root):
    _, ours = _models("qwen3_5", tmp_root)
    tokenizer = make_byte_tokenizer()
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=10, seed=-12345)
    req = lambda rid: EngineRequest(rid, PROMPTS[1], params, max_new_tokens=10)  # noqa: E731
    core = EngineCore(ours, tokenizer, EngineConfig(max_concurrency=3, prefill_chunk=32, prefix_reuse=False))
    alone = run_engine(core, {0: [req("x")]})["x"][0]
    mixed = run_engine(core, {0: [greedy("g", PROMPTS[0], 10)], 1: [req("y")], 2: [greedy("h", PROMPTS[2], 5)]})
    assert mixed["y"][0] == alone


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["thread", "process"])
def test_client_transports_stream_and_cancel(transport, tmp_root):
    _, ours = _models("llama", tmp_root)
    tokenizer = make_byte_tokenizer()
    config = EngineConfig(max_concurrency=2, prefill_chunk=16, max_context=256)
    if transport == "process":
        pytest.importorskip("zmq")
        from ninfer.server.engine_client import ProcessEngineClient

        client = ProcessEngineClient(config, functools.partial(_build_llama_core, tmp_root))
    else:
        client = InProcessEngineClient(config, lambda: EngineCore(ours, tokenizer, config))

    async def scenario():
        await client.start()
        try:
            outs = [o async for o in client.generate(greedy("a", PROMPTS[0], 6))]
            assert outs[-1].finished and sum(len(o.new_token_ids) for o in outs) == 6
            # leaving a stream early cancels the request in the engine
            stream = client.generate(greedy("b", PROMPTS[1], 200))
            first = await stream.__anext__()
            assert first.request_id == "b"
            await stream.aclose()
            outs = [o async for o in client.generate(greedy("c", PROMPTS[2], 3))]
            assert outs[-1].completion_tokens == 3
            assert client.healthy
        finally:
            await client.shutdown()

    asyncio.run(scenario())


def _build_llama_core(tmp_root: str) -> EngineCore:
    """Runs inside the engine process: rebuild the same model from the saved checkpoint."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file

    directory = Path(tmp_root) / "llama"
    config = json.loads((directory / "config.json").read_text())
    tensors = {}
    for shard in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(shard))
    model = load_ours(config, tensors)
    return EngineCore(model, make_byte_tokenizer(), EngineConfig(max_concurrency=2, prefill_chunk=16, max_context=256))


def test_penalised_rows_run_ahead_counting_the_token_in_flight(tmp_root):
    """With decode overlap, penalised rows are chained like any other: the sampler counts the
    token still in flight (the row's input) with the committed output, so greedy and seeded
    sampled tokens equal the engine's without overlap."""
    _, ours = _models("llama", tmp_root)
    repeat = SamplingParams(temperature=0.0, presence_penalty=0.7, frequency_penalty=1.1)
    sampled = SamplingParams(temperature=0.9, top_k=8, presence_penalty=1.5, frequency_penalty=0.5, seed=7)
    results = {}
    for overlap in (False, True):
        config = EngineConfig(max_concurrency=2, prefill_chunk=16, max_context=256, decode_overlap=overlap)
        core = EngineCore(ours, make_byte_tokenizer(), config)
        chained = []
        launch = core.runner.launch
        core.runner.launch = lambda step, launch=launch: chained.append(  # noqa: E731
            sum(c.previous_row is not None for c in step.chunks)) or launch(step)
        arrivals = {0: [EngineRequest("greedy", PROMPTS[0], repeat, max_new_tokens=14)],
                    2: [EngineRequest("sampled", PROMPTS[1], sampled, max_new_tokens=14)]}
        results[overlap] = run_engine(core, arrivals), sum(chained)
    (eager, none_chained), (ahead, num_chained) = results[False], results[True]
    assert none_chained == 0 and num_chained >= 10
    for rid in ("greedy", "sampled"):
        assert ahead[rid][0] == eager[rid][0], rid


def test_penalties_reach_the_sampler_through_the_engine(tmp_root):
    """Greedy with presence/frequency penalties equals a manual loop over transformers' logits."""
    hf, ours = _models("llama", tmp_root)
    tokenizer = make_byte_tokenizer()
    params = SamplingParams(temperature=0.0, presence_penalty=0.7, frequency_penalty=1.1)
    core = EngineCore(ours, tokenizer, EngineConfig(max_concurrency=1, prefill_chunk=16, max_context=256))
    got = run_engine(core, {0: [EngineRequest("p", PROMPTS[0], params, max_new_tokens=10)]})["p"][0]
    history = list(PROMPTS[0])
    expected: list[int] = []
    with torch.no_grad():
        for _ in range(10):
            logits = hf(torch.tensor([history])).logits[0, -1].float()
            counts = torch.bincount(torch.tensor(expected, dtype=torch.int64), minlength=logits.shape[0])
            logits -= 0.7 * (counts > 0).float() + 1.1 * counts.float()
            token = int(logits.argmax())
            expected.append(token)
            history.append(token)
    assert got == expected
    plain = run_engine(core, {0: [greedy("q", PROMPTS[0], 10)]})["q"][0]
    assert plain != expected  # the penalties changed the outcome, so the check above is meaningful
