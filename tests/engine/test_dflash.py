"""DFlash / DFlash2 speculative decoding through the real engine (scheduler + runner + model) on the
tiny random Qwen3.5 artifacts with tiny random drafter companions: greedy output equal to plain
decoding (dense and MoE, several draft counts up to 15); every block the drafter proposes equal
to the plain reference drafter computed from scratch over the committed tokens, with rounds that
accept (an oracle overrides the proposals), prompt chunks beside the rounds and a follow-up turn
reusing the cached prefix; stops and output limits exact inside a round; seeded sampled requests
repeat; pools back to baseline; the drafter's context KV follows page copies and the host tier;
DFlash2's candidate walk against the reference walk and its draws against q."""

from __future__ import annotations

import functools
import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from ninfer.artifact import open_artifact
from ninfer.artifact.draft_companion import open_draft_companion
from ninfer.config import EngineConfig
from ninfer.contract.output import FinishReason
from ninfer.contract.request import EngineRequest, ThinkingBudget
from ninfer.contract.sampling import TOP_K_CAP, SamplingParams
from ninfer.engine.core import EngineCore
from ninfer.engine.sampler import SamplingBatch
from ninfer.engine.scheduler import CopyPage, RestorePages, SchedulerStep, SpillPages, StepKind
from ninfer.engine.speculative.dflash_drafter import DflashDrafter
from ninfer.engine.speculative.proposal_head import ProposalHead
from ninfer.testing.oracle_drafter import OracleDrafter
from ninfer.testing.tiny_artifacts import make_tiny_qwen3_5
from ninfer.testing.tiny_dflash import make_tiny_dflash
from tests.engine.test_speculative import run
from tests.models import dflash_reference as reference
from tests.models.helpers import Session

GREEDY = SamplingParams(temperature=0.0)
PROMPTS = {
    "a": list(range(1000, 1040)),
    "b": list(range(1000, 1025)) + [7, 8, 9],
    "c": list(range(5000, 5090)),
}
LIMITS = {"a": 14, "b": 9, "c": 6}
# Fixed draft counts: these tests are about the drafter's rounds (adaptive drafts: tests/unit/test_draft_policy.py).
CONFIG = dict(max_concurrency=3, max_context=512, prefill_chunk=32, mixed_prefill_chunk=16, adaptive_drafts=False)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("dflash-engine"))


@functools.cache
def _target(root: str, moe: bool):
    path = make_tiny_qwen3_5(root, moe=moe, dtype="float32")
    artifact = open_artifact(str(path))
    return path, artifact, artifact.load_model(dtype=torch.float32, device="cpu")


@functools.cache
def _drafter(root: str, moe: bool, kind: str):
    path = _target(root, moe)[0]
    directory = make_tiny_dflash(path, kind)
    model = open_draft_companion(path, kind).load_model(torch.float32)
    return model, json.loads((directory / "config.json").read_text()), load_file(directory / "model.safetensors")


def engine(root: str, moe: bool = False, kind: str | None = None, drafter=None, **config) -> EngineCore:
    _, artifact, model = _target(root, moe)
    draft_model = _drafter(root, moe, kind)[0] if kind else None
    return EngineCore(model, artifact.tokenizer, EngineConfig(**{**CONFIG, **config}), drafter=drafter,
                      draft_model=draft_model)


def requests(max_new: dict[str, int], sampling: SamplingParams = GREEDY) -> dict[int, list[EngineRequest]]:
    """a and b at once, c three steps later (its prompt chunks run beside their rounds)."""
    made = {rid: EngineRequest(rid, PROMPTS[rid], sampling, max_new_tokens=n) for rid, n in max_new.items()}
    return {0: [made["a"], made["b"]], 3: [made["c"]]}


@functools.cache
def _plain(root: str, moe: bool, limits: tuple[tuple[str, int], ...]) -> dict:
    return run(engine(root, moe), requests(dict(limits)))


@pytest.mark.parametrize(
    "moe, kind, num_drafts, lm_head_draft",
    [
        (False, "dflash", 3, False),
        (False, "dflash2", 15, True),
        (True, "dflash", 15, True),
        (True, "dflash2", 4, False),
    ],
)
def test_greedy_with_a_random_drafter_equals_plain_decoding(root, moe, kind, num_drafts, lm_head_draft) -> None:
    plain = _plain(root, moe, tuple(LIMITS.items()))
    core = engine(root, moe, kind, spec=kind, draft_tokens=num_drafts, lm_head_draft=lm_head_draft)
    spec = run(core, requests(LIMITS))
    for rid, limit in LIMITS.items():
        tokens, final = spec[rid]
        assert tokens == plain[rid][0]
        assert len(tokens) == limit and final.finish_reason is FinishReason.LENGTH
        counters = final.speculative
        assert counters.backend == kind and counters.draft_window == num_drafts
        assert counters.rounds > 0 and counters.drafted_tokens >= counters.rounds
        assert 1 + counters.rounds + counters.fallback_steps + counters.accepted_tokens == limit
    assert core.state_pool.num_free + len(core.cache) == core.state_pool.num_slots


