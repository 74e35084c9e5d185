"""Sampler: greedy exactness, filter sets against a brute-force reference, the sampled
distribution, and per-request reproducibility whatever the batch around the request."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch
from msgspec.structs import replace

from ninfer.contract.sampling import TOP_K_CAP, SamplingParams
from ninfer.contract.sampling import fresh_seed
from ninfer.engine.sampler import Sampler, SamplingBatch, exponential_noise

SAMPLER = Sampler()


def sample(logits: torch.Tensor, params: list[SamplingParams], histories=None, num_generated=None) -> list[int]:
    histories = histories if histories is not None else [[] for _ in params]
    batch = SamplingBatch.build(params, histories, logits.device, num_generated=num_generated)
    out = SAMPLER.sample(logits, batch)
    assert out.dtype == torch.int64 and out.shape == (len(params),)
    return out.tolist()


def random_logits(num_rows: int, vocab: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, vocab, generator=gen) * scale


def reference_distribution(row: np.ndarray, p: SamplingParams) -> dict[int, float]:
    """Brute force in float64: {token: probability} after top-k, temperature, min_p, top_p."""
    order = sorted(range(len(row)), key=lambda v: -row[v])[: p.effective_top_k]
    scaled = np.array([row[v] / p.temperature for v in order], dtype=np.float64)
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    kept = []
    mass = 0.0
    for rank, (token, prob) in enumerate(zip(order, probs)):
        if rank == 0 or (prob >= p.min_p * probs[0] and (p.top_p >= 1.0 or mass < p.top_p)):
            kept.append((token, prob))
        mass += prob
    total = sum(prob for _, prob in kept)
    return {token: prob / total for token, prob in kept}


def penalised(row: torch.Tensor, history: list[int], presence: float, frequency: float) -> torch.Tensor:
    out = row.double().clone()
    for token, count in Counter(history).items():
        out[token] -= presence + frequency * count
    return out


def test_greedy_equals_argmax_with_and_without_penalties() -> None:
    logits = random_logits(6, 300, seed=1).to(torch.bfloat16)
    plain = [SamplingParams(temperature=0.0) for _ in range(6)]
    assert sample(logits, plain) == logits.argmax(-1).tolist()

    histories = [[], [int(logits[1].argmax())] * 3, list(range(0, 300, 2)), [5, 5, 7], [1], []]
    params = [
        SamplingParams(temperature=0.0, presence_penalty=pp, frequency_penalty=fp)
        for pp, fp in [(0.0, 0.0), (0.5, 1.0), (2.0, 0.0), (0.0, 1.5), (-1.0, 0.0), (1.0, 1.0)]
    ]
    expected = [
        int(penalised(logits[i].float(), histories[i], p.presence_penalty, p.frequency_penalty).argmax())
        for i, p in enumerate(params)
    ]
    assert sample(logits, params, histories) == expected


def test_top_k_one_equals_greedy_for_every_seed() -> None:
    logits = random_logits(1, 500, seed=2).expand(64, 500).contiguous()
    params = [SamplingParams(temperature=1.3, top_k=1, seed=s) for s in range(64)]
    assert set(sample(logits, params)) == {int(logits[0].argmax())}


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "min_p"),
    [
        (1.0, 0, 1.0, 0.0),
        (1.0, 3, 1.0, 0.0),
        (0.7, 20, 0.5, 0.0),
        (1.5, 0, 1.0, 0.1),
        (1.0, 8, 0.8, 0.05),
        (2.0, 5, 0.0, 0.0),
        (0.5, 0, 0.95, 0.3),
    ],
)
def test_every_sampled_token_lies_in_the_reference_set(
    temperature: float, top_k: int, top_p: float, min_p: float
) -> None:
    vocab, draws = 200, 300
    logits = random_logits(1, vocab, seed=3, scale=1.5)
    base = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    allowed = reference_distribution(logits[0].double().numpy(), base)
    params = [replace(base, seed=seed) for seed in range(draws)]
    tokens = sample(logits.expand(draws, vocab).contiguous(), params)
    assert set(tokens) <= set(allowed)
    assert len(allowed) <= (top_k or TOP_K_CAP)
    # Draws reach beyond the top candidate whenever the reference set does.
    assert (len(set(tokens)) > 1) == (len(allowed) > 1)


def chi_square(counts: Counter, expected: dict[int, float], draws: int) -> float:
    return sum((counts.get(t, 0) - draws * q) ** 2 / (draws * q) for t, q in expected.items())


def test_empirical_distribution_matches_the_renormalised_reference() -> None:
    vocab, draws = 16, 20_000
    logits = random_logits(1, vocab, seed=4, scale=1.0)
    base = SamplingParams(temperature=0.8, top_k=10, top_p=0.9, min_p=0.05)
    expected = reference_distribution(logits[0].double().numpy(), base)
    assert 3 <= len(expected) < 10  # both top_p and top_k/min_p bite on this row
    # Half the draws vary the seed, half the RNG position of one seed.
    params = [replace(base, seed=s) for s in range(draws // 2)]
    params += [replace(base, seed=-77) for _ in range(draws // 2)]
    positions = [0] * (draws // 2) + list(range(draws // 2))
    tokens = sample(logits.expand(draws, vocab).contiguous(), params, num_generated=positions)
    counts = Counter(tokens)
    assert set(counts) <= set(expected)
    dof = len(expected) - 1
    bound = dof + 6 * math.sqrt(2 * dof)  # about six standard deviations of chi-square(dof)
    assert chi_square(counts, expected, draws) < bound
    # The test can tell distributions apart: the untempered reference is rejected.
    untempered_params = replace(base, temperature=1.0)
    untempered = reference_distribution(logits[0].double().numpy(), untempered_params)
    common = {t: q for t, q in untempered.items() if t in expected}
    assert chi_square(counts, {t: q / sum(common.values()) for t, q in common.items()}, draws) > 5 * bound


def test_lower_temperature_sharpens() -> None:
    vocab, draws = 20, 4000
    logits = random_logits(1, vocab, seed=5, scale=1.0)
    top = int(logits[0].argmax())
    share = []
    for temperature in (2.0, 1.0, 0.3):
        params = [SamplingParams(temperature=temperature, seed=s) for s in range(draws)]
        tokens = sample(logits.expand(draws, vocab).contiguous(), params)
        share.append(tokens.count(top) / draws)
        expected = reference_distribution(logits[0].double().numpy(), params[0])[top]
        assert abs(share[-1] - expected) < 5 * math.sqrt(expected * (1 - expected) / draws)
    assert share[0] < share[1] < share[2]


def test_same_seed_and_position_give_the_same_token_whatever_the_batch() -> None:
    vocab = 64
    logits = random_logits(3, vocab, seed=6, scale=0.5)  # flat: many candidates compete
    a, x, y = logits[0], logits[1], logits[2]
    others = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.2, top_k=2, seed=9)]
    for seed in range(-20, 20):
        pa = SamplingParams(temperature=1.0, top_p=0.95, presence_penalty=0.3, seed=seed)
        history = [1, 2, 3, seed % vocab]
        alone = sample(a[None], [pa], [history])[0]
        mixed = sample(torch.stack([x, a, y]), [others[0], pa, others[1]], [[], history, [4]])[1]
        reordered = sample(torch.stack([y, x, a]), [others[1], others[0], pa], [[4], [], history])[2]
        assert alone == mixed == reordered
        # The RNG position is the generated count: same count, same draw, even with other history.
        assert sample(a[None], [pa], [history[::-1]])[0] == alone


def test_different_seeds_and_positions_draw_differently() -> None:
    vocab, rows = 20, 200
    flat = torch.zeros(rows, vocab)  # uniform over the 20 candidates
    by_seed = sample(flat, [SamplingParams(seed=s) for s in range(rows)])
    by_position = sample(flat, [SamplingParams(seed=123)] * rows, num_generated=list(range(rows)))
    for tokens in (by_seed, by_position):
        assert len(set(tokens)) == vocab  # 200 uniform draws over 20 tokens hit them all
        assert max(Counter(tokens).values()) < 30


def test_penalties_change_the_choice_as_expected() -> None:
    logits = torch.tensor([[5.0, 4.9, 4.0, 0.0]])
    greedy = SamplingParams(temperature=0.0)
    assert sample(logits, [greedy], [[0]]) == [0]
    assert sample(logits, [SamplingParams(temperature=0.0, presence_penalty=0.5)], [[0]]) == [1]
    # Frequency scales with the count: once (0.05) is not enough, three times (0.15) is.
    freq = SamplingParams(temperature=0.0, frequency_penalty=0.05)
    assert sample(logits, [freq], [[0]]) == [0]
    assert sample(logits, [freq], [[0, 0, 0]]) == [1]
    # Negative presence favours seen tokens.
    assert sample(logits, [SamplingParams(temperature=0.0, presence_penalty=-2.0)], [[2]]) == [2]
    # Sampled rows see the penalty too: with top_k=1 the penalised winner is forced.
    assert sample(logits, [SamplingParams(top_k=1, presence_penalty=0.5, seed=1)], [[0]]) == [1]


def test_negative_and_large_seeds_are_valid_and_distinct_streams() -> None:
    for seed in (-1, -(2**63), 2**63 - 1, 2**64 + 5, -5, 5):
        noise = exponential_noise(seed, 0)
        assert noise.shape == (TOP_K_CAP,) and np.all(np.isfinite(noise)) and np.all(noise > 0)
        assert np.array_equal(noise, exponential_noise(seed, 0))
    assert not np.array_equal(exponential_noise(-5, 0), exponential_noise(5, 0))
    assert not np.array_equal(exponential_noise(5, 0), exponential_noise(5, 1))
    logits = random_logits(1, 50, seed=7, scale=0.3)
    first = sample(logits, [SamplingParams(seed=-(2**63))])
    assert first == sample(logits, [SamplingParams(seed=-(2**63))])


def test_fresh_seed_fits_a_signed_64_bit_field() -> None:
    seeds = {fresh_seed() for _ in range(100)}
    assert len(seeds) == 100 and all(0 <= s < 2**63 for s in seeds)


def test_mixed_batch_keeps_greedy_rows_exact_and_small_vocab_works() -> None:
    logits = random_logits(4, 7, seed=8)  # fewer tokens than the top-k cap
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, seed=3),
        SamplingParams(temperature=0.0, frequency_penalty=10.0),
        SamplingParams(temperature=0.5, top_k=0, seed=4),
    ]
    histories = [[], [], [int(logits[2].argmax())], []]
    tokens = sample(logits, params, histories)
    assert tokens[0] == int(logits[0].argmax())
    assert tokens[2] == int(penalised(logits[2], histories[2], 0.0, 10.0).argmax())
    assert all(0 <= t < 7 for t in tokens)


def test_a_sampled_row_without_a_seed_is_rejected() -> None:
    with pytest.raises(ValueError, match="seed"):
        SamplingBatch.build([SamplingParams(temperature=1.0)], [[]])
    SamplingBatch.build([SamplingParams(temperature=0.0)], [[]])  # greedy rows need none


def bitmask(allowed: list[int], vocab: int) -> np.ndarray:
    mask = np.zeros(-(-vocab // 32), dtype=np.uint32)
    for token in allowed:
        mask[token // 32] |= np.uint32(1 << (token % 32))
    return mask.view(np.int32)


def test_a_token_bitmask_restricts_greedy_sampled_and_penalised_rows_to_its_tokens():
    vocab = 300
    logits = random_logits(4, vocab, seed=7)
    allowed = [3, 77, 290]
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=5),
              SamplingParams(temperature=0.7, seed=9, presence_penalty=1.0), SamplingParams(temperature=0.0)]
    masks = [bitmask(allowed, vocab), bitmask(allowed, vocab), bitmask(allowed, vocab), None]
    for position in range(20):
        batch = SamplingBatch.build(params, [[3, 77]] * 4, num_generated=[position] * 4, token_bitmasks=masks)
        ids = SAMPLER.sample(logits, batch).tolist()
        assert all(token in allowed for token in ids[:3]), ids
        assert ids[3] == int(logits[3].argmax())  # the unconstrained row is untouched
        assert ids[0] == max(allowed, key=lambda t: float(logits[0, t]))
    masked = Sampler.apply_token_bitmask(logits[:1], torch.from_numpy(bitmask(allowed, vocab))[None])
    assert torch.isfinite(masked).nonzero()[:, 1].tolist() == allowed
    chosen, top_ids, top_values = Sampler.token_logprobs(masked, torch.tensor([77]), 5)
    reference = torch.log_softmax(logits[0, allowed].double(), -1)
    assert float(chosen[0]) == pytest.approx(float(reference[1]), abs=1e-5)
    assert sorted(top_ids[0, :3].tolist()) == allowed and torch.isinf(top_values[0, 3:]).all()
