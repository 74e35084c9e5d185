"""Sampler: one decode round's logits [B, V] -> next token ids [B], on the logits' device.

Per-request parameters are packed on the host once per step into a `SamplingBatch` (small
tensors moved in one copy without blocking); `Sampler.sample` then runs without host syncs
(no .item()/.tolist(), no Python branching on tensor values), so it can sit inside a
decode round or a CUDA graph.

Order of operations, per row:
  0. an output constraint's token bitmask (structured outputs): disallowed tokens get -inf;
  1. penalties on the row's output tokens so far (OpenAI style), greedy rows included;
  2. greedy rows (temperature 0) take the argmax;
  3. the other rows keep the top `effective_top_k` (at most TOP_K_CAP) candidates in fp32,
     divide by the temperature, softmax over the candidates, drop candidates below
     min_p * max prob and those past the top_p prefix (both judged on that softmax, so the
     two filters commute), and draw one by the exponential race: argmax p_j / E_j with
     E_j ~ Exp(1) picks j with probability p_j / sum(p), so no renormalisation is needed.

The noise E comes from a per-row generator keyed by (request seed, number of tokens the
request has generated), generated on the host from a hash, so a request's draw does not
depend on the batch composition or the row order, and the noise is the same on every device.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from ninfer.contract.sampling import TOP_K_CAP, SamplingParams
from ninfer.frontend.grammar_library import grammar_library
from ninfer.models.forward_batch import HostStaging

# Domain tag so the sampler's noise stream never coincides with another use of the seed
# (speculative decoding draws its proposals and acceptance tests from domains of its own).
NOISE_DOMAIN = b"ninfer.sampler.v1"
_UINT64_MOD = 1 << 64

# Columns of SamplingBatch.row_floats (one host->device copy carries all float parameters).
_TEMPERATURE, _TOP_P, _MIN_P, _PRESENCE, _FREQUENCY = range(5)
_NUM_FLOAT_PARAMS = 5
# A bitmask row of all ones: every token allowed (the rows of a step that have no constraint).
ALL_TOKENS = -1


def pack_token_bitmasks(masks: Sequence[np.ndarray | None]) -> np.ndarray | None:
    """Rows' bitmasks as one [rows, words] int32 array (all tokens allowed where a row has none);
    None when no row is constrained."""
    if all(mask is None for mask in masks):
        return None
    width = next(mask.shape[-1] for mask in masks if mask is not None)
    packed = np.full((len(masks), width), ALL_TOKENS, dtype=np.int32)
    for row, mask in enumerate(masks):
        if mask is not None:
            packed[row] = mask
    return packed


def exponential_noise(seed: int, num_generated: int, domain: bytes = NOISE_DOMAIN, count: int = TOP_K_CAP) -> np.ndarray:
    """`count` Exp(1) draws for the token after `num_generated` output tokens of a request.

    SHAKE-128 over (seed mod 2^64, position) is the per-row generator: any Python int seed
    (negative ones included) maps to a distinct stream, identically on every platform.
    """
    key = (seed % _UINT64_MOD).to_bytes(8, "little") + (num_generated % _UINT64_MOD).to_bytes(8, "little")
    words = np.frombuffer(hashlib.shake_128(domain + key).digest(8 * count), dtype="<u8")
    # 53 random bits -> uniform in the open interval (0, 1), so -log never sees 0.
    uniform = ((words >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53
    return -np.log(uniform)


@dataclass(frozen=True)
class SamplingBatch:
    """One step's per-row sampling inputs, already on the logits' device."""

    num_rows: int
    row_floats: torch.Tensor  # [B, 5] float32: temperature (1 for greedy rows), top_p, min_p, presence, frequency
    top_ks: torch.Tensor  # [B] int64, effective top-k in 1..TOP_K_CAP
    is_greedy: torch.Tensor  # [B] bool
    noise: torch.Tensor  # [B, TOP_K_CAP] float32 Exp(1) draws (1.0 in greedy rows, unused)
    penalty_rows: torch.Tensor | None  # [N] int64 row of each counted output token
    penalty_token_ids: torch.Tensor | None  # [N] int64 the counted output tokens
    all_greedy: bool  # host-side facts that pick the code path without reading tensors
    any_greedy: bool
    has_penalties: bool
    # [B, ceil(V / 32)] int32, bit v of a row set where token v is allowed; None: no row is constrained.
    token_bitmask: torch.Tensor | None = None

    def counting_in_flight(
        self, rows: Sequence[int], previous_rows: Sequence[int], previous_ids: torch.Tensor | None
    ) -> SamplingBatch:
        """This batch with one more output token counted for each of `rows` (penalties): the token
        still in flight, previous_ids[previous_rows[i]] for rows[i] on the device (a chained row's
        input, sampled by the step before, which its host history does not hold yet)."""
        if not rows:
            return self
        indices = torch.tensor([list(rows), list(previous_rows)], dtype=torch.int64)
        row_index, previous = indices.to(previous_ids.device, non_blocking=True)
        tokens = previous_ids.index_select(0, previous).to(torch.int64)
        if self.penalty_rows is not None and self.penalty_token_ids is not None:
            row_index = torch.cat((self.penalty_rows, row_index))
            tokens = torch.cat((self.penalty_token_ids, tokens))
        return replace(self, penalty_rows=row_index, penalty_token_ids=tokens, has_penalties=True)

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        output_token_ids: Sequence[Sequence[int]],
        device: torch.device | str = "cpu",
        num_generated: Sequence[int] | None = None,
        staging: HostStaging | None = None,
        noise_domain: bytes = NOISE_DOMAIN,
        token_bitmasks: Sequence[np.ndarray | None] | None = None,
    ) -> SamplingBatch:
        """Pack rows. `output_token_ids[i]`: row i's output tokens so far (for penalties; an
        array('q') or numpy array avoids a per-step list conversion). `num_generated[i]`:
        the row's RNG position, default len(output_token_ids[i]) (speculative verification
        passes len + offset per drafted position). Sampled rows need a seed: the engine
        assigns `fresh_seed()` at admission when the request has none.

        staging: the caller's step staging on `device` (the tensors travel with the rest of
        its step; the caller flushes it before sampling); default a private one, flushed here.
        token_bitmasks: each row's allowed tokens (an output constraint), None where it has none."""
        num_rows = len(params)
        if len(output_token_ids) != num_rows:
            raise ValueError(f"{num_rows} rows of params but {len(output_token_ids)} token histories")
        positions = (
            [len(history) for history in output_token_ids] if num_generated is None else list(num_generated)
        )
        if len(positions) != num_rows:
            raise ValueError(f"{num_rows} rows of params but {len(positions)} RNG positions")

        floats = np.zeros((num_rows, _NUM_FLOAT_PARAMS), dtype=np.float32)
        top_ks = np.zeros(num_rows, dtype=np.int64)
        greedy = np.zeros(num_rows, dtype=np.bool_)
        noise = np.ones((num_rows, TOP_K_CAP), dtype=np.float32)
        rows: list[np.ndarray] = []
        tokens: list[np.ndarray] = []
        for row, p in enumerate(params):
            greedy[row] = p.is_greedy
            temperature = 1.0 if p.is_greedy else p.temperature
            floats[row] = (temperature, p.top_p, p.min_p, p.presence_penalty, p.frequency_penalty)
            top_ks[row] = p.effective_top_k
            if not p.is_greedy:
                if p.seed is None:
                    raise ValueError("a sampled row needs a seed (assign fresh_seed() at admission)")
                noise[row] = exponential_noise(p.seed, positions[row], noise_domain)
            if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
                history = np.asarray(output_token_ids[row], dtype=np.int64)
                tokens.append(history)
                rows.append(np.full(history.shape, row, dtype=np.int64))

        has_penalties = bool(rows)
        private = staging is None
        if private:
            # Used once: PyTorch's pinned allocator keeps its buffer until the copy out of it is done.
            staging = HostStaging(device)
            staging.next_step()
        penalty_rows = penalty_tokens = None
        if has_penalties:
            penalty_rows, penalty_tokens = staging.add(np.stack([np.concatenate(rows), np.concatenate(tokens)]))
        packed = pack_token_bitmasks(token_bitmasks or ())
        bitmask = staging.add(packed) if packed is not None else None
        batch = cls(
            num_rows=num_rows,
            row_floats=staging.add(floats),
            top_ks=staging.add(top_ks),
            is_greedy=staging.add(greedy),
            noise=staging.add(noise),
            penalty_rows=penalty_rows,
            penalty_token_ids=penalty_tokens,
            all_greedy=bool(greedy.all()),
            any_greedy=bool(greedy.any()),
            has_penalties=has_penalties,
            token_bitmask=bitmask,
        )
        if private:
            staging.flush()
        return batch


