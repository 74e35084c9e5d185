"""Draft proposals and their verification: which drafted tokens the target keeps.

A round verifies up to K drafted tokens per request. Row j of a request (j = 0..K) holds
the target's scores for the token after its j-th draft (row 0: after the last committed
token), so draft j+1 is judged against row j and the token that follows the accepted drafts
comes from row a, where a is the number of drafts accepted.

Greedy rows accept a draft when it equals the target's argmax, so the output is exactly what
plain decoding gives. Sampled rows use the speculative rejection rule: draft d, proposed
from the drafter's distribution q, is kept with probability min(1, p(d) / q(d)), where p is
the target distribution after the request's temperature, top-k, top-p and min-p (the same
candidates the sampler keeps); at the first rejection the token is drawn from the residual
max(0, p - q), and when every draft is kept the extra token is drawn from p. Each emitted
token then has exactly the target distribution. All draws are keyed by the request's seed
and the output position (acceptance uniforms and the drafter's own draws in domains of
their own), so a seeded request repeats exactly.

Everything here is fixed-shape tensor work with no host syncs, so it can be captured in a
CUDA graph with the verification forward.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from ninfer.contract.sampling import SamplingParams
from ninfer.engine.sampler import Sampler, SamplingBatch

ACCEPT_DOMAIN = b"ninfer.spec.accept.v1"
DRAFT_DOMAIN = b"ninfer.spec.draft.v1"
_UINT64_MOD = 1 << 64


def acceptance_uniform(seed: int, num_generated: int) -> float:
    """The U(0, 1) draw that judges the draft for output position `num_generated`."""
    key = (seed % _UINT64_MOD).to_bytes(8, "little") + (num_generated % _UINT64_MOD).to_bytes(8, "little")
    word = int.from_bytes(hashlib.shake_128(ACCEPT_DOMAIN + key).digest(8), "little")
    return ((word >> 11) + 0.5) * 2.0**-53


def acceptance_uniforms(params: list[SamplingParams], num_generated: list[int], num_positions: int) -> np.ndarray:
    """[B, num_positions] uniforms for B requests (1.0 for greedy rows, which do not use them)."""
    out = np.ones((len(params), num_positions), dtype=np.float32)
    for row, (p, generated) in enumerate(zip(params, num_generated)):
        if not p.is_greedy:
            out[row] = [acceptance_uniform(p.seed, generated + j) for j in range(num_positions)]
    return out


@dataclass
class DraftProposal:
    """K drafted tokens per request and the distribution each was drawn from (one-hot for
    greedy drafts): q over candidate token ids, normalised."""

    token_ids: torch.Tensor  # [B, K] int64
    probs: torch.Tensor  # [B, K, C] float32
    candidate_ids: torch.Tensor  # [B, K, C] int64


def propose(logits: torch.Tensor, sampling: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One draft position: drafter logits [B, V] -> (token ids [B], q [B, C], candidate ids [B, C]).

    Greedy rows take the argmax with q one-hot on it; sampled rows draw from the request's
    filtered distribution (temperature, top-k, top-p, min-p; never penalties) with the noise in
    `sampling` (drawn in DRAFT_DOMAIN by the caller)."""
    scores = logits.float()
    greedy = scores.argmax(dim=-1)
    probs, ids = Sampler.candidate_probs(scores, sampling)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    noise = sampling.noise[:, : probs.shape[-1]]
    drawn = ids.gather(-1, torch.argmax(probs / noise, dim=-1, keepdim=True)).squeeze(-1)
    one_hot = torch.zeros_like(probs)
    one_hot[:, 0] = 1.0
    is_greedy = sampling.is_greedy[:, None]
    greedy_ids = torch.where(is_greedy, greedy[:, None].expand_as(ids), ids)
    tokens = torch.where(sampling.is_greedy, greedy, drawn)
    return tokens, torch.where(is_greedy, one_hot, probs), greedy_ids


def verify(
    scores: torch.Tensor,
    sampling: SamplingBatch,
    drafts: DraftProposal,
    num_drafts: torch.Tensor,
    uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Judge the drafts. scores [B * (K+1), V] fp32 (penalties applied), row b * (K+1) + j;
    sampling: the same rows (noise for the residual / extra draws at each position);
    num_drafts [B] (drafts past it are not considered); uniforms [B, K].

    -> (num_accepted [B], tokens [B, K+1]): tokens[b, :num_accepted[b] + 1] are the accepted
    drafts followed by the target's token after them."""
    batch, num_drafted = drafts.token_ids.shape
    positions = num_drafted + 1
    d = drafts.token_ids
    greedy = scores.argmax(dim=-1).view(batch, positions)
    considered = torch.arange(num_drafted, device=d.device)[None, :] < num_drafts[:, None]
    if sampling.all_greedy:
        accepted = d == greedy[:, :num_drafted]
        target = greedy
    else:
        probs, ids = Sampler.candidate_probs(scores, sampling)
        probs = (probs / probs.sum(dim=-1, keepdim=True)).view(batch, positions, -1)
        ids = ids.view(batch, positions, -1)
        p_of_draft = (probs[:, :num_drafted] * (ids[:, :num_drafted] == d[..., None])).sum(-1)
        q_of_draft = (drafts.probs * (drafts.candidate_ids == d[..., None])).sum(-1)
        kept = uniforms * q_of_draft < p_of_draft
        # q at each of the target's candidates: [B, K, C_target]
        q_at = (drafts.probs[:, :, None, :] * (drafts.candidate_ids[:, :, None, :] == ids[:, :num_drafted, :, None])).sum(-1)
        residual = (probs[:, :num_drafted] - q_at).clamp_min(0.0)
        # A rejection implies some p > q; the fallback only guards rounding.
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, probs[:, :num_drafted])
        # Past the considered drafts a position draws the extra token from p itself.
        residual = torch.where(considered[..., None], residual, probs[:, :num_drafted])
        dist = torch.cat((residual, probs[:, num_drafted:]), dim=1)
        noise = sampling.noise[:, : dist.shape[-1]].view(batch, positions, -1)
        drawn = ids.gather(-1, torch.argmax(dist / noise, dim=-1, keepdim=True)).squeeze(-1)
        is_greedy = sampling.is_greedy.view(batch, positions)[:, :1]
        accepted = torch.where(is_greedy, d == greedy[:, :num_drafted], kept)
        target = torch.where(is_greedy, greedy, drawn)
    accepted = accepted & considered
    num_accepted = torch.cumprod(accepted.to(torch.int64), dim=1).sum(dim=1)
    tokens = torch.cat((d, torch.zeros_like(d[:, :1])), dim=1)
    tokens.scatter_(1, num_accepted[:, None], target.gather(1, num_accepted[:, None]))
    return num_accepted, tokens
