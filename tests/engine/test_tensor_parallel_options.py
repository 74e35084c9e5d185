"""--tensor-parallel N combined with the engine's other parts, through the real engine over gloo
(rank 0 in this process, followers in their own): quantized checkpoints kept as stored, a
`.ninfer` container, MTP and DFlash speculation, image requests. Each equals one process token for token (greedy)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ninfer.artifact.packer import pack
from ninfer.engine.core import EngineCore
from ninfer.models.quant.fp8 import Fp8Linear
from ninfer.models.quant.fp8_experts import Fp8Experts
from ninfer.models.quant.nvfp4 import Nvfp4Linear
from ninfer.testing.oracle_drafter import TableOracleDrafter
from ninfer.testing.tiny_artifacts import make_tiny_qwen3_5
from ninfer.testing.tiny_dflash import make_tiny_dflash
from ninfer.testing.tiny_quantized import modelopt_nvfp4_copy, qwen_fp8_copy
from tests.engine.test_engine_generation import PROMPTS, greedy, run_engine
from tests.engine.test_tensor_parallel import artifacts, build  # noqa: F401 - artifacts is a fixture

# Each case starts follower processes (a few seconds each on 2 CPUs).
pytestmark = pytest.mark.slow


@pytest.mark.parametrize("arch, stored", [("qwen3_5", "fp8"), ("llama", "nvfp4")])
def test_a_quantized_checkpoint_kept_as_stored_equals_one_process(artifacts, tmp_path, arch, stored):
    """Qwen's block FP8 / ModelOpt's NVFP4, kept in their format (--quantize names it: on the CPU
    they would be dequantized at load otherwise): each rank holds its share of the stored bits."""
    copy = {"fp8": qwen_fp8_copy, "nvfp4": modelopt_nvfp4_copy}[stored]
    checkpoint = str(copy(Path(artifacts[arch]), tmp_path / stored))
    layer = {"fp8": Fp8Linear, "nvfp4": Nvfp4Linear}[stored]
    assert_ranks_agree(checkpoint, lambda core: isinstance(core.runner.model.model.layers[0].mlp.down_proj, layer),
                       quantize=stored)  # fmt: skip


def assert_ranks_agree(artifact: str, holds, **options) -> None:
    """One process and two ranks, both `holds`-ing, decode the same greedy tokens for two requests."""
    cores = [build(artifact, size, **options) for size in (1, 2)]
    try:
        assert all(holds(core) for core in cores)
        runs = [run_engine(core, {0: [greedy("a", PROMPTS[0], 12)], 2: [greedy("b", PROMPTS[1], 12)]}) for core in cores]
    finally:
        cores[1].close()
    one, two = ({rid: tokens for rid, (tokens, _) in run.items()} for run in runs)
    assert two == one and all(len(tokens) == 12 for tokens in one.values())


def test_a_container_equals_one_process(artifacts, tmp_path):
    """A `ninfer pack --weights fp8` container (per-channel FP8 layers and experts, saved whole):
    each rank loads its part of the saved tensors, codes and scales as saved."""
    container = str(tmp_path / "qwen3_5_moe-fp8.ninfer")
    pack(artifacts["qwen3_5_moe"], container, weights="fp8", progress=False)
    assert_ranks_agree(container, lambda core: isinstance(core.runner.model.model.layers[0].mlp.experts, Fp8Experts))


def test_mtp_speculation_equals_one_process(tmp_path):
    """--spec mtp over 2 ranks: the MTP head's layer splits like the trunk's, every rank verifies
    the drafts of rank 0's step plan and commits what rank 0's scheduler keeps. Rank 0's head
    runs whole, its proposals then replaced by plain decoding's continuation (TableOracleDrafter:
    a random head's drafts are all rejected), so every draft is accepted and rounds commit 3 rows."""
    artifact = str(make_tiny_qwen3_5(tmp_path, mtp=True, dtype="float32"))
    requests = [greedy("a", PROMPTS[0], 16), greedy("b", PROMPTS[1], 16)]
    one = build(artifact, 1)
    plain = {r.request_id: run_engine(one, {0: [r]})[r.request_id][0] for r in requests}
    # The head's own drafts, split over 2 ranks and whole, are the same tokens.
    drafts = []
    for core in (build(artifact, 1, spec="mtp", draft_tokens=2), build(artifact, 2, spec="mtp", draft_tokens=2)):
        drafts.append(record_drafts(core))
        got = run_engine(core, {0: requests[:1], 2: requests[1:]})
        assert {rid: tokens for rid, (tokens, _) in got.items()} == plain
    core.close()
    assert drafts[0] == drafts[1] and len(drafts[0]) >= 3  # then adaptive drafting stops: all rejected
    core = build(artifact, 2, spec="mtp", draft_tokens=2)
    try:
        speculator = core.runner.speculator
        num_slots = speculator.slot_hidden.shape[0]
        for request in requests:
            table = torch.tensor(request.prompt_token_ids + plain[request.request_id]).expand(num_slots, -1).contiguous()
            speculator.drafter = TableOracleDrafter(core.runner.model, speculator.drafter.head, 2, table)
            tokens, final = run_engine(core, {0: [request]})[request.request_id]
            assert tokens == plain[request.request_id]
            counters = final.speculative
            assert counters.rounds > 0 and counters.accepted_tokens == counters.drafted_tokens > 0, counters
    finally:
        core.close()


