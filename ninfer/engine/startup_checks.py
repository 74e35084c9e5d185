"""Start-up checks: options the artifact cannot serve fail before any weight loads.

Each raises ConfigValueError naming the option, which reaches the user as a command-line error.
Speculative residency: --spec freezes the backend for the process's life, and a combination the
artifact cannot serve names the missing part: no MTP head; no DFlash / DFlash2 drafter companion
(artifact/draft_companion.py says where one is looked for); a companion whose hidden size, mask
token, target layers or vocabulary do not fit the target; a draft count its block cannot hold.
"""

from __future__ import annotations

from ninfer.artifact.artifact import ArtifactError
from ninfer.artifact.draft_companion import DraftCompanion, open_draft_companion
from ninfer.config import ConfigValueError, EngineConfig
from ninfer.contract.sampling import TOP_K_CAP
from ninfer.models.config import ModelConfig
from ninfer.models.draft_config import DraftConfig

# Families whose forward writes ForwardBatch.aux_hidden (the residual streams a DFlash drafter reads).
AUX_HIDDEN_FAMILIES = ("qwen3_5", "qwen3_next")


def check_speculative(artifact, engine: EngineConfig) -> DraftCompanion | None:
    """Raise ConfigValueError when `artifact` cannot serve engine.spec; -> the opened drafter
    companion for --spec dflash|dflash2 (its weights not yet read), else None."""
    if engine.spec is None:
        return None
    where = str(artifact.path)
    if engine.spec == "mtp":
        if not artifact.config.mtp_num_hidden_layers:
            raise ConfigValueError(
                f"--spec mtp: {where} has no MTP head (no mtp.* tensors, or a model type without one); "
                "serve it without --spec"
            )
        return None
    try:
        companion = open_draft_companion(artifact.path, engine.spec, artifact)
    except ArtifactError as error:
        raise ConfigValueError(f"--spec {engine.spec}: {where}: {error}") from error
    problem = companion_mismatch(companion.config, artifact.config, engine.num_draft_tokens)
    if problem is not None:
        raise ConfigValueError(f"--spec {engine.spec}: {companion.path}: {problem}")
    try:
        companion.check_weights()
    except ArtifactError as error:
        raise ConfigValueError(f"--spec {engine.spec}: {error}") from error
    return companion


def companion_mismatch(draft: DraftConfig, target: ModelConfig, num_draft_tokens: int) -> str | None:
    """What keeps this drafter from drafting num_draft_tokens for the target, or None."""
    if target.family not in AUX_HIDDEN_FAMILIES:
        return f"the {target.family} model does not expose its intermediate hidden states to a drafter"
    if draft.hidden_size != target.hidden_size:
        return f"hidden_size {draft.hidden_size} differs from the target's {target.hidden_size}"
    if not 0 <= draft.mask_token_id < target.vocab_size:
        return f"dflash_config.mask_token_id {draft.mask_token_id} is outside the target's {target.vocab_size} tokens"
    bad = [i for i in draft.target_layer_ids if not 0 <= i < target.num_hidden_layers]
    if bad or len(set(draft.target_layer_ids)) != len(draft.target_layer_ids):
        return (
            f"dflash_config.target_layer_ids {list(draft.target_layer_ids)} must be distinct layers of the "
            f"target's {target.num_hidden_layers}"
        )
    if num_draft_tokens > draft.block_size - 1:
        return (
            f"--draft-tokens {num_draft_tokens} exceeds what its block of {draft.block_size} drafts "
            f"(at most {draft.block_size - 1})"
        )
    if draft.is_dflash2:
        if draft.vocab_size < target.vocab_size:
            return (
                f"vocab_size {draft.vocab_size} (selector codebooks) is smaller than the target's {target.vocab_size}"
            )
        if draft.conv_kernel_size < 1 or draft.selector_rank < 1:
            return "dflash_config.conv_kernel_size and selector_rank must be >= 1"
        if not 1 <= draft.selector_top_k <= TOP_K_CAP:
            return f"dflash_config.selector_top_k {draft.selector_top_k} must be in 1..{TOP_K_CAP}"
    return None
