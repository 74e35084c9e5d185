"""ModelRunner: turns a SchedulerStep into one model traversal and sampled tokens.

It owns the device side: the model, the KV page storage, the StateImage slots and, per
slot, the logits of the last computed row (a checkpoint keeps them so an exact
full-prompt hit samples without recomputing). One host sync per step: the sampled ids.
Decode rounds replay a CUDA graph when graphs were captured (cuda_graphs.py); prefill
chunks, multi-token rows and steps that sample stored logits run eagerly.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from ninfer.engine.cuda_graphs import DecodeGraphs, graph_blocker
from ninfer.engine.sampler import Sampler, SamplingBatch
from ninfer.engine.scheduler import CopyPage, CopySlot, ResetSlot, ScheduledChunk, SchedulerStep
from ninfer.models.causal_lm import CausalLM
from ninfer.models.forward_batch import ForwardBatch

log = logging.getLogger("ninfer.engine")


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        num_pages: int,
        page_size: int,
        num_state_slots: int,
        num_valid_tokens: int | None = None,
        kv_dtype: torch.dtype | None = None,
        cuda_graph_batch_sizes: Sequence[int] = (),
        max_context: int | None = None,
    ):
        """cuda_graph_batch_sizes: decode batch sizes to capture a CUDA graph for (on CUDA,
        when the model allows it; other sizes decode eagerly); max_context bounds the
        page-table width they are captured with (default: the whole KV pool)."""
        self.model = model
        param = next(model.parameters())
        self.device = param.device
        self.kv_cache, self.state_cache = model.allocate_caches(num_pages, page_size, num_state_slots, kv_dtype)
        vocab = model.config.vocab_size
        self.slot_logits = torch.zeros(num_state_slots, vocab, dtype=torch.float32, device=self.device)
        # Embedding rows past the tokenizer's ids are padding: never sample them.
        self.num_valid_tokens = min(num_valid_tokens or vocab, vocab)
        self.mrope = model.config.mrope_section is not None
        self.sampler = Sampler()
        self.graphs: DecodeGraphs | None = None
        if cuda_graph_batch_sizes:
            self._capture_graphs(sorted(set(cuda_graph_batch_sizes)), max_context or num_pages * page_size)

    def _capture_graphs(self, batch_sizes: list[int], max_context: int) -> None:
        blocker = graph_blocker(self.model)
        if blocker is not None:
            log.info("CUDA graphs off: %s", blocker)
            return
        kv = self.kv_cache
        max_pages = min(kv.num_pages, -(-max_context // kv.page_size))
        graphs = DecodeGraphs(
            self.model, kv, self.state_cache, self.slot_logits, self.num_valid_tokens, batch_sizes, max_pages, self.sampler
        )
        try:
            graphs.capture()
        except Exception:  # noqa: BLE001 - an op that is not capture-safe must not stop the server
            log.exception("CUDA graph capture failed; decoding eagerly")
            graphs.discard_warmup_writes()
            return
        self.graphs = graphs
        log.info("CUDA graphs captured for decode batch sizes %s", ", ".join(map(str, batch_sizes)))

    @torch.inference_mode()
    def execute(self, step: SchedulerStep) -> dict[str, int]:
        self._apply_actions(step)
        if self.graphs is not None and self.graphs.can_run(step.chunks):
            return self.graphs.run(step.chunks)
        computed = [c for c in step.chunks if c.token_ids]
        if computed:
            self._forward(computed)
        to_sample = [c for c in step.chunks if c.sample]
        if not to_sample:
            return {}
        slots = torch.tensor([c.state_slot for c in to_sample], device=self.device)
        logits = self.slot_logits.index_select(0, slots)
        batch = SamplingBatch.build(
            [c.sampling for c in to_sample],
            [c.output_token_ids for c in to_sample],
            device=self.device,
            num_generated=[c.num_generated for c in to_sample],
        )
        token_ids = self.sampler.sample(logits, batch).tolist()
        return {c.request_id: t for c, t in zip(to_sample, token_ids)}

    def _apply_actions(self, step: SchedulerStep) -> None:
        states = self.state_cache
        kv = self.kv_cache
        for action in step.before:
            if isinstance(action, ResetSlot):
                if states is not None:
                    states.reset(action.slot)
                self.slot_logits[action.slot].zero_()
            elif isinstance(action, CopySlot):
                if states is not None:
                    states.copy_slot(action.src, action.dst)
                self.slot_logits[action.dst].copy_(self.slot_logits[action.src])
            elif isinstance(action, CopyPage):
                kv.k[:, action.dst].copy_(kv.k[:, action.src])
                kv.v[:, action.dst].copy_(kv.v[:, action.src])

    def _forward(self, chunks: list[ScheduledChunk]) -> None:
        max_pages = max(len(c.page_ids) for c in chunks)
        page_table = torch.zeros((len(chunks), max_pages), dtype=torch.int32)
        for row, chunk in enumerate(chunks):
            page_table[row, : len(chunk.page_ids)] = torch.tensor(chunk.page_ids, dtype=torch.int32)
        query_lens = [len(c.token_ids) for c in chunks]
        logits_rows: list[int] = []
        logits_slots: list[int] = []
        offset = 0
        for chunk, query_len in zip(chunks, query_lens):
            offset += query_len
            if chunk.compute_logits:
                logits_rows.append(offset - 1)
                logits_slots.append(chunk.state_slot)
        batch = ForwardBatch.build(
            query_lens=query_lens,
            num_computed_tokens=[c.num_computed_tokens for c in chunks],
            page_table=page_table,
            state_slots=[c.state_slot for c in chunks],
            kv_cache=self.kv_cache,
            state_cache=self.state_cache,
            logits_indices=logits_rows,
            mrope=self.mrope,
            device=self.device,
        )
        input_ids = torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.int64, device=self.device)
        hidden = self.model(input_ids, batch)
        if not logits_rows:
            return
        logits = self.model.compute_logits(hidden.index_select(0, batch.logits_indices)).float()
        if self.num_valid_tokens < logits.shape[-1]:
            logits[:, self.num_valid_tokens :] = float("-inf")
        self.slot_logits.index_copy_(0, torch.tensor(logits_slots, device=self.device), logits)