class RecordingDrafter:
    """Runs the real DFlash drafter and records, for every verification row, the position its block
    started at, the token there and the drafts it proposed; with `oracle`, proposes the oracle's
    continuation instead, so rounds accept (the drafter's context then grows by whole rounds)."""

    def __init__(self, inner: DflashDrafter, oracle: OracleDrafter | None = None):
        self.inner = inner
        self.oracle = oracle
        self.aux_layer_ids = inner.aux_layer_ids
        self.records: list[tuple[str, int, int, list[int]]] = []

    def draft(self, round):
        proposal = self.inner.draft(round)
        if not round.num_verify:
            return proposal
        accepted = round.num_accepted.tolist()
        for row, (chunk, num_accepted) in enumerate(zip(round.chunks, accepted)):
            start = chunk.num_computed_tokens + 1 + num_accepted
            first = int(round.tokens[row, num_accepted])
            self.records.append((chunk.request_id, start, first, proposal.token_ids[row].tolist()))
        return self.oracle.draft(round) if self.oracle is not None else proposal


def _recording_engine(root: str, kind: str, num_drafts: int, sequences: dict | None, **config):
    core = engine(root, False, kind, spec=kind, draft_tokens=num_drafts, **config)
    inner = core.runner.speculator.drafter
    recorder = RecordingDrafter(inner, OracleDrafter(num_drafts, sequences) if sequences else None)
    core.runner.speculator.drafter = recorder
    return core, recorder


def _reference_drafts(root: str, kind: str, sequence: list[int], start: int, num_drafts: int) -> list[int]:
    """The drafts the published algorithm makes from the committed tokens sequence[:start + 1]."""
    _, artifact, target = _target(root, False)
    _, config, tensors = _drafter(root, False, kind)
    layer_ids = tuple(config["dflash_config"]["target_layer_ids"])
    session = Session(target, start)
    batch = session.batch([0], [start])
    batch.aux_layer_ids = layer_ids
    batch.aux_hidden = torch.empty(start, len(layer_ids), target.config.hidden_size)
    with torch.no_grad():
        target(torch.tensor(sequence[:start]), batch)
        block = torch.tensor([sequence[start]] + [config["dflash_config"]["mask_token_id"]] * num_drafts)
        hidden = reference.block_hidden(tensors, config, batch.aux_hidden, target.model.embed_tokens(block))[1:]
        logits = target.compute_logits(hidden).float()
    logits[:, artifact.tokenizer.vocab_size :] = float("-inf")
    logits = reference.scaled_logits(config, logits)
    if kind == "dflash2":
        return reference.select_path(tensors, config, logits, hidden, sequence[start])[0]
    return logits.argmax(-1).tolist()


@pytest.mark.parametrize("kind, num_drafts", [("dflash", 4), ("dflash2", 6)])
def test_every_block_equals_the_reference_drafter_over_the_committed_tokens(root, kind, num_drafts) -> None:
    limits = {"a": 20, "b": 9, "c": 12}
    plain = _plain(root, False, tuple(limits.items()))
    sequences = {rid: PROMPTS[rid] + plain[rid][0] for rid in limits}
    follow_up = PROMPTS["a"] + plain["a"][0] + [11, 12, 13]
    second_plain = run(engine(root), {0: [EngineRequest("a2", follow_up, GREEDY, max_new_tokens=8)]})["a2"][0]
    sequences["a2"] = follow_up + second_plain

    core, recorder = _recording_engine(root, kind, num_drafts, sequences)
    first = run(core, requests(limits))
    second = run(core, {0: [EngineRequest("a2", follow_up, GREEDY, max_new_tokens=8)]})["a2"]
    assert all(first[rid][0] == plain[rid][0] for rid in limits) and second[0] == second_plain
    assert second[1].cached_tokens > len(PROMPTS["a"])  # the second turn drafts over reused pages
    assert first["a"][1].speculative.accepted_tokens > 0  # rounds accepted: blocks started past drafts
    assert {rid for rid, *_ in recorder.records} == {"a", "b", "c", "a2"}
    _assert_blocks_equal_the_reference(root, kind, recorder, sequences, num_drafts)


