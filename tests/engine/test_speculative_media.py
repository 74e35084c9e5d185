"""Speculative decoding of requests with media on the tiny random VL artifact with an MTP head
(fp32, CPU): an image prompt and a second turn whose conversation holds that image draft like
text-only requests and decode exactly as plain decoding does, with the random MTP head (drafts
mostly rejected), the table oracle (every draft accepted), the verify graphs' static layout
(run uncaptured) and a DFlash drafter. The MTP head runs at the target's MRoPE positions: the
prompt's three axes over the prompt, index plus rope offset after it."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from ninfer.artifact import open_artifact
from ninfer.artifact.draft_companion import open_draft_companion
from ninfer.config import EngineConfig
from ninfer.contract.request import EngineRequest
from ninfer.contract.sampling import SamplingParams
from ninfer.engine.core import EngineCore
from ninfer.engine.sequence import Sequence
from ninfer.engine.speculative.proposal_head import ProposalHead
from ninfer.models.vision_loader import load_vision_tower
from ninfer.testing.oracle_drafter import TableOracleDrafter
from ninfer.testing.tiny_artifacts import make_tiny_qwen3_5
from ninfer.testing.tiny_dflash import make_tiny_dflash
from tests.engine.test_engine_generation import run_engine
from tests.engine.test_engine_vision import png, prompt_with
from tests.engine.test_verify_graphs import with_uncaptured_graphs

MAX_NEW = 24
REPLY = [2100, 2101, 2102]  # the user's next message after the first answer
CONFIG = dict(max_concurrency=3, max_context=512, prefill_chunk=64, mixed_prefill_chunk=16)
SPEC = dict(spec="mtp", draft_tokens=3, adaptive_drafts=False)
NUM_TABLE_SLOTS = 64  # table rows: more than the engine's state slots


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("spec-vl"))


@functools.cache
def _vl(root: str):
    path = make_tiny_qwen3_5(root, mtp=True, vision=True, dtype="float32")
    artifact = open_artifact(str(path))
    model = artifact.load_model(dtype=torch.float32, device="cpu")
    return path, artifact, model, load_vision_tower(artifact, "cpu", torch.float32)


def engine(root: str, drafter=None, draft_model=None, **overrides) -> EngineCore:
    _, artifact, model, tower = _vl(root)
    return EngineCore(model, artifact.tokenizer, EngineConfig(**{**CONFIG, **overrides}), vision_tower=tower,
                      drafter=drafter, draft_model=draft_model)


def image_prompt():
    return prompt_with([(png(11), 4)], text=[1000, 1001], tail=[2000, 2001])


def request(rid: str, ids, media) -> EngineRequest:
    return EngineRequest(rid, ids, SamplingParams(temperature=0.0), max_new_tokens=MAX_NEW, media=media)


def conversation(core: EngineCore) -> dict[str, tuple[list[int], object]]:
    """Turn 1: the image prompt; turn 2: turn 1, its answer and the user's reply (the image in an
    earlier turn, its prefix reused from turn 1's checkpoint)."""
    ids, media = image_prompt()
    first = run_engine(core, {0: [request("turn1", ids, media)]})
    second = run_engine(core, {0: [request("turn2", ids + first["turn1"][0] + REPLY, media)]})
    return {**first, **second}


@functools.cache
def _plain(root: str) -> dict[str, list[int]]:
    return {rid: tokens for rid, (tokens, _) in conversation(engine(root)).items()}


def assert_drafted(final, accepted_all: bool = False) -> None:
    counters = final.speculative
    assert counters is not None and counters.rounds > 0 and counters.drafted_tokens > 0, counters
    if accepted_all:
        assert counters.accepted_tokens == counters.drafted_tokens, counters


def test_an_image_conversation_drafts_with_the_mtp_head_and_equals_plain_decoding(root) -> None:
    core = engine(root, **SPEC)
    got = conversation(core)
    assert {rid: tokens for rid, (tokens, _) in got.items()} == _plain(root)
    for rid, (tokens, final) in got.items():
        assert len(tokens) == MAX_NEW
        assert_drafted(final)
    assert got["turn2"][1].cached_tokens > 0  # the second turn reused the prefix through the image
    assert core.pool_accounting()["running"] == 0


