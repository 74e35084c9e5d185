"""MtpDrafter: drafts with the artifact's MTP head (Qwen3.5 / Qwen3-Next `mtp.*`).

The MTP head at position j reads the target's hidden state at j-1 and the token at j, and
predicts the token at j+1; its attention layer keeps KV at the target's positions (an extra
layer of the same paged KV cache). So every computed chunk also runs the head over its
rows, with the target hidden shifted by one (the slot keeps the hidden of its last computed
position for the chunk's first row): prompt chunks only to extend the head's KV, and a
verification row over its tokens plus one more row, where the target's token after the
accepted drafts replaces the first rejected draft. That row's output gives the first new
draft; the head then runs on its own output, one row per request, for the others (its
entries past the accepted tokens are rewritten by the next round before anything reads
them). Positions are computed on the device from the accepted counts: nothing syncs with
the host on CUDA. A request with media runs the head at the target's MRoPE positions: its
prompt's three axes in the pass over the prompt, and its index plus its rope offset after it.
"""

from __future__ import annotations

import torch

from ninfer.engine.speculative.acceptance import DraftProposal, propose
from ninfer.engine.speculative.draft_round import DraftRound
from ninfer.engine.speculative.proposal_head import ProposalHead
from ninfer.models.causal_lm import CausalLM
from ninfer.models.forward_batch import ForwardBatch


class MtpDrafter:
    capturable = True  # draft() reads device tensors only: the verify graphs capture it

    def __init__(self, model: CausalLM, head: ProposalHead, num_draft_tokens: int):
        if getattr(model, "mtp", None) is None:
            raise ValueError("the model has no MTP head")
        self.model = model
        self.head = head
        self.num_draft_tokens = num_draft_tokens
        self.mrope = model.config.mrope_section is not None

    def draft(self, round: DraftRound) -> DraftProposal | None:
        """Extend the head's KV over every chunk and propose K drafts per verification row."""
        inputs = round.inputs
        tokens = torch.where(inputs.token_index >= 0, round.input_ids[inputs.token_index.clamp_min(0)], 0)
        hidden_all = torch.cat((round.hidden, round.slot_hidden.index_select(0, inputs.mtp_slots)))
        hidden_in = hidden_all.index_select(0, inputs.hidden_index)
        num_verify = round.num_verify
        if num_verify:
            # The target's token after the accepted drafts replaces the first rejected one.
            bonus_rows = inputs.first_draft_rows + round.num_accepted
            bonus = round.tokens.gather(1, round.num_accepted[:, None]).squeeze(1)
            tokens = tokens.index_copy(0, bonus_rows, bonus)
        out = self.model.forward_mtp(tokens, hidden_in, inputs.mtp_batch, step_index=0)
        if not num_verify:
            return None

        hidden = out.index_select(0, bonus_rows)
        drafted, probs, candidates = [], [], []
        for step in range(1, self.num_draft_tokens + 1):
            ids, q, q_ids = propose(self.head.logits(hidden), round.noise_for(step))
            token = self.head.to_vocabulary(ids)
            drafted.append(token)
            probs.append(q)
            candidates.append(self.head.to_vocabulary(q_ids))
            if step == self.num_draft_tokens:
                break
            # The head's next row: the draft just made, at the position after it was predicted from.
            positions = torch.minimum(inputs.base + round.num_accepted + step, inputs.limits - 1)
            batch = self._decode_batch(positions, inputs.rope_offsets, round.target_batch, num_verify)
            hidden = self.model.forward_mtp(token, hidden, batch, step_index=step)
        return DraftProposal(torch.stack(drafted, 1), torch.stack(probs, 1), torch.stack(candidates, 1))

    def extend_context(self, token_ids: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch,
                       slot_hidden: torch.Tensor) -> None:
        """The head's KV over a plain decode round's rows (one per request): row b reads the
        slot's hidden of the position before and its token; the output is not needed."""
        del hidden  # the target's hidden of these rows feeds the next row, through the slot
        self.model.forward_mtp(token_ids, slot_hidden.index_select(0, batch.state_slots), batch, step_index=0)

    def _decode_batch(
        self, positions: torch.Tensor, rope_offsets: torch.Tensor, target: ForwardBatch, num_rows: int
    ) -> ForwardBatch:
        """One row per verification request at device-computed positions (pages of the target batch);
        rope_offsets: what each request's rotary position adds to its index (media, MRoPE models)."""
        kv = target.kv_cache
        page_table = target.page_table[:num_rows]
        pages = page_table.gather(1, (positions // kv.page_size)[:, None]).squeeze(1).to(torch.int64)
        device = positions.device
        rows = torch.arange(num_rows + 1, dtype=torch.int32, device=device)
        # The reference attention loops over host lengths; the fast kernels read the device ones.
        host_lens = tuple((positions + 1).tolist()) if device.type == "cpu" else (1,) * num_rows
        return ForwardBatch(
            positions=(positions + rope_offsets).unsqueeze(0).expand(3, -1) if self.mrope else positions,
            query_start_loc=rows,
            seq_lens=(positions + 1).to(torch.int32),
            page_table=page_table,
            state_slots=target.state_slots[:num_rows],
            logits_indices=rows[:-1].to(torch.int64),
            slot_mapping=pages * kv.page_size + positions % kv.page_size,
            kv_cache=kv,
            state_cache=None,
            query_lens_cpu=(1,) * num_rows,
            seq_lens_cpu=host_lens,
        )
