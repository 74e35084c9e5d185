"""Speculative decoding through the real engine (scheduler + runner + model) on a tiny random
Qwen3.5 artifact with an MTP head: greedy output equal to plain decoding with the random MTP
head (most drafts rejected) and with an oracle drafter (every draft accepted); stops and
output limits exact inside a round; the endpoint of a truncated round reused by the next
turn; thinking-budget forced tokens, penalties, mixed steps; pools back to baseline."""

from __future__ import annotations

import functools

import pytest
import torch

from ninfer.artifact import open_artifact
from ninfer.config import EngineConfig
from ninfer.contract.output import FinishReason
from ninfer.contract.request import EngineRequest, ThinkingBudget
from ninfer.contract.sampling import SamplingParams
from ninfer.engine.core import EngineCore
from ninfer.testing.oracle_drafter import OracleDrafter
from ninfer.testing.tiny_artifacts import make_tiny_qwen3_5

GREEDY = SamplingParams(temperature=0.0)
PROMPTS = {
    "a": list(range(1000, 1040)),
    "b": list(range(1000, 1025)) + [7, 8, 9],
    "c": list(range(5000, 5090)),
}


@functools.cache
def _artifact(root: str, moe: bool):
    artifact = open_artifact(str(make_tiny_qwen3_5(root, mtp=True, moe=moe, dtype="float32")))
    return artifact, artifact.load_model(dtype=torch.float32, device="cpu")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("spec-artifacts"))


def engine(root: str, moe: bool = False, drafter=None, **config) -> EngineCore:
    artifact, model = _artifact(root, moe)
    # Fixed draft counts: these tests are about verification rounds (test_draft_policy.py: adaptive).
    defaults = dict(max_concurrency=3, max_context=512, prefill_chunk=32, mixed_prefill_chunk=16, adaptive_drafts=False)
    return EngineCore(model, artifact.tokenizer, EngineConfig(**{**defaults, **config}), drafter=drafter)


def run(core: EngineCore, arrivals: dict[int, list[EngineRequest]], max_steps: int = 3000) -> dict:
    tokens, finals = {}, {}
    step = 0
    while step < max_steps:
        for request in arrivals.get(step, []):
            tokens[request.request_id] = []
            core.add_request(request)
        if not core.has_work and step > max(arrivals):
            break
        for out in core.step():
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                finals[out.request_id] = out
        step += 1
    return {rid: (tokens[rid], finals[rid]) for rid in tokens}


def requests(max_new: dict[str, int], sampling: SamplingParams = GREEDY, **kwargs) -> dict[int, list[EngineRequest]]:
    """a and b at once, c three steps later (its prefill runs beside their speculative rounds)."""
    made = {rid: EngineRequest(rid, PROMPTS[rid], sampling, max_new_tokens=n, **kwargs) for rid, n in max_new.items()}
    return {0: [made["a"], made["b"]], 3: [made["c"]]}


def baseline(core: EngineCore) -> dict:
    accounting = core.pool_accounting()
    accounting.pop("checkpoints")
    accounting.pop("kv_pages_used")  # endpoint checkpoints keep pages: compared through the cache below
    return accounting


LIMITS = {"a": 30, "b": 17, "c": 12}


@pytest.mark.parametrize("moe", [False, True])
def test_greedy_with_the_mtp_head_equals_plain_decoding(root, moe) -> None:
    plain = run(engine(root, moe), requests(LIMITS))
    core = engine(root, moe, spec="mtp", draft_tokens=3)
    spec = run(core, requests(LIMITS))
    for rid, limit in LIMITS.items():
        assert spec[rid][0] == plain[rid][0]
        assert len(spec[rid][0]) == limit and spec[rid][1].finish_reason is FinishReason.LENGTH
        counters = spec[rid][1].speculative
        assert counters.backend == "mtp" and counters.draft_window == 3
        assert counters.rounds > 0 and counters.drafted_tokens >= counters.rounds
        # A round commits its accepted drafts plus one token; the first decode step has no drafts.
        assert 1 + counters.rounds + counters.fallback_steps + counters.accepted_tokens == limit
    assert plain["a"][1].speculative is None
    assert core.pool_accounting()["running"] == 0
    # Every slot not held by a checkpoint is free again.
    assert core.state_pool.num_free + len(core.cache) == core.state_pool.num_slots


