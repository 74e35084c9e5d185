"""ProposalHead: the reduced vocabulary's rows of the target's lm_head, in the model's dtype or
(--draft-fp8) in FP8 per row, scoring drafts only."""

from __future__ import annotations

import torch

from ninfer.engine.speculative.proposal_head import PROPOSAL_VOCAB, ProposalHead


def _lm_head(vocab: int, hidden: int) -> torch.nn.Linear:
    head = torch.nn.Linear(hidden, vocab, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(0)) * hidden**-0.5)
    return head


def test_fp8_rows_score_as_the_plain_ones_within_e4m3_rounding() -> None:
    vocab, hidden = PROPOSAL_VOCAB + 64, 64
    lm_head = _lm_head(vocab, hidden)
    added = [vocab - 3, vocab - 1]  # chat markers past the reduced range stay proposable
    plain = ProposalHead(lm_head, vocab, reduced=True, extra_token_ids=added)
    fp8 = ProposalHead(lm_head, vocab, reduced=True, extra_token_ids=added, fp8=True)
    assert fp8.vocab_size == plain.vocab_size == PROPOSAL_VOCAB + 2
    assert torch.equal(fp8.to_vocabulary(torch.tensor([PROPOSAL_VOCAB + 1])), torch.tensor([vocab - 1]))
    rows = plain.vocab_size
    assert plain.weight_bytes == rows * hidden * 4 and fp8.weight_bytes == rows * hidden + rows * 4  # codes, row scales
    x = torch.randn(6, hidden, generator=torch.Generator().manual_seed(1))
    want, got = plain.logits(x), fp8.logits(x)
    assert got.dtype == torch.float32 and got.shape == want.shape
    # e4m3 keeps 4 significant bits: each weight within 2^-4 of itself relative, the sums alike.
    error = (got - want).norm(dim=-1) / want.norm(dim=-1)
    assert (error < 2**-4).all(), error
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.5


def test_without_the_reduced_vocabulary_fp8_leaves_the_lm_head_alone() -> None:
    lm_head = _lm_head(100, 32)
    head = ProposalHead(lm_head, 90, reduced=True, fp8=True)  # 100 ids: nothing to reduce
    assert head.fp8 is None and head.weight is None
    logits = head.logits(torch.randn(2, 32))
    assert torch.isinf(logits[:, 90:]).all() and torch.isfinite(logits[:, :90]).all()
