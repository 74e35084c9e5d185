"""Speculative acceptance: greedy rows keep exactly the argmax continuation; sampled rows keep
the target distribution (the rejection rule, tested by the joint distribution of two tokens
against a Markov target, with a broken rule as the negative control)."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import torch
from msgspec.structs import replace

from ninfer.contract.sampling import SamplingParams
from ninfer.engine.sampler import Sampler, SamplingBatch
from ninfer.engine.speculative.acceptance import (
    DRAFT_DOMAIN,
    DraftProposal,
    acceptance_uniforms,
    propose,
    verify,
)

GREEDY = SamplingParams(temperature=0.0)


def _batch(params, num_generated, domain=None) -> SamplingBatch:
    kwargs = {"noise_domain": domain} if domain is not None else {}
    return SamplingBatch.build(params, [[] for _ in params], num_generated=num_generated, **kwargs)


def test_greedy_keeps_the_leading_matches_and_the_target_token_after_them() -> None:
    vocab, k = 12, 3
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(2 * (k + 1), vocab, generator=gen)
    argmax = scores.argmax(-1).view(2, k + 1)
    # Request 0: first two drafts right, third wrong; request 1: all right but only 2 considered.
    d0 = [argmax[0, 0].item(), argmax[0, 1].item(), (argmax[0, 2].item() + 1) % vocab]
    d1 = argmax[1, :k].tolist()
    drafts = DraftProposal(torch.tensor([d0, d1]), torch.zeros(2, k, 1), torch.zeros(2, k, 1, dtype=torch.int64))
    params = [GREEDY] * (2 * (k + 1))
    num_accepted, tokens = verify(scores, _batch(params, [0] * len(params)), drafts, torch.tensor([3, 2]),
                                  torch.ones(2, k))
    assert num_accepted.tolist() == [2, 2]
    assert tokens[0, :3].tolist() == [d0[0], d0[1], argmax[0, 2].item()]
    assert tokens[1, :3].tolist() == [d1[0], d1[1], argmax[1, 2].item()]


def _markov(vocab: int, seed: int, scale: float):
    gen = torch.Generator().manual_seed(seed)
    first = torch.randn(vocab, generator=gen) * scale
    second = torch.randn(vocab, vocab, generator=gen) * scale  # second[x1]: logits after x1
    third = torch.randn(vocab, vocab, vocab, generator=gen) * scale
    return first, second, third


def _run_round(params, target, drafter, trials: int, k: int = 2):
    """Draft k tokens from the drafter chain, verify against the target chain -> (x1, x2) per trial
    (x2 drawn from the target after x1 when only one token was emitted: the next round's first)."""
    first, second, third = target
    q_first, q_second, _ = drafter
    generated = [0] * trials
    d1, q1, ids1 = propose(q_first.expand(trials, -1), _batch(params, generated, DRAFT_DOMAIN))
    d2, q2, ids2 = propose(q_second[d1], _batch(params, [1] * trials, DRAFT_DOMAIN))
    drafts = DraftProposal(torch.stack((d1, d2), 1), torch.stack((q1, q2), 1), torch.stack((ids1, ids2), 1))
    scores = torch.stack((first.expand(trials, -1), second[d1], third[d1, d2]), 1).reshape(trials * (k + 1), -1)
    row_params = [p for p in params for _ in range(k + 1)]
    row_generated = [j for _ in params for j in range(k + 1)]
    uniforms = torch.from_numpy(acceptance_uniforms(params, generated, k))
    num_accepted, tokens = verify(scores, _batch(row_params, row_generated), drafts, torch.full((trials,), k),
                                  uniforms)
    x1 = tokens[:, 0]
    # One token emitted: the next round starts after x1 and samples x2 from the target there.
    followers = _batch(params, [1] * trials)
    plain_x2 = Sampler().sample(second[x1], followers)
    x2 = torch.where(num_accepted >= 1, tokens[:, 1], plain_x2)
    return x1, x2, num_accepted


def _joint(first: torch.Tensor, second: torch.Tensor) -> np.ndarray:
    p1 = torch.softmax(first.double(), -1)
    p2 = torch.softmax(second.double(), -1)
    return (p1[:, None] * p2).numpy()


def _chi_square(x1, x2, expected: np.ndarray) -> tuple[float, int]:
    trials = len(x1)
    counts = Counter(zip(x1.tolist(), x2.tolist()))
    stat = 0.0
    cells = 0
    for (a, b), prob in np.ndenumerate(expected):
        if prob * trials >= 5:  # the usual validity floor for a cell
            stat += (counts.get((a, b), 0) - trials * prob) ** 2 / (trials * prob)
            cells += 1
    return stat, cells - 1


def test_sampled_rows_keep_the_target_distribution() -> None:
    vocab, trials = 6, 40_000
    target = _markov(vocab, seed=1, scale=1.0)
    drafter = _markov(vocab, seed=2, scale=1.0)  # a different chain: many rejections
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(trials)]
    x1, x2, num_accepted = _run_round(params, target, drafter, trials)
    assert 0.2 < num_accepted.float().mean().item() < 1.8  # both acceptances and rejections happen
    expected = _joint(target[0], target[1])
    stat, dof = _chi_square(x1, x2, expected)
    bound = dof + 6 * math.sqrt(2 * dof)
    assert stat < bound, (stat, bound)
    # The test tells distributions apart: the drafter's own joint is rejected.
    wrong, _ = _chi_square(x1, x2, _joint(drafter[0], drafter[1]))
    assert wrong > 5 * bound


def test_a_drafter_equal_to_the_target_is_always_accepted() -> None:
    vocab, trials = 6, 2000
    target = _markov(vocab, seed=3, scale=1.0)
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(trials)]
    _, _, num_accepted = _run_round(params, target, target, trials)
    assert num_accepted.min().item() == 2


def test_filters_apply_to_both_sides() -> None:
    """top_k 2: every emitted token is among the target's two best at its position."""
    vocab, trials = 8, 3000
    target = _markov(vocab, seed=4, scale=2.0)
    drafter = _markov(vocab, seed=5, scale=2.0)
    params = [SamplingParams(temperature=0.7, top_k=2, seed=s) for s in range(trials)]
    x1, x2, _ = _run_round(params, target, drafter, trials)
    top_first = set(target[0].topk(2).indices.tolist())
    assert set(x1.tolist()) <= top_first
    for a, b in zip(x1.tolist(), x2.tolist()):
        assert b in set(target[1][a].topk(2).indices.tolist())


def test_a_seeded_round_repeats() -> None:
    vocab, trials = 6, 200
    target, drafter = _markov(vocab, seed=6, scale=1.0), _markov(vocab, seed=7, scale=1.0)
    params = [replace(SamplingParams(temperature=1.0), seed=s) for s in range(trials)]
    first = _run_round(params, target, drafter, trials)
    again = _run_round(params, target, drafter, trials)
    for a, b in zip(first, again):
        assert torch.equal(a, b)
