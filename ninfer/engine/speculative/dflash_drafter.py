"""DflashDrafter: drafts with a DFlash / DFlash2 companion over the target's intermediate hidden states.

Every computed chunk of a step (prompt chunks, plain rows and verification rows alike) extends
the drafter's context: the target forward writes the residual streams after the drafter's
target layers (ForwardBatch.aux_hidden) and every row becomes context K/V in the drafter's own
paged KV, at the target's page ids and positions. Rows past the accepted ones hold rejected
drafts; their context, like the block K/V written from the accepted frontier on, is rewritten
by the next step that computes those positions before anything reads them, since a block only
reads positions below its start and its own rows (the same reliance as the MTP head's KV).

Each verification row then drafts one block: [the target's token after the accepted drafts,
K mask tokens] at the positions from that token on. The block is K + 1 rows whatever the
checkpoint's training block (block_size >= K + 1), as the published vLLM reader runs
num_speculative_tokens + 1 query rows. DFlash proposes from each mask row's logits (argmax, or
a draw from the request's filtered distribution); DFlash2 walks its candidate selector from the
token the block starts with. Positions come from the round's accepted counts on the device:
nothing syncs with the host on CUDA. The drafter's RoPE is one-axis: a row takes the target's
temporal MRoPE position, which for a request with media is its index plus its rope offset after
the prompt, so the block adds that offset too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ninfer.contract.sampling import TOP_K_CAP
from ninfer.engine.speculative.acceptance import DraftProposal, propose
from ninfer.engine.speculative.draft_round import DraftRound
from ninfer.engine.speculative.proposal_head import ProposalHead
from ninfer.models.causal_lm import CausalLM
from ninfer.models.dflash import DflashDraftModel, DraftBlock
from ninfer.models.forward_batch import ForwardBatch
from ninfer.models.kv_cache import KVCache


class DflashDrafter:
    capturable = True  # draft() and extend_context() read device tensors only (DraftBlock: host lengths on CPU)

    def __init__(
        self, target: CausalLM, model: DflashDraftModel, head: ProposalHead, kv_cache: KVCache, num_draft_tokens: int
    ):
        """kv_cache: the drafter's context KV, with the target KV's page geometry."""
        self.target = target
        self.model = model
        self.head = head
        self.kv_cache = kv_cache
        self.num_draft_tokens = num_draft_tokens
        self.aux_layer_ids = model.config.target_layer_ids  # what the target forward writes for it

    def draft(self, round: DraftRound) -> DraftProposal | None:
        """Extend the context over every computed row and propose K drafts per verification row."""
        self._store_context(round.target_batch)
        if not round.num_verify:
            return None
        first = round.tokens.gather(1, round.num_accepted[:, None]).squeeze(1)  # the token after the accepted drafts
        hidden = self.block_hidden(round, first)
        num_requests, k = hidden.shape[:2]
        logits = self.model.scale_logits(self.head.logits(hidden.flatten(0, 1))).view(num_requests, k, -1)
        if self.model.candidate_selector is not None:
            return self.select_path(logits, hidden, first, round)
        drafted, probs, candidates = [], [], []
        for step in range(1, k + 1):
            ids, q, q_ids = propose(logits[:, step - 1], round.noise_for(step))
            drafted.append(self.head.to_vocabulary(ids))
            probs.append(q)
            candidates.append(self.head.to_vocabulary(q_ids))
        return DraftProposal(torch.stack(drafted, 1), torch.stack(probs, 1), torch.stack(candidates, 1))

    def extend_context(self, token_ids: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch,
                       slot_hidden: torch.Tensor) -> None:
        """A plain decode round: its rows become context (the target wrote their residual streams)."""
        del token_ids, hidden, slot_hidden  # the context comes from the streams alone
        self._store_context(batch)

    def _store_context(self, batch: ForwardBatch) -> None:
        # Text rows carry the same position on every MRoPE axis (index + rope offset with media).
        positions = batch.positions if batch.positions.dim() == 1 else batch.positions[0]
        self.model.store_context(batch.aux_hidden, positions, self.kv_cache, batch.slot_mapping)

    def block_hidden(self, round: DraftRound, first: torch.Tensor) -> torch.Tensor:
        """The drafter's final-normed hidden [R, K, H] at each verification row's K mask rows."""
        num_requests, k = round.num_verify, self.num_draft_tokens
        block_len = k + 1
        mask = torch.full((num_requests, k), self.model.config.mask_token_id, dtype=first.dtype, device=first.device)
        embeds = self.target.model.embed_tokens(torch.cat((first[:, None], mask), dim=1).view(-1))
        if self.model.config.input_embedding_scale != 1.0:
            embeds = embeds * self.model.config.input_embedding_scale
        inputs = round.inputs
        block = DraftBlock.build(
            inputs.base + round.num_accepted,  # the first token sits right after the accepted drafts
            inputs.limits,
            round.target_batch.page_table[:num_requests],
            block_len,
            self.kv_cache.page_size,
            inputs.rope_offsets,
        )
        return self.model(embeds, block, self.kv_cache).view(num_requests, block_len, -1)[:, 1:]

    def select_path(
        self, logits: torch.Tensor, hidden: torch.Tensor, first: torch.Tensor, round: DraftRound
    ) -> DraftProposal:
        """DFlash2: at each position pick among the draft's top candidates by the selector's score of
        following the token picked before: its argmax for greedy rows; for sampled rows a draw from
        q = softmax(S / temperature) over the candidates (the published reader's q: no top-k/top-p),
        which the rejection rule judges the draft by."""
        selector = self.model.candidate_selector
        num_candidates = selector.top_k
        unary, index = torch.topk(logits, num_candidates, dim=-1)
        candidates = self.head.to_vocabulary(index)  # [R, K, top_k] token ids
        projected = selector.hidden_projection(hidden)
        sampling = round.inputs.request_sampling
        temperature = sampling.row_floats[:, :1]  # column 0: the temperature (1 in greedy rows)
        is_greedy = sampling.is_greedy[:, None]
        one_hot = torch.zeros(logits.shape[0], TOP_K_CAP, dtype=torch.float32, device=logits.device)
        one_hot[:, 0] = 1.0
        token = first
        drafted, probs, candidate_ids = [], [], []
        for step in range(1, self.num_draft_tokens + 1):
            ids = candidates[:, step - 1]
            scores = selector.scores(unary[:, step - 1], ids, token, projected[:, step - 1])
            q = torch.softmax(scores / temperature, dim=-1)
            noise = round.noise_for(step).noise[:, :num_candidates]
            pick = torch.where(is_greedy, scores.argmax(-1, keepdim=True), torch.argmax(q / noise, -1, keepdim=True))
            token = ids.gather(1, pick).squeeze(1)
            drafted.append(token)
            # q over TOP_K_CAP columns: the candidates, then zero-probability repeats of the first.
            padded_ids = torch.cat((ids, ids[:, :1].expand(-1, TOP_K_CAP - num_candidates)), dim=1)
            probs.append(torch.where(is_greedy, one_hot, F.pad(q, (0, TOP_K_CAP - num_candidates))))
            candidate_ids.append(torch.where(is_greedy, token[:, None].expand_as(padded_ids), padded_ids))
        return DraftProposal(torch.stack(drafted, 1), torch.stack(probs, 1), torch.stack(candidate_ids, 1))
