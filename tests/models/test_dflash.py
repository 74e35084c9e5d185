"""DFlash / DFlash2 drafter model: one drafting block through the paged KV equals the plain torch
reference of the published algorithm (tests/models/dflash_reference.py) on the tiny random
companions: context stored in chunks across non-contiguous pages, two requests of different
context lengths past the sliding window, stale K/V past each block's start, every block length
the engine uses; the grouped dynamic convolution and the selector's scores against their formulas."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from ninfer.artifact.draft_companion import open_draft_companion
from ninfer.models.dflash import DraftBlock
from ninfer.models.layers.candidate_selector import CandidateSelector
from ninfer.models.layers.grouped_conv import GroupedDynamicConv
from ninfer.testing.tiny_artifacts import make_tiny_qwen3_5
from ninfer.testing.tiny_dflash import make_tiny_dflash
from tests.models import dflash_reference as reference

ATOL = 1e-4
PAGE_SIZE = 4


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    return make_tiny_qwen3_5(str(tmp_path_factory.mktemp("dflash-model")), dtype="float32")


def _companion(artifact, kind: str):
    directory = make_tiny_dflash(artifact, kind)
    config = json.loads((directory / "config.json").read_text())
    model = open_draft_companion(artifact, kind).load_model(torch.float32)
    return model, config, load_file(directory / "model.safetensors")


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
@pytest.mark.parametrize("block_len", [2, 5, 16])
@torch.inference_mode()
def test_a_block_through_the_paged_kv_equals_the_reference(artifact, kind: str, block_len: int) -> None:
    model, config, tensors = _companion(artifact, kind)
    generator = torch.Generator().manual_seed(block_len)
    hidden = config["hidden_size"]
    num_streams = len(config["dflash_config"]["target_layer_ids"])
    context_lens = [13, 22]  # both past the sliding window of 6
    pages_per_request = -(-(max(context_lens) + block_len) // PAGE_SIZE)
    num_pages = 2 * pages_per_request + 3
    kv = model.allocate_kv(num_pages, PAGE_SIZE)
    order = torch.randperm(num_pages, generator=generator)[: 2 * pages_per_request]
    page_table = order.view(2, pages_per_request).to(torch.int32)
    streams = [torch.randn(n, num_streams, hidden, generator=generator) for n in context_lens]

    def slots(request: int, positions: range) -> torch.Tensor:
        pos = torch.tensor(list(positions))
        return page_table[request, pos // PAGE_SIZE].long() * PAGE_SIZE + pos % PAGE_SIZE

    # Context in chunks of both requests (as prompt chunks and verification rows arrive)...
    for (r0, r1) in ((range(0, 9), range(0, 5)), (range(9, 13), range(5, 22))):
        model.store_context(
            torch.cat((streams[0][r0.start : r0.stop], streams[1][r1.start : r1.stop])),
            torch.tensor([*r0, *r1]),
            kv,
            torch.cat((slots(0, r0), slots(1, r1))),
        )
    # ...and stale K/V (rejected rows) past each block's start, which the block must overwrite or ignore.
    for request, start in enumerate(context_lens):
        stale = slots(request, range(start, start + block_len + 2)[: pages_per_request * PAGE_SIZE - start])
        for store in (kv.k, kv.v):
            store.view(store.shape[0], -1, *store.shape[3:])[:, stale] = 7.0

    embeds = torch.randn(2 * block_len, hidden, generator=generator)
    block = DraftBlock.build(
        torch.tensor(context_lens), torch.full((2,), pages_per_request * PAGE_SIZE), page_table, block_len, PAGE_SIZE
    )
    ours = model(embeds, block, kv).view(2, block_len, hidden)
    for request in range(2):
        expected = reference.block_hidden(tensors, config, streams[request], embeds.view(2, block_len, hidden)[request])
        torch.testing.assert_close(ours[request], expected, atol=ATOL, rtol=0)


def test_the_grouped_convolution_equals_its_formula_within_each_block() -> None:
    generator = torch.Generator().manual_seed(0)
    conv = GroupedDynamicConv(hidden_size=32, kernel_size=3, group_size=8)
    with torch.no_grad():
        conv.base_kernel.copy_(torch.randn(conv.base_kernel.shape, generator=generator))
        conv.kernel_projection.weight.copy_(torch.randn(conv.kernel_projection.weight.shape, generator=generator) * 0.2)
    num_blocks, block_len = 3, 5
    x = torch.randn(num_blocks * block_len, 32, generator=generator)
    sublayer = torch.tanh
    with torch.no_grad():
        before, deltas = conv.prepare(x, block_len)
        ours = conv.finish(sublayer(before), deltas, block_len)
        for b in range(num_blocks):
            rows = slice(b * block_len, (b + 1) * block_len)
            d = (x[rows] @ conv.kernel_projection.weight.T).view(block_len, 2, 3, 4)
            expected = reference._conv(sublayer(reference._conv(x[rows], d[:, 0], conv.base_kernel[0], 8)),
                                       d[:, 1], conv.base_kernel[1], 8)
            torch.testing.assert_close(ours[rows], expected, atol=1e-5, rtol=0)


def test_the_selector_scores_each_transition() -> None:
    generator = torch.Generator().manual_seed(1)
    selector = CandidateSelector(hidden_size=16, vocab_size=50, rank=4, top_k=6)
    with torch.no_grad():
        for param in selector.parameters():
            param.copy_(torch.randn(param.shape, generator=generator))
    unary = torch.randn(3, 6, generator=generator)
    candidates = torch.randint(0, 50, (3, 6), generator=generator)
    predecessors = torch.tensor([4, 0, 49])
    projected = torch.randn(3, 4, generator=generator)
    with torch.no_grad():
        got = selector.scores(unary, candidates, predecessors, projected)
    for n in range(3):
        for c in range(6):
            a, b = selector.predecessor_codebook[predecessors[n]], selector.successor_codebook[candidates[n, c]]
            want = unary[n, c] + (a * projected[n] * b).sum()
            torch.testing.assert_close(got[n, c], want.detach(), atol=1e-5, rtol=0)
