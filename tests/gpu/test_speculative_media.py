"""Speculative rounds of requests with media through the verify graphs, on the tiny random VL
artifact with an MTP head: an image prompt and a conversation holding that image in an earlier
turn, beside a text request.

- bf16: an engine whose rounds replay the verify graphs and one that runs them eagerly
  (--no-cuda-graph) step in lockstep; every delta and the per-slot logits equal bit for bit,
  and the graphs served the rounds;
- fp32: speculative greedy output equals plain decoding's;
- the table oracle (the MTP head's work, proposals from the known continuation) is accepted in
  full through the graphs.
"""

from __future__ import annotations

import functools

import pytest
import torch

from ninfer.artifact import open_artifact
from ninfer.config import EngineConfig
from ninfer.contract.request import EngineRequest
from ninfer.contract.sampling import SamplingParams
from ninfer.engine.core import EngineCore
from ninfer.engine.speculative.proposal_head import ProposalHead
from ninfer.models.vision_loader import load_vision_tower
from ninfer.testing.oracle_drafter import TableOracleDrafter
from ninfer.testing.tiny_artifacts import make_tiny_qwen3_5
from tests.engine.test_engine_vision import png, prompt_with
from tests.gpu.test_verify_graphs import _count_rounds, _run, _run_alone

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GREEDY = SamplingParams(temperature=0.0)
EARLIER_ANSWER = list(range(3000, 3016))  # the first turn's answer in the conversation's prompt
REPLY = [2100, 2101, 2102]
NUM_TABLE_SLOTS = 64  # table rows: more than the engine's state slots


@functools.cache
def _vl(root: str, dtype: str):
    artifact = open_artifact(str(make_tiny_qwen3_5(root, mtp=True, vision=True, dtype=dtype)))
    torch_dtype = getattr(torch, dtype)
    model = artifact.load_model(dtype=torch_dtype, device="cuda")
    return artifact, model, load_vision_tower(artifact, "cuda", torch_dtype)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("spec-vl-gpu"))


def _engine(root: str, dtype: str = "bfloat16", drafter=None, **overrides) -> EngineCore:
    artifact, model, tower = _vl(root, dtype)
    config = dict(max_concurrency=3, max_context=512, prefill_chunk=64, mixed_prefill_chunk=16, prefix_reuse=False,
                  spec="mtp", draft_tokens=3, decode_overlap=False, adaptive_drafts=False, device="cuda")
    return EngineCore(model, artifact.tokenizer, EngineConfig(**{**config, **overrides}), drafter=drafter,
                      vision_tower=tower)


def _prompts() -> dict[str, tuple[list[int], list]]:
    ids, media = prompt_with([(png(11), 4)], text=[1000, 1001], tail=[2000, 2001])
    return {"image": (ids, media), "later": (ids + EARLIER_ANSWER + REPLY, media)}


def _requests() -> dict[int, list[EngineRequest]]:
    prompts = _prompts()
    return {
        0: [EngineRequest(rid, ids, GREEDY, max_new_tokens=40, media=media) for rid, (ids, media) in prompts.items()],
        4: [EngineRequest("text", list(range(5000, 5060)), GREEDY, max_new_tokens=27)],
    }


def test_verify_graph_rounds_with_media_equal_eager_rounds_bit_for_bit(root) -> None:
    graphed = _engine(root)
    rounds = _count_rounds(graphed)
    eager = _engine(root, cuda_graphs=False)
    assert eager.runner.verify_graphs is None
    tokens = _run(graphed, _requests(), lockstep=eager)
    assert {1, 2, 3} <= set(rounds), rounds
    assert all(len(t) > 10 for t in tokens.values())


def test_speculative_greedy_with_media_equals_plain_decoding_in_fp32(root) -> None:
    plain = _run(_engine(root, "float32", spec=None, draft_tokens=None), _requests())
    core = _engine(root, "float32")
    rounds = _count_rounds(core)
    spec = _run(core, _requests())
    assert rounds
    assert spec == plain


@pytest.mark.parametrize("rid", ["image", "later"])
def test_the_table_oracle_is_accepted_in_full_through_the_graphs(root, rid) -> None:
    """The continuation comes from the speculative engine itself (its verification path's greedy
    tokens; plain decoding runs other kernels), then the table oracle proposes it."""
    artifact, model, _ = _vl(root, "bfloat16")
    ids, media = _prompts()[rid]
    arrivals = {0: [EngineRequest(rid, ids, GREEDY, max_new_tokens=60, media=media)]}
    expected = _run(_engine(root), arrivals)[rid]
    table = torch.tensor(ids + expected, device="cuda").expand(NUM_TABLE_SLOTS, -1).contiguous()
    head = ProposalHead(model.lm_head, artifact.tokenizer.vocab_size, reduced=False)
    core = _engine(root, drafter=TableOracleDrafter(model, head, 3, table))
    rounds = _count_rounds(core)
    finals, counters = _run_alone(core, arrivals[0][0])
    assert finals == expected
    assert counters.accepted_tokens == counters.drafted_tokens > 0
    # Four tokens a round once drafting starts: 60 tokens in about 15 rounds, not 60.
    assert 14 <= len(rounds) <= 17, rounds
