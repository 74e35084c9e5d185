"""Shared helpers for model parity tests: random weights, HF checkpoints, running our models.

Generic over architectures: anything built by ninfer.models.loader with a CausalLM API,
and any transformers model that save_pretrained can write.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from ninfer.models.causal_lm import CausalLM
from ninfer.models.config import ModelConfig
from ninfer.models.forward_batch import ForwardBatch
from ninfer.models.loader import load_model

# name suffix -> fills the parameter in place (given a seeded generator)
ParamInit = Callable[[torch.Tensor, torch.Generator], None]


@torch.no_grad()
def randomize_(
    model: nn.Module,
    seed: int,
    vector_mean: float = 0.0,
    vector_std: float = 0.3,
    overrides: dict[str, ParamInit] | None = None,
) -> nn.Module:
    """Fill every parameter with random values, deterministically by name order.

    Matrices get N(0, fan_in^-0.5) (fan_in = last dim) so activations stay O(1) at any size;
    1-D parameters (norm weights, biases, gates) get N(vector_mean, vector_std) so no norm
    sits at its identity initialisation and hides a bug. overrides maps a name suffix to a
    custom init (e.g. A_log, or plain w-norms that want mean 1).
    """
    gen = torch.Generator().manual_seed(seed)
    for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
        custom = next((init for suffix, init in (overrides or {}).items() if name.endswith(suffix)), None)
        if custom is not None:
            custom(param, gen)
        elif param.dim() >= 2:
            param.copy_(torch.randn(param.shape, generator=gen) * param.shape[-1] ** -0.5)
        else:
            param.copy_(torch.randn(param.shape, generator=gen) * vector_std + vector_mean)
    return model


def normal_init(mean: float, std: float) -> ParamInit:
    def init(param: torch.Tensor, gen: torch.Generator) -> None:
        param.copy_(torch.randn(param.shape, generator=gen) * std + mean)

    return init


def uniform_init(low: float, high: float, transform: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> ParamInit:
    def init(param: torch.Tensor, gen: torch.Generator) -> None:
        param.copy_(transform(torch.rand(param.shape, generator=gen) * (high - low) + low))

    return init


def save_hf(model: nn.Module, directory: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """save_pretrained into `directory` -> (config.json as a dict, every stored tensor by name)."""
    directory = Path(directory)
    model.save_pretrained(directory)
    config = json.loads((directory / "config.json").read_text())
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(shard))
    return config, tensors


def load_ours(
    hf_config: dict,
    tensors: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    dtype: torch.dtype = torch.float32,
) -> CausalLM:
    """ModelConfig.from_hf + loader.load_model, as the server does."""
    items = tensors.items() if isinstance(tensors, dict) else tensors
    return load_model(ModelConfig.from_hf(hf_config), items, dtype=dtype, progress=False)


class Session:
    """Caches for one model plus the bookkeeping to feed requests step by step.

    Each request gets a state slot and its own (deliberately non-contiguous) KV pages.
    """

    def __init__(self, model: CausalLM, max_tokens: int, num_requests: int = 1, page_size: int = 16):
        self.model = model
        pages_per_request = (max_tokens + page_size - 1) // page_size
        num_pages = pages_per_request * num_requests + 3
        self.kv, self.states = model.allocate_caches(num_pages, page_size, num_requests + 2)
        # Interleave page ownership and skip slot 0 so wrong indexing cannot go unnoticed.
        page_ids = torch.randperm(num_pages, generator=torch.Generator().manual_seed(num_pages))
        owned = page_ids[: pages_per_request * num_requests].view(pages_per_request, num_requests)
        self.page_table = owned.t().contiguous()
        self.state_slots = [num_requests + 1 - r for r in range(num_requests)]
        self.num_computed = [0] * num_requests
        self.last_batch: ForwardBatch | None = None  # for follow-up calls at the same positions (MTP)

    def batch(
        self, requests: Sequence[int], query_lens: Sequence[int], positions: torch.Tensor | None = None
    ) -> ForwardBatch:
        """All rows need logits; positions default to text positions (replicated for MRoPE models)."""
        mrope = self.model.config.mrope_section is not None
        return ForwardBatch.build(
            query_lens=list(query_lens),
            num_computed_tokens=[self.num_computed[r] for r in requests],
            page_table=self.page_table[list(requests)],
            state_slots=[self.state_slots[r] for r in requests],
            kv_cache=self.kv,
            state_cache=self.states,
            logits_indices=list(range(sum(query_lens))),
            positions=positions,
            mrope=mrope,
        )

    @torch.inference_mode()
    def step(
        self, requests: Sequence[int], token_chunks: Sequence[torch.Tensor]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Run one forward over the new tokens of several requests -> (logits, hidden) per request."""
        query_lens = [len(chunk) for chunk in token_chunks]
        batch = self.batch(requests, query_lens)
        self.last_batch = batch
        hidden = self.model(torch.cat(list(token_chunks)), batch)
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        for r, q in zip(requests, query_lens):
            self.num_computed[r] += q
        return list(logits.split(query_lens)), list(hidden.split(query_lens))


def run_full(model: CausalLM, input_ids: torch.Tensor) -> torch.Tensor:
    """One prefill of the whole sequence -> logits [T, V]."""
    session = Session(model, len(input_ids))
    logits, _ = session.step([0], [input_ids])
    return logits[0]


def run_chunked(model: CausalLM, input_ids: torch.Tensor, chunk_sizes: Sequence[int]) -> torch.Tensor:
    """Prefill in chunks of the given sizes (the last size repeats until the sequence ends;
    size 1 is a decode step) -> logits [T, V] of every position."""
    session = Session(model, len(input_ids))
    pieces = []
    start = 0
    index = 0
    while start < len(input_ids):
        size = chunk_sizes[min(index, len(chunk_sizes) - 1)]
        logits, _ = session.step([0], [input_ids[start : start + size]])
        pieces.append(logits[0])
        start += size
        index += 1
    return torch.cat(pieces)