def _assert_blocks_equal_the_reference(root, kind, recorder, sequences, num_drafts, num_cut: int = 0) -> None:
    """num_cut: blocks whose first token the scheduler did not keep (a forced token replaced it)."""
    cut = 0
    for rid, start, first_token, drafted in recorder.records:
        if sequences[rid][start] != first_token:
            cut += 1
            continue
        assert drafted == _reference_drafts(root, kind, sequences[rid], start, num_drafts), (rid, start)
    assert cut == num_cut


def test_forced_thinking_close_tokens_extend_the_context(root) -> None:
    """The budget closes inside a round: the forced tokens run as a plain row, whose context the
    next blocks read."""
    budget = ThinkingBudget(max_thinking_tokens=7, close_token_ids=[77, 78], think_end_token_id=78)
    made = lambda: {0: [EngineRequest("a", PROMPTS["a"], GREEDY, max_new_tokens=16, thinking_budget=budget)]}  # noqa: E731
    plain = run(engine(root), made())["a"][0]
    assert plain[7:9] == [77, 78]
    sequences = {"a": PROMPTS["a"] + plain}
    core, recorder = _recording_engine(root, "dflash", 3, sequences)
    assert run(core, made())["a"][0] == plain
    assert any(start > len(PROMPTS["a"]) + 9 for _, start, *_ in recorder.records)
    _assert_blocks_equal_the_reference(root, "dflash", recorder, sequences, 3, num_cut=1)


# With every draft accepted at 4 drafts a round, output tokens 2-6, 7-11 ... each come from one
# round: token 9 is its round's third draft, token 11 the target's token after the four drafts.
@pytest.mark.parametrize("stop_index", [9, 11])
def test_a_stop_inside_a_round_commits_exactly_and_the_next_turn_reuses_it(root, stop_index) -> None:
    """The endpoint holds the committed tokens before the stop (as plain decoding's): the follow-up
    reuses exactly what plain decoding's does."""
    limits = {"a": 24, "b": 9, "c": 6}
    plain = _plain(root, False, tuple(limits.items()))
    sequences = {rid: PROMPTS[rid] + plain[rid][0] for rid in limits}
    stop = plain["a"][0][stop_index]
    assert stop not in plain["a"][0][:stop_index]
    results = {}
    for name in ("plain", "dflash"):
        if name == "plain":
            core = engine(root, max_concurrency=1)
        else:
            core, _ = _recording_engine(root, "dflash", 4, sequences, max_concurrency=1)
        first = run(core, {0: [EngineRequest("a", PROMPTS["a"], GREEDY, max_new_tokens=24, stop_token_ids=[stop])]})
        tokens, final = first["a"]
        assert tokens == plain["a"][0][: stop_index + 1] and final.finish_reason is FinishReason.STOP
        follow_up = PROMPTS["a"] + tokens + [11, 12, 13]
        results[name] = run(core, {0: [EngineRequest("a2", follow_up, GREEDY, max_new_tokens=6)]})["a2"]
    assert results["dflash"][0] == results["plain"][0]
    assert results["dflash"][1].cached_tokens == results["plain"][1].cached_tokens == len(PROMPTS["a"]) + stop_index


def test_the_output_limit_ends_a_round_exactly(root) -> None:
    limits = {"a": 9, "b": 3, "c": 1}
    plain = _plain(root, False, tuple(limits.items()))
    sequences = {rid: PROMPTS[rid] + plain[rid][0] for rid in limits}
    core, _ = _recording_engine(root, "dflash2", 5, sequences)
    spec = run(core, requests(limits))
    for rid, limit in limits.items():
        assert spec[rid][0] == plain[rid][0] and len(spec[rid][0]) == limit


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_sampled_requests_repeat_with_their_seed(root, kind) -> None:
    sampled = SamplingParams(temperature=0.8, top_k=8, seed=1234)
    made = lambda: {0: [EngineRequest("a", PROMPTS["a"], sampled, max_new_tokens=10),  # noqa: E731
                        EngineRequest("b", PROMPTS["b"], GREEDY, max_new_tokens=6)]}
    first = run(engine(root, kind=kind, spec=kind, draft_tokens=5), made())
    again = run(engine(root, kind=kind, spec=kind, draft_tokens=5), made())
    assert first["a"][0] == again["a"][0] and len(first["a"][0]) == 10
    assert first["b"][0] == _plain(root, False, (("a", 14), ("b", 9), ("c", 6)))["b"][0][:6]


def test_pools_return_to_baseline_without_prefix_reuse(root) -> None:
    core = engine(root, kind="dflash2", spec="dflash2", draft_tokens=2, prefix_reuse=False)
    before = core.pool_accounting()
    run(core, requests(LIMITS))
    assert core.pool_accounting() == before


