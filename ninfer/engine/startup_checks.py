"""Start-up checks of the engine process: options it cannot serve fail before any weight loads.

They need torch or the model, so they run where the engine does (engine/builder.py, first
thing); each raises ConfigValueError naming the option, which the engine process reports as
Refused and the API process prints as a command-line error (exit code 2).
- The device: --device names a CUDA device this process can see (CPU when none is present).
- Tensor parallelism: --tensor-parallel N must divide the model's heads and intermediate sizes
  (parallel/shard_plan.py) and have N devices from --device on.
- The KV formats: --kv-dtype must fit the model's attention head size.
- Speculative residency: --spec freezes the backend for the process's life, and a combination
  the artifact cannot serve names the missing part: no MTP head; no DFlash / DFlash2 drafter
  companion (artifact/draft_companion.py says where one is looked for); a companion whose hidden
  size, mask token, target layers or vocabulary do not fit the target; a draft count its block
  cannot hold.
"""

from __future__ import annotations

import torch

from ninfer.artifact.artifact import ArtifactError
from ninfer.artifact.draft_companion import DraftCompanion, open_draft_companion
from ninfer.config import ConfigValueError, EngineConfig
from ninfer.contract.sampling import TOP_K_CAP
from ninfer.kernels.kv_quant import check_head_dim
from ninfer.models.config import ModelConfig
from ninfer.models.draft_config import DraftConfig
from ninfer.models.kv_cache import KV_DTYPES
from ninfer.parallel.shard_plan import tensor_parallel_problem

# Families whose forward writes ForwardBatch.aux_hidden (the residual streams a DFlash drafter reads).
AUX_HIDDEN_FAMILIES = ("qwen3_5", "qwen3_next")


def resolve_device(index: int, num_ranks: int = 1) -> str:
    """--device: "cuda:<index>" when CUDA is available, else "cpu"; an index past the visible
    devices raises ConfigValueError, and so do more tensor-parallel ranks than the devices from
    `index` on (rank r runs on device index + r)."""
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        if not 0 <= index < count:
            raise ConfigValueError(f"--device {index}: only {count} CUDA devices are visible")
        if index + num_ranks > count:
            raise ConfigValueError(
                f"--tensor-parallel {num_ranks}: needs {num_ranks} CUDA devices from --device {index} on; "
                f"{count - index} visible"
            )
        return f"cuda:{index}"
    return "cpu"


def check_tensor_parallel(artifact, engine: EngineConfig) -> None:
    """ConfigValueError when the model cannot run over --tensor-parallel's ranks: a split
    dimension the rank count does not divide. Everything else splits: the MTP head like the
    trunk (its layer is one of the trunk's kind); a DFlash drafter and the vision tower run whole
    on every rank; quantized weights, in a checkpoint, a container or --quantize'd, split as
    stored (StoredWrite.narrowed)."""
    size = engine.tensor_parallel
    problem = tensor_parallel_problem(artifact.config, size)
    if problem is not None:
        raise ConfigValueError(f"--tensor-parallel {size}: {artifact.path} does not split over {size} ranks: {problem}")


def check_kv_dtype(config: ModelConfig, engine: EngineConfig) -> None:
    """ConfigValueError when the model's attention heads cannot be stored in --kv-dtype's formats."""
    for fmt in KV_DTYPES[engine.kv_dtype]:
        problem = None if fmt is None else check_head_dim(fmt, config.head_dim)
        if problem is not None:
            raise ConfigValueError(f"--kv-dtype {engine.kv_dtype}: {problem}")


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