class Sampler:
    """Stateless: every per-request input arrives in the SamplingBatch, so one `sample` call
    over a fixed batch can be captured in a CUDA graph and replayed."""

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """logits [B, V] (any float dtype) -> token ids [B] int64 on the same device."""
        if logits.dim() != 2 or logits.shape[0] != batch.num_rows:
            raise ValueError(f"logits {tuple(logits.shape)} do not match a batch of {batch.num_rows} rows")
        if batch.token_bitmask is not None:
            logits = self.apply_token_bitmask(logits, batch.token_bitmask)
        if batch.all_greedy and not batch.has_penalties:
            return logits.argmax(dim=-1)  # greedy fast path: no fp32 copy, no top-k, no noise
        if batch.has_penalties:
            scores = self.apply_penalties_(logits.to(torch.float32, copy=True), batch)
        else:
            scores = logits.float()
        if batch.all_greedy:
            return scores.argmax(dim=-1)
        sampled = self._sample_candidates(scores, batch)
        if not batch.any_greedy:
            return sampled
        return torch.where(batch.is_greedy, scores.argmax(dim=-1), sampled)

    __call__ = sample

    @staticmethod
    def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
        """fp32 logits with every token a row's bitmask leaves out at -inf (a new tensor)."""
        masked = logits.to(torch.float32, copy=True)
        # The grammar library's kernel (C++ on the CPU, CUDA on the GPU): unpacking the bits with
        # torch ops materializes 32 ints per bitmask word.
        grammar_library().apply_token_bitmask_inplace(masked, bitmask)
        return masked

    @staticmethod
    def token_logprobs(
        logits: torch.Tensor, token_ids: torch.Tensor, num_top: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Log-softmax of logits [R, V] (masked, before penalties and temperature): the log
        probability of each row's token [R], and its num_top most likely tokens [R, num_top]
        with theirs."""
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        chosen = logprobs.gather(1, token_ids.view(-1, 1)).view(-1)
        top_values, top_ids = torch.topk(logprobs, num_top, dim=-1) if num_top else (
            logprobs[:, :0], token_ids.view(-1, 1)[:, :0]
        )
        return chosen, top_ids, top_values

    @staticmethod
    def apply_penalties_(scores: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """In place on fp32 scores: scores[v] -= presence * (count[v] > 0) + frequency * count[v]."""
        if batch.penalty_rows is None or batch.penalty_token_ids is None:
            return scores
        num_rows, vocab = scores.shape
        # A dense count table: on a GPU, index_add_ (atomics) is several times faster than a
        # sparse index_put_(accumulate=True), which sorts the indices.
        counts = torch.zeros(num_rows * vocab, dtype=torch.float32, device=scores.device)
        flat_index = batch.penalty_rows * vocab + batch.penalty_token_ids
        counts.index_add_(0, flat_index, torch.ones_like(flat_index, dtype=torch.float32))
        return Sampler.penalize_(scores, counts.view(num_rows, vocab), batch.row_floats)

    @staticmethod
    def penalize_(scores: torch.Tensor, counts: torch.Tensor, row_floats: torch.Tensor) -> torch.Tensor:
        """In place on fp32 scores [R, V], given each row's output token counts [R, V] fp32."""
        presence = row_floats[:, _PRESENCE : _PRESENCE + 1]
        frequency = row_floats[:, _FREQUENCY : _FREQUENCY + 1]
        return scores.sub_(presence * (counts > 0) + frequency * counts)

    @staticmethod
    def candidate_probs(scores: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(probs [B, K], token ids [B, K]) of the top-K candidates after temperature, top-k,
        min_p and top_p; dropped candidates have prob 0, kept ones are not renormalised."""
        # Always the full cap, so a row's ranks (and the noise paired with them) do not
        # depend on the other rows' top_k. Equal logits keep torch.topk's order, which is
        # per-row on one device (seen on an H200 for batches of 1..64); CPU and CUDA may differ.
        num_candidates = min(TOP_K_CAP, scores.shape[-1])
        values, token_ids = torch.topk(scores, num_candidates, dim=-1, sorted=True)
        temperature = batch.row_floats[:, _TEMPERATURE : _TEMPERATURE + 1]
        ranks = torch.arange(num_candidates, device=scores.device)
        outside_top_k = ranks[None, :] >= batch.top_ks[:, None]
        probs = torch.softmax((values / temperature).masked_fill(outside_top_k, float("-inf")), dim=-1)

        min_p = batch.row_floats[:, _MIN_P : _MIN_P + 1]
        below_min_p = probs < min_p * probs[:, :1]  # sorted: column 0 holds the max
        top_p = batch.row_floats[:, _TOP_P : _TOP_P + 1]
        mass_before = torch.cumsum(probs, dim=-1) - probs
        # top_p >= 1 keeps everything even where fp32 rounding lets the mass reach 1 early.
        past_top_p = (mass_before >= top_p) & (top_p < 1.0)
        dropped = (below_min_p | past_top_p) & (ranks[None, :] > 0)  # the first candidate always stays
        return probs.masked_fill(dropped, 0.0), token_ids

    def _sample_candidates(self, scores: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        probs, token_ids = self.candidate_probs(scores, batch)
        noise = batch.noise[:, : probs.shape[-1]]
        winner = torch.argmax(probs / noise, dim=-1, keepdim=True)  # exponential race
        return token_ids.gather(-1, winner).squeeze(-1)