def test_page_copies_and_the_host_tier_carry_the_drafter_context(root) -> None:
    core = engine(root, kind="dflash", spec="dflash", draft_tokens=2)
    runner = core.runner
    draft_kv = runner.draft_kv_cache
    assert draft_kv is not None and runner.paged_caches == [runner.kv_cache, draft_kv]
    assert len(runner.host_kvs) == 2 and runner.host_kvs[1].num_pages > 0
    torch.manual_seed(0)
    draft_kv.k.normal_()
    draft_kv.v.normal_()
    page_3, page_5 = draft_kv.k[:, 3].clone(), draft_kv.v[:, 5].clone()
    runner.execute(SchedulerStep(StepKind.DECODE, [], before=[CopyPage(3, 7), SpillPages((5,), (0,))]))
    draft_kv.k.zero_()
    draft_kv.v.zero_()
    runner.execute(SchedulerStep(StepKind.DECODE, [], before=[RestorePages((0,), (9,))]))
    assert torch.equal(draft_kv.v[:, 9], page_5) and not draft_kv.k[:, 7].any()
    draft_kv.k[:, 3] = page_3
    runner.execute(SchedulerStep(StepKind.DECODE, [], before=[CopyPage(3, 7)]))
    assert torch.equal(draft_kv.k[:, 7], page_3)


def _walk_case(root: str, num_rows: int, seed: int = 0):
    """A DFlash2 drafter and random walk inputs: hidden [R, 5, H], their scaled logits, first tokens."""
    model, config, tensors = _drafter(root, False, "dflash2")
    _, artifact, target = _target(root, False)
    head = ProposalHead(target.lm_head, artifact.tokenizer.vocab_size, reduced=False)
    drafter = DflashDrafter(target, model, head, kv_cache=None, num_draft_tokens=5)
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_rows, 5, config["hidden_size"], generator=generator)
    with torch.no_grad():
        logits = model.scale_logits(head.logits(hidden.flatten(0, 1))).view(num_rows, 5, -1)
    first = torch.randint(0, 248_000, (num_rows,), generator=generator)
    return drafter, (config, tensors), logits, hidden, first


def _walk(drafter: DflashDrafter, logits, hidden, first, sampling: SamplingParams, noise: torch.Tensor):
    params = [sampling] * len(first)
    batch = SamplingBatch.build(params, [[] for _ in params], num_generated=[0] * len(params))
    round = SimpleNamespace(
        inputs=SimpleNamespace(request_sampling=batch),
        noise_for=lambda step: SimpleNamespace(noise=noise[:, step - 1]),
    )
    with torch.no_grad():
        return drafter.select_path(logits, hidden, first, round)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_the_candidate_walk_equals_the_reference_walk(root, temperature) -> None:
    drafter, (config, tensors), logits, hidden, first = _walk_case(root, 3)
    noise = -torch.log(torch.rand(3, 5, TOP_K_CAP, generator=torch.Generator().manual_seed(1)))
    sampling = SamplingParams(temperature=temperature, seed=5) if temperature else GREEDY
    proposal = _walk(drafter, logits, hidden, first, sampling, noise)
    for row in range(3):
        tokens, qs = reference.select_path(tensors, config, logits[row], hidden[row], int(first[row]),
                                           temperature, noise[row])
        assert proposal.token_ids[row].tolist() == tokens
        for step, q in enumerate(qs):
            got: dict[int, float] = {}
            for token, p in zip(proposal.candidate_ids[row, step].tolist(), proposal.probs[row, step].tolist()):
                got[token] = got.get(token, 0.0) + p
            # q over the selector's candidates (sampled), one-hot on the draft (greedy).
            assert got == pytest.approx(q if temperature else {tokens[step]: 1.0}, abs=1e-5)


def test_sampled_walk_draws_follow_q(root) -> None:
    """Many rows of the same inputs, each with its own noise: the first draft's frequencies match q."""
    num_rows = 4000
    drafter, _, logits, hidden, first = _walk_case(root, 1)
    noise = -torch.log(torch.rand(num_rows, 5, TOP_K_CAP, generator=torch.Generator().manual_seed(9)))
    proposal = _walk(
        drafter, logits.expand(num_rows, -1, -1), hidden.expand(num_rows, -1, -1), first.expand(num_rows),
        SamplingParams(temperature=1.5, seed=5), noise,
    )
    q = dict(zip(proposal.candidate_ids[0, 0].tolist(), proposal.probs[0, 0].tolist()))
    drawn = proposal.token_ids[:, 0].tolist()
    assert set(drawn) <= set(q) and max(q.values()) < 0.9  # a spread q, so the test can fail
    chi_square = sum((drawn.count(t) - num_rows * p) ** 2 / (num_rows * p) for t, p in q.items() if num_rows * p >= 5)
    assert chi_square < 37.7  # 16 candidates: the 0.999 quantile of chi2(15)