@pytest.mark.parametrize("kind", ["dflash"])  # DFlash2 takes the same path over the ranks
def test_dflash_speculation_equals_one_process(tmp_path, kind):
    """A DFlash drafter runs whole on every rank (each follower loads its own) and reads the
    target's residual streams, whole after each block's all-reduce: its drafts over 2 ranks are
    one process's, and the output is plain decoding's."""
    artifact = make_tiny_qwen3_5(tmp_path, dtype="float32")
    make_tiny_dflash(artifact, kind)
    requests = [greedy("a", PROMPTS[0], 12), greedy("b", PROMPTS[1], 12)]
    plain = {r.request_id: run_engine(build(str(artifact), 1), {0: [r]})[r.request_id][0] for r in requests}
    drafts = []
    for size in (1, 2):
        core = build(str(artifact), size, spec=kind, draft_tokens=2)
        try:
            drafts.append(record_drafts(core))
            got = run_engine(core, {0: requests[:1], 2: requests[1:]})
        finally:
            core.close()
        assert {rid: tokens for rid, (tokens, _) in got.items()} == plain
    assert drafts[0] == drafts[1] and drafts[0]


def test_image_requests_equal_one_process(tmp_path):
    """--vision over 2 ranks: every rank encodes the step plan's media with its own whole tower;
    an image prompt, then a second turn reusing its prefix through the image, as one process."""
    from tests.engine.test_speculative_media import REPLY, image_prompt, request

    artifact = str(make_tiny_qwen3_5(tmp_path, vision=True, dtype="float32"))
    ids, media = image_prompt()
    outputs = []
    for size in (1, 2):
        core = build(artifact, size, vision=True)
        try:
            first, _ = run_engine(core, {0: [request("turn1", ids, media)]})["turn1"]
            second, final = run_engine(core, {0: [request("turn2", ids + first + REPLY, media)]})["turn2"]
        finally:
            core.close()
        assert final.cached_tokens > 0  # the second turn resumed past the image on every rank
        outputs.append((first, second))
    assert outputs[1] == outputs[0] and all(outputs[0])


def record_drafts(core: EngineCore) -> list[list[int]]:
    """The drafts rank 0's drafter proposes, a list per call, as the engine runs."""
    drafter, calls = core.runner.speculator.drafter, []
    draft = drafter.draft

    def recorded(round):
        proposal = draft(round)
        if proposal is not None:
            calls.append(proposal.token_ids.tolist())
        return proposal

    drafter.draft = recorded
    return calls
