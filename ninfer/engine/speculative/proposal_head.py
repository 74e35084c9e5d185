"""ProposalHead: the lm_head a drafter scores its proposals with.

The target always scores the whole vocabulary; a draft only has to be likely, so
--lm-head-draft drafts over a reduced vocabulary: the first PROPOSAL_VOCAB ids (byte-level BPE
vocabularies number their tokens in merge order, so the low ids are the frequent pieces) plus
every added token (chat markers, thinking and tool-call tags), read as rows of the target's
lm_head. A draft step then reads ~13% of the lm_head bytes on a 248K vocabulary. Without the
option the proposal head is the target's lm_head itself. With fp8 (--draft-fp8) the reduced
head's rows are kept in FP8 per row, half its bytes; the full lm_head is never copied for it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ninfer.kernels.gemv import linear
from ninfer.models.quant.fp8 import Fp8Linear, quantize_per_channel

PROPOSAL_VOCAB = 32768
# Rows quantized at a time for --draft-fp8: the fp32 temporaries stay ~80 MB on a 5120-wide head.
_FP8_ROWS_AT_ONCE = 4096


class ProposalHead:
    def __init__(
        self, lm_head: torch.nn.Module, num_valid_tokens: int, reduced: bool, extra_token_ids: Iterable[int] = (),
        fp8: bool = False,
    ):
        self.lm_head = lm_head
        self.num_valid_tokens = num_valid_tokens
        self.token_ids: torch.Tensor | None = None  # reduced: full-vocabulary id of each row
        self.weight: torch.Tensor | None = None
        self.fp8: Fp8Linear | None = None  # reduced with fp8: the rows in FP8 instead of `weight`
        if reduced and num_valid_tokens > PROPOSAL_VOCAB:
            ids = sorted(set(range(PROPOSAL_VOCAB)) | {i for i in extra_token_ids if 0 <= i < num_valid_tokens})
            weight = lm_head.weight
            self.token_ids = torch.tensor(ids, dtype=torch.int64, device=weight.device)
            if fp8 and weight.is_floating_point() and weight.element_size() > 1:
                parts = [quantize_per_channel(weight.index_select(0, ids))
                         for ids in self.token_ids.split(_FP8_ROWS_AT_ONCE)]  # fmt: skip
                self.fp8 = Fp8Linear(torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]), None, None)
            else:
                self.weight = weight.index_select(0, self.token_ids).contiguous()

    @property
    def vocab_size(self) -> int:
        return self.num_valid_tokens if self.token_ids is None else len(self.token_ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, H] -> fp32 logits [T, vocab_size] (rows of invalid ids at -inf)."""
        if self.fp8 is not None:
            return self.fp8(hidden).float()
        if self.weight is not None:
            # CPU engines may keep weights in float16 beside float32 activations.
            weight = self.weight if self.weight.dtype == hidden.dtype else self.weight.to(hidden.dtype)
            return linear(hidden, weight, None).float()
        logits = self.lm_head(hidden).float()
        if self.num_valid_tokens < logits.shape[-1]:
            logits[:, self.num_valid_tokens :] = float("-inf")
        return logits

    def to_vocabulary(self, ids: torch.Tensor) -> torch.Tensor:
        """Row indices of logits() -> token ids of the full vocabulary."""
        return ids if self.token_ids is None else self.token_ids[ids]

    @property
    def weight_bytes(self) -> int:
        if self.fp8 is not None:
            return sum(t.numel() * t.element_size() for t in (self.fp8.weight, self.fp8.weight_scale))
        weight = self.weight if self.weight is not None else self.lm_head.weight
        return weight.numel() * weight.element_size()
