"""VerifyGraphs' static layout on the CPU: the regions a GPU captures, run directly over the
static input buffers, give the same tokens as the eager speculative path and as plain decoding
(greedy and seeded sampling, dense and MoE), and every steady speculative round goes through
them. The capture itself and replay-equals-eager are GPU tests (tests/gpu/test_verify_graphs.py)."""

from __future__ import annotations

import pytest

from ninfer.contract.sampling import SamplingParams
from ninfer.engine.core import EngineCore
from ninfer.engine.verify_graphs import VerifyGraphs
from tests.engine.test_speculative import LIMITS, engine, requests, run

SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, top_k=10, seed=1234)


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


def test_penalized_rounds_stay_eager(root) -> None:
    penalized = SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.3)
    eager = run(engine(root, spec="mtp", draft_tokens=3), requests(LIMITS, penalized))
    core = engine(root, spec="mtp", draft_tokens=3)
    rounds = with_uncaptured_graphs(core)
    graphed = run(core, requests(LIMITS, penalized))
    assert rounds == []
    for rid in LIMITS:
        assert graphed[rid][0] == eager[rid][0]