@pytest.mark.parametrize("layout", ["eager", "graphs"])
def test_the_table_oracle_is_accepted_in_full_in_both_turns(root, layout) -> None:
    """Every draft accepted: the rounds verify at the request's MRoPE positions, or the target's
    tokens would differ from the table (plain decoding's continuation). graphs: the verify
    graphs' static buffers (regions run uncaptured) carry the positions."""
    _, artifact, model, _ = _vl(root)
    ids, media = image_prompt()
    plain = _plain(root)
    second = ids + plain["turn1"] + REPLY
    head = ProposalHead(model.lm_head, artifact.tokenizer.vocab_size, reduced=False)
    for rid, prompt in (("turn1", ids), ("turn2", second)):
        table = torch.tensor(prompt + plain[rid]).expand(NUM_TABLE_SLOTS, -1).contiguous()
        core = engine(root, drafter=TableOracleDrafter(model, head, 3, table), prefix_reuse=False, **SPEC)
        rounds = with_uncaptured_graphs(core) if layout == "graphs" else None
        tokens, final = run_engine(core, {0: [request(rid, prompt, media)]})[rid]
        assert tokens == plain[rid]
        assert_drafted(final, accepted_all=True)
        # Four tokens a round once drafting starts, not one.
        assert final.speculative.rounds <= -(-(MAX_NEW - 1) // 4) + 1, final.speculative
        assert rounds is None or len(rounds) >= final.speculative.rounds - 1, rounds


def test_rounds_through_the_verify_graph_layout_equal_plain_decoding(root) -> None:
    """The verify graphs' static buffers (regions run uncaptured) carry the rope offset."""
    core = engine(root, **SPEC)
    rounds = with_uncaptured_graphs(core)
    got = conversation(core)
    assert {rid: tokens for rid, (tokens, _) in got.items()} == _plain(root)
    assert len(rounds) >= 5, rounds
    for _, final in got.values():
        assert_drafted(final)


@pytest.mark.parametrize("layout", ["eager", "graphs"])
def test_the_mtp_head_runs_at_the_targets_mrope_positions(root, layout) -> None:
    """Every row of the head's passes (over the prompt, over verification rows and its own
    decode rows) sits at a position the target gives that request: a column of the prompt's
    three-axis positions, or index + rope offset on every axis after it."""
    _, _, model, _ = _vl(root)
    ids, media = image_prompt()
    seq = Sequence(request("r", ids, media), MAX_NEW, SamplingParams(temperature=0.0), None, None)
    assert seq.rope_offset <= -(MAX_NEW + 8)  # text positions would fall outside the valid ones below
    prompt_columns = {tuple(column) for column in seq.rope_positions.T.tolist()}
    later = {(p, p, p) for p in range(len(ids) + seq.rope_offset, len(ids) + seq.rope_offset + MAX_NEW + 8)}
    seen: list[np.ndarray] = []
    forward_mtp = model.forward_mtp

    def recording(tokens, hidden, batch, step_index):
        seen.append(batch.positions.numpy().copy())
        return forward_mtp(tokens, hidden, batch, step_index=step_index)

    model.forward_mtp = recording
    try:
        core = engine(root, **SPEC)
        if layout == "graphs":
            with_uncaptured_graphs(core)
        tokens, final = run_engine(core, {0: [request("r", ids, media)]})["r"]
    finally:
        del model.forward_mtp
    assert tokens == _plain(root)["turn1"]
    assert_drafted(final)
    columns = {tuple(column) for positions in seen for column in positions.T.tolist()}
    assert prompt_columns <= columns  # the prompt pass saw the image's positions
    assert columns <= prompt_columns | later, sorted(columns - prompt_columns - later)[:5]


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_a_dflash_drafter_drafts_an_image_conversation_and_equals_plain_decoding(root, kind) -> None:
    path = _vl(root)[0]
    make_tiny_dflash(path, kind)
    draft_model = open_draft_companion(path, kind).load_model(torch.float32)
    got = conversation(engine(root, draft_model=draft_model, **{**SPEC, "spec": kind}))
    assert {rid: tokens for rid, (tokens, _) in got.items()} == _plain(root)
    for _, final in got.values():
        assert_drafted(final)


def test_the_dflash_drafter_runs_at_the_targets_temporal_positions(root) -> None:
    """The drafter's one-axis RoPE: its context rows at the target's temporal positions, and its
    blocks after the prompt at index + rope offset, the positions those tokens take as context."""
    path = _vl(root)[0]
    make_tiny_dflash(path, "dflash")
    draft_model = open_draft_companion(path, "dflash").load_model(torch.float32)
    ids, media = image_prompt()
    seq = Sequence(request("r", ids, media), MAX_NEW, SamplingParams(temperature=0.0), None, None)
    prompt_positions = set(seq.rope_positions[0].tolist())
    later = set(range(len(ids) + seq.rope_offset, len(ids) + seq.rope_offset + MAX_NEW + 8))
    context, blocks = [], []
    store_context, forward = draft_model.store_context, draft_model.forward

    def recording_context(aux_hidden, positions, kv_cache, slot_mapping):
        context.extend(positions.tolist())
        return store_context(aux_hidden, positions, kv_cache, slot_mapping)

    def recording_forward(embeds, block, kv_cache):
        blocks.extend(block.rope_positions.tolist())
        return forward(embeds, block, kv_cache)

    draft_model.store_context, draft_model.forward = recording_context, recording_forward
    core = engine(root, draft_model=draft_model, **{**SPEC, "spec": "dflash"})
    tokens, final = run_engine(core, {0: [request("r", ids, media)]})["r"]
    assert tokens == _plain(root)["turn1"]
    assert_drafted(final)
    assert prompt_positions <= set(context) <= prompt_positions | later
    assert blocks and set(blocks) <= later, sorted(set(blocks) - later)[:5]