def _oracle_sequences(root: str, max_new: dict[str, int]) -> dict[str, list[int]]:
    plain = run(engine(root), requests(max_new))
    return {rid: PROMPTS[rid] + plain[rid][0] for rid in max_new}, plain


def test_an_oracle_drafter_is_always_accepted_and_changes_nothing(root) -> None:
    sequences, plain = _oracle_sequences(root, LIMITS)
    oracle = OracleDrafter(4, sequences)
    spec = run(engine(root, spec="mtp", draft_tokens=4, drafter=oracle), requests(LIMITS))
    for rid, limit in LIMITS.items():
        tokens, final = spec[rid]
        assert tokens == plain[rid][0]
        counters = final.speculative
        assert counters.accepted_tokens == counters.drafted_tokens > 0
        # Full acceptance: 5 tokens a round, the draft count shrinking only at the output limit.
        assert counters.rounds <= -(-(limit - 2) // 5) + 1
        assert counters.accepted_per_position[0] == counters.rounds


def test_wrong_drafts_are_all_rejected_and_change_nothing(root) -> None:
    sequences, plain = _oracle_sequences(root, LIMITS)
    oracle = OracleDrafter(3, sequences, wrong=True, vocab_size=248_000)
    spec = run(engine(root, spec="mtp", draft_tokens=3, drafter=oracle), requests(LIMITS))
    for rid in LIMITS:
        assert spec[rid][0] == plain[rid][0]
        assert spec[rid][1].speculative.accepted_tokens == 0


# With every draft accepted at 4 drafts a round, output tokens 2-6, 7-11 ... each come from one
# round: token 9 is its round's third draft, token 11 the target's token after the four drafts.
@pytest.mark.parametrize("stop_index", [9, 11])
def test_a_stop_inside_a_round_commits_exactly_and_the_next_turn_reuses_it(root, stop_index) -> None:
    """The stop token sits among the round's accepted drafts (or is the token after them): the
    output ends at it, the endpoint checkpoint holds the committed tokens before it (the stop's
    own row stays out even when it was a computed draft, as plain decoding never computes a
    request's last token), and a follow-up turn continuing after it reuses exactly what plain
    decoding's does and continues as plain decoding does."""
    sequences, plain = _oracle_sequences(root, {"a": 40, "b": 17, "c": 12})
    stop = plain["a"][0][stop_index]
    assert stop not in plain["a"][0][:stop_index]
    cores = {
        "plain": engine(root, max_concurrency=1),
        "spec": engine(root, max_concurrency=1, spec="mtp", draft_tokens=4, drafter=OracleDrafter(4, sequences)),
    }
    results = {}
    for name, core in cores.items():
        first = run(core, {0: [EngineRequest("a", PROMPTS["a"], GREEDY, max_new_tokens=40, stop_token_ids=[stop])]})
        tokens, final = first["a"]
        assert tokens == plain["a"][0][: stop_index + 1] and final.finish_reason is FinishReason.STOP
        follow_up = PROMPTS["a"] + tokens + [11, 12, 13]
        second = run(core, {0: [EngineRequest("a2", follow_up, GREEDY, max_new_tokens=8)]})
        results[name] = second["a2"]
    spec_tokens, spec_final = results["spec"]
    plain_tokens, plain_final = results["plain"]
    assert spec_tokens == plain_tokens
    assert spec_final.cached_tokens == plain_final.cached_tokens == len(PROMPTS["a"]) + stop_index


def test_a_reply_cut_before_a_stop_is_reused_as_plain_decoding_reuses_it(root) -> None:
    """A stop string's last token never reaches the client, so the next prompt holds the reply up
    to the token before it: the endpoint must end there (as plain decoding's does), not after
    the stop's draft row, or the next turn falls back to the prompt's checkpoint."""
    sequences, plain = _oracle_sequences(root, {"a": 40, "b": 17, "c": 12})
    stop_index = 9  # its round's third accepted draft
    stop = plain["a"][0][stop_index]
    assert stop not in plain["a"][0][:stop_index]
    cached = {}
    for name, core in {
        "plain": engine(root, max_concurrency=1),
        "spec": engine(root, max_concurrency=1, spec="mtp", draft_tokens=4, drafter=OracleDrafter(4, sequences)),
    }.items():
        run(core, {0: [EngineRequest("a", PROMPTS["a"], GREEDY, max_new_tokens=40, stop_token_ids=[stop])]})
        follow_up = PROMPTS["a"] + plain["a"][0][:stop_index] + [11, 12, 13]
        cached[name] = run(core, {0: [EngineRequest("a2", follow_up, GREEDY, max_new_tokens=2)]})["a2"][1].cached_tokens
    assert cached["spec"] == cached["plain"] == len(PROMPTS["a"]) + stop_index


def test_the_output_limit_ends_a_round_exactly(root) -> None:
    sequences, plain = _oracle_sequences(root, {"a": 9, "b": 3, "c": 1})
    spec = run(engine(root, spec="mtp", draft_tokens=5, drafter=OracleDrafter(5, sequences)),
               requests({"a": 9, "b": 3, "c": 1}))
    for rid, limit in (("a", 9), ("b", 3), ("c", 1)):
        assert spec[rid][0] == plain[rid][0] and len(spec[rid][0]) == limit


def test_penalties_and_mixed_prompt_steps_equal_plain(root) -> None:
    penalised = SamplingParams(temperature=0.0, presence_penalty=1.5, frequency_penalty=0.5)
    sequences, _ = _oracle_sequences(root, LIMITS)
    plain = run(engine(root), requests(LIMITS, penalised))
    spec = run(engine(root, spec="mtp", draft_tokens=3, drafter=OracleDrafter(3, sequences)), requests(LIMITS, penalised))
    for rid in LIMITS:
        assert spec[rid][0] == plain[rid][0]


def test_thinking_budget_forced_tokens_inside_speculation(root) -> None:
    """The budget closes in the middle of a round: the rest of the round is dropped, the forced
    close tokens are computed in a row of their own, and the output equals plain decoding."""
    budget = ThinkingBudget(max_thinking_tokens=7, close_token_ids=[77, 78], think_end_token_id=78)
    made = lambda: {0: [EngineRequest("a", PROMPTS["a"], GREEDY, max_new_tokens=25, thinking_budget=budget)]}  # noqa: E731
    plain = run(engine(root), made())
    sequences = {"a": PROMPTS["a"] + plain["a"][0]}
    spec = run(engine(root, spec="mtp", draft_tokens=3, drafter=OracleDrafter(3, sequences)), made())
    assert spec["a"][0] == plain["a"][0]
    assert plain["a"][0][7:9] == [77, 78]
    assert spec["a"][1].forced_token_count == plain["a"][1].forced_token_count


def test_sampled_requests_repeat_with_their_seed(root) -> None:
    sampled = SamplingParams(temperature=1.0, top_k=5, seed=1234)
    first = run(engine(root, spec="mtp", draft_tokens=3), requests(LIMITS, sampled))
    again = run(engine(root, spec="mtp", draft_tokens=3), requests(LIMITS, sampled))
    for rid in LIMITS:
        assert first[rid][0] == again[rid][0] and len(first[rid][0]) == LIMITS[rid]


def test_pools_return_to_baseline_without_prefix_reuse(root) -> None:
    core = engine(root, spec="mtp", draft_tokens=2, prefix_reuse=False)
    before = core.pool_accounting()
    run(core, requests(LIMITS))
    assert core.pool_accounting() == before


def test_adaptive_drafts_turn_off_when_rejected_and_outputs_stay_plain(root) -> None:
    """All drafts wrong: after a few rounds each request decodes plainly (its drafter's context
    still extended), probing now and then; the tokens are plain decoding's."""
    sequences, plain = _oracle_sequences(root, LIMITS)
    wrong = OracleDrafter(3, sequences, wrong=True, vocab_size=248_000)
    spec = run(engine(root, spec="mtp", draft_tokens=3, drafter=wrong, adaptive_drafts=True), requests(LIMITS))
    for rid, limit in LIMITS.items():
        tokens, final = spec[rid]
        assert tokens == plain[rid][0]
        counters = final.speculative
        assert counters.accepted_tokens == 0
        assert counters.rounds <= 4 and counters.fallback_steps >= limit - 1 - counters.rounds - 1


def test_adaptive_drafts_keep_drafting_when_accepted(root) -> None:
    sequences, plain = _oracle_sequences(root, LIMITS)
    oracle = OracleDrafter(4, sequences)
    spec = run(engine(root, spec="mtp", draft_tokens=4, drafter=oracle, adaptive_drafts=True), requests(LIMITS))
    for rid, limit in LIMITS.items():
        tokens, final = spec[rid]
        assert tokens == plain[rid][0]
        counters = final.speculative
        assert counters.accepted_tokens == counters.drafted_tokens > 0
        assert counters.rounds <= -(-(limit - 2) // 5) + 1  # never fell back to plain rounds


def test_a_request_of_the_whole_context_fits_the_default_pool(root) -> None:
    """A speculative round writes K+1 positions past the last committed token: the default KV pool
    (--max-context with no --kv-capacity) holds that window too, so a request asking for the whole
    context is served as without --spec, and so is the warm-up's worst step."""
    config = EngineConfig(max_context=96, spec="mtp", draft_tokens=3)
    assert config.kv_tokens == 96 + 4 and EngineConfig(max_context=96).kv_tokens == 96
    core = engine(root, max_context=96, max_concurrency=1, spec="mtp", draft_tokens=3)
    prompt = PROMPTS["a"]
    out = run(core, {0: [EngineRequest("whole", prompt, GREEDY, max_new_tokens=96 - len(prompt))]})
    tokens, final = out["whole"]
    assert final.error is None and len(tokens) == 96 - len(prompt) and final.finish_reason is FinishReason.LENGTH


def test_fp8_drafter_weights_change_only_the_drafts(root) -> None:
    """--draft-fp8: the MTP head's layers and the reduced proposal head in FP8 per row; the
    greedy output is plain decoding's (verification decides every token), and a second engine on
    the same model finds the head already quantized."""
    from ninfer.models.quant.fp8 import Fp8Linear

    plain = run(engine(root), requests(LIMITS))
    artifact = _artifact(root, False)[0]
    model = artifact.load_model(dtype=torch.float32, device="cpu")  # its own copy: the head is quantized in place
    defaults = dict(max_concurrency=3, max_context=512, prefill_chunk=32, mixed_prefill_chunk=16, adaptive_drafts=False,
                    spec="mtp", draft_tokens=3, draft_fp8=True)

    def fp8_engine(**config) -> EngineCore:
        return EngineCore(model, artifact.tokenizer, EngineConfig(**{**defaults, **config}))

    core = fp8_engine(lm_head_draft=True)
    mtp = model.mtp
    quantized = [m for m in mtp.modules() if isinstance(m, Fp8Linear)]
    assert quantized and not [m for m in mtp.modules() if type(m).__name__ == "Linear"]
    head = core.runner.speculator.drafter.head
    assert head.fp8 is not None and head.weight is None
    assert head.weight_bytes < head.vocab_size * head.lm_head.weight.shape[1] * head.lm_head.weight.element_size()
    spec = run(core, requests(LIMITS))
    for rid in LIMITS:
        assert spec[rid][0] == plain[rid][0]
        assert spec[rid][1].speculative.drafted_tokens > 0
    again = fp8_engine()
    assert [m for m in mtp.modules() if isinstance(m, Fp8Linear)] == quantized
    assert again.runner.speculator.drafter.head.fp8 is None  # no reduced head: the target's lm_head as it is
