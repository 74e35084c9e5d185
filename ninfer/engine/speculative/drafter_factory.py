"""make_drafter: the drafter of the speculative backend frozen at start-up (EngineConfig.spec)."""

from __future__ import annotations

from ninfer.engine.speculative.dflash_drafter import DflashDrafter
from ninfer.engine.speculative.mtp_drafter import MtpDrafter
from ninfer.engine.speculative.proposal_head import ProposalHead
from ninfer.models.causal_lm import CausalLM
from ninfer.models.dflash import DflashDraftModel
from ninfer.models.kv_cache import KVCache
from ninfer.models.quant.fp8 import quantize_fp8_


def make_drafter(
    backend: str,
    target: CausalLM,
    head: ProposalHead,
    num_draft_tokens: int,
    draft_model: DflashDraftModel | None = None,
    draft_kv_cache: KVCache | None = None,
) -> MtpDrafter | DflashDrafter:
    """backend: mtp (the target's own head), dflash or dflash2 (draft_model, with its context KV)."""
    if backend == "mtp":
        return MtpDrafter(target, head, num_draft_tokens)
    if draft_model is None or draft_kv_cache is None:
        raise ValueError(f"--spec {backend} needs its drafter model and context KV")
    if draft_model.config.kind != backend:
        raise ValueError(f"--spec {backend}: the drafter loaded is a {draft_model.config.kind} drafter")
    return DflashDrafter(target, draft_model, head, draft_kv_cache, num_draft_tokens)


def quantize_drafter_fp8_(target: CausalLM, draft_model: DflashDraftModel | None = None) -> int:
    """--draft-fp8: the drafter's Linear layers in FP8 per output channel, in place (the target's
    MTP head, or the DFlash drafter); layers already quantized stay as they are (a second engine
    on the same model, an FP8 target). Drafts only: verification keeps the outputs exact. -> how
    many layers it quantized."""
    drafter = draft_model if draft_model is not None else getattr(target, "mtp", None)
    return 0 if drafter is None else quantize_fp8_(drafter)
