"""VerifyGraphs' static layout on the CPU: the regions a GPU captures, run directly over the
static input buffers, give the same tokens as the eager speculative path and as plain decoding
(greedy and seeded sampling, dense and MoE), and every steady speculative round goes through
them. The capture itself and replay-equals-eager are GPU tests (tests/gpu/test_verify_graphs.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ninfer.artifact import open_artifact
from ninfer.bench.checkpoint import zero_output_norms_
from ninfer.config import EngineConfig
from ninfer.contract.sampling import SamplingParams
from ninfer.engine.core import EngineCore
from ninfer.engine.verify_graphs import VerifyGraphs
from ninfer.engine.verify_penalties import VerifyPenalties
from ninfer.testing.tiny_artifacts import make_tiny_qwen3_5
from tests.engine.test_speculative import LIMITS, engine, requests, run

SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, top_k=10, seed=1234)
PENALISED = SamplingParams(temperature=0.0, presence_penalty=-1.0, frequency_penalty=0.3)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("verify-graph-artifacts"))


def with_uncaptured_graphs(core: EngineCore) -> list[int]:
    """Give the core's runner VerifyGraphs whose regions run uncaptured; -> the batch size of each round they ran."""
    runner = core.runner
    max_pages = runner.kv_cache.num_pages
    graphs = VerifyGraphs(runner.model, runner.kv_cache, runner.state_cache, runner.speculator, [1, 2, 3], max_pages)
    graphs.run_uncaptured()
    runner.verify_graphs = graphs
    return count_rounds(graphs)


def count_rounds(graphs: VerifyGraphs) -> list[int]:
    """From now on, the batch size of each round `graphs` runs."""
    rounds: list[int] = []
    replay = graphs.run

    def counted(chunks):
        rounds.append(len(chunks))
        return replay(chunks)

    graphs.run = counted
    return rounds


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_greedy_rounds_through_the_graph_layout_equal_eager_and_plain(root, moe) -> None:
    plain = run(engine(root, moe), requests(LIMITS))
    eager = run(engine(root, moe, spec="mtp", draft_tokens=3), requests(LIMITS))
    core = engine(root, moe, spec="mtp", draft_tokens=3)
    rounds = with_uncaptured_graphs(core)
    graphed = run(core, requests(LIMITS))
    for rid in LIMITS:
        assert graphed[rid][0] == plain[rid][0] == eager[rid][0]
        assert graphed[rid][1].speculative == eager[rid][1].speculative
    # Steps without prompt chunks went through the layout, at every batch size that occurred.
    assert len(rounds) >= 5 and {1, 2} <= set(rounds)
    assert core.pool_accounting()["running"] == 0


def test_seeded_sampling_through_the_graph_layout_equals_eager(root) -> None:
    eager = run(engine(root, spec="mtp", draft_tokens=2), requests(LIMITS, SAMPLED))
    core = engine(root, spec="mtp", draft_tokens=2)
    rounds = with_uncaptured_graphs(core)
    graphed = run(core, requests(LIMITS, SAMPLED))
    assert rounds
    for rid in LIMITS:
        assert graphed[rid][0] == eager[rid][0]
        assert graphed[rid][1].speculative == eager[rid][1].speculative


def constant_output_engine(root: str, **config) -> EngineCore:
    """engine() over its own copy of the model with the output norms zero: every logit 0, so the
    MTP head drafts token 0 and penalties alone choose what the target emits."""
    artifact = open_artifact(str(make_tiny_qwen3_5(root, mtp=True, dtype="float32")))
    model = artifact.load_model(dtype=torch.float32, device="cpu")
    zero_output_norms_(model, list(model.named_parameters()))
    defaults = dict(max_concurrency=3, max_context=512, prefill_chunk=32, mixed_prefill_chunk=16, adaptive_drafts=False,
                    spec="mtp", draft_tokens=3)
    return EngineCore(model, artifact.tokenizer, EngineConfig(**{**defaults, **config}))


@pytest.mark.parametrize(
    "sampling",
    [
        # A seen token scores 1.0 - 0.3 * count: each token four times (0 0 0 0 1 ...), so whether a
        # draft of 0 is kept depends on the count the drafts before it add.
        SamplingParams(temperature=0.0, presence_penalty=-1.0, frequency_penalty=0.3),
        SamplingParams(temperature=0.8, top_k=10, presence_penalty=-1.0, frequency_penalty=0.3, seed=99),
    ],
    ids=["greedy", "sampled"],
)
def test_penalized_rounds_through_the_graph_layout_equal_eager(root, sampling) -> None:
    # The layout counts the output tokens and the drafts before each row on the device; the eager
    # plan lists them per row: the same scores, so the same tokens and acceptance.
    eager = run(constant_output_engine(root), requests(LIMITS, sampling))
    core = constant_output_engine(root)
    rounds = with_uncaptured_graphs(core)
    graphed = run(core, requests(LIMITS, sampling))
    assert len(rounds) >= 5
    for rid in LIMITS:
        assert graphed[rid][0] == eager[rid][0]
        assert graphed[rid][1].speculative == eager[rid][1].speculative
    # The penalties decided the tokens (without them every token is 0) and drafts were kept.
    assert all(len(set(eager[rid][0])) > 2 for rid in LIMITS)
    assert sum(eager[rid][1].speculative.accepted_tokens for rid in LIMITS) > 0
    if sampling.is_greedy:
        assert eager["a"][0][:9] == [0, 0, 0, 0, 1, 1, 1, 1, 2]


def test_penalized_rounds_past_the_penalty_buffer_run_eagerly(root) -> None:
    penalized = SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.3)
    eager = run(engine(root, spec="mtp", draft_tokens=3), requests(LIMITS, penalized))
    core = engine(root, spec="mtp", draft_tokens=3)
    rounds = with_uncaptured_graphs(core)
    core.runner.verify_graphs.penalties.capacity = 2  # two output tokens: every later round overflows it
    graphed = run(core, requests(LIMITS, penalized))
    assert rounds == []
    for rid in LIMITS:
        assert graphed[rid][0] == eager[rid][0]


def test_penalty_counts_hold_this_rounds_tokens_and_drafts_before_each_row() -> None:
    # A long round, then a shorter one: the second uploads a shorter prefix of the entry buffer, and
    # the first round's entries past it must count for nothing.
    k, vocab = 3, 20
    penalties = VerifyPenalties(max_batch=3, max_tokens_per_request=256, vocab_size=vocab, num_draft_tokens=k,
                                device=torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    for batch_size, history_len in ((3, 60), (2, 7)):
        histories = [torch.randint(0, vocab, (history_len,), generator=generator).tolist() for _ in range(batch_size)]
        drafts = torch.randint(0, vocab, (batch_size, k), generator=generator)
        num_drafts = torch.tensor([k, 1, 0][:batch_size])
        chunks = [SimpleNamespace(sampling=PENALISED, output_token_ids=history) for history in histories]
        num_entries = torch.tensor([penalties.fill(chunks)])
        counts = penalties.counts(batch_size, num_entries, drafts, num_drafts)
        expected = torch.zeros(batch_size * (k + 1), vocab)
        for request, history in enumerate(histories):
            for row in range(k + 1):
                listed = history + drafts[request, : min(row, int(num_drafts[request]))].tolist()
                expected[request * (k + 1) + row] = torch.bincount(torch.tensor(listed), minlength=vocab).float()
        assert torch.equal(counts, expected)
    assert not penalties.fits(chunks * 2000)  # 28,000 tokens past 3 x 256: such a round runs eagerly
