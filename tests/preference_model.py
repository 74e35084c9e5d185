"""A test-only model with a taste for closing what it opened, for constrained-decoding tests.

A random model writes a JSON string or a tool-call value until its output limit: under a grammar
it stays valid, but never finishes. This one does. Its logits are seeded noise (per prompt and
position, so sampled runs differ and greedy runs repeat) plus fixed preferences: some tokens
are liked anywhere (a quote, a closing brace, the end of the turn), and some follow a given
token (after a newline comes `</`, after `</` comes `parameter` ...). Under a grammar's mask the
liked tokens that are allowed win most draws, so strings stay short and values, parameters,
calls and answers close within a few dozen tokens.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ninfer.models.causal_lm import CacheSpec, CausalLM
from ninfer.models.config import ModelConfig
from ninfer.models.forward_batch import ForwardBatch


class PreferenceLM(CausalLM):
    def __init__(
        self,
        vocab_size: int,
        liked: Mapping[int, float],
        follows: Mapping[int, Mapping[int, float]],
        noise: float = 1.0,
        noise_rows: int = 64,
    ):
        """liked: token -> logit bonus anywhere; follows: previous token -> (token -> bonus);
        noise_rows: distinct noise vectors, one picked per (prompt, position)."""
        super().__init__()
        self.config = ModelConfig(
            model_type="preference", family="scripted", vocab_size=vocab_size, hidden_size=1,
            num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1, head_dim=1,
            intermediate_size=1, layer_types=("linear_attention",),
        )  # fmt: skip
        base = torch.zeros(vocab_size)
        for token, bonus in liked.items():
            base[token] += bonus
        generator = torch.Generator().manual_seed(0)
        self.table = noise * torch.randn(noise_rows, vocab_size, generator=generator) + base
        self.follows = {prev: dict(nexts) for prev, nexts in follows.items()}
        self.anchor = torch.nn.Parameter(torch.zeros(1))
        self.lm_head = torch.nn.Identity()

    def cache_spec(self) -> CacheSpec:
        # One recurrent value per slot: the key of the prompt (seeds the noise).
        return CacheSpec(num_attention_layers=1, num_kv_heads=1, head_dim=1, num_linear_layers=1,
                         conv_dim=1, conv_kernel=2, num_v_heads=1, k_head_dim=1, v_head_dim=1)

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        recurrent = batch.state_cache.recurrent[0]
        out = torch.zeros(len(input_ids), 3, dtype=torch.float64)
        start = 0
        for b, query_len in enumerate(batch.query_lens_cpu):
            state = recurrent[int(batch.state_slots[b])].view(-1)
            seq_len = batch.seq_lens_cpu[b]
            tokens = input_ids[start : start + query_len].tolist()
            if query_len > 1 or state[0] == 0:  # a prompt chunk: its tokens key the noise
                state[0] = float(sum((i + 1) * t for i, t in enumerate(tokens)) % 65_521 + 1)
            for i in range(query_len):
                out[start + i] = torch.tensor([seq_len - query_len + i, tokens[i], float(state[0])])
            start += query_len
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        values = hidden.long().tolist()
        picks = [(key * 1_000_003 + position * 7_919) % self.table.shape[0] for position, _, key in values]
        logits = self.table.index_select(0, torch.tensor(picks))
        for row, (_, token, _) in enumerate(values):
            for follower, bonus in self.follows.get(token, {}).items():
                logits[row, follower] += bonus
        return logits


def qwen_preferences(tokenizer) -> tuple[dict[int, float], dict[int, dict[int, float]]]:
    """(liked, follows) that close JSON and Qwen tool calls quickly on the Qwen tokenizer."""

    def one(text: str) -> int:
        ids = tokenizer.encode(text)
        assert len(ids) == 1, (text, ids)
        return ids[0]

    liked = {one(t): b for t, b in [('"', 7.0), ('"}', 6.0), ("}", 6.0), ("]", 5.0), (",", 3.0), ("\n", 7.5),
                                     ("1", 3.0), ("true", 2.0), ("null", 1.0), ("a", 2.0)]}
    liked[tokenizer.token_to_id("<|im_end|>")] = 6.0
    liked[tokenizer.token_to_id("<tool_call>")] = 6.0
    end = tokenizer.token_to_id("<|im_end|>")
    follows = {
        one("\n"): {one("</"): 12.0},
        one("</"): {one("parameter"): 12.0},
        one("parameter"): {one(">"): 12.0},
        # Mostly one call, sometimes more (a grammar may spell the closing tag in pieces).
        tokenizer.token_to_id("</tool_call>"): {end: 4.0},
        one(">"): {end: 4.0},
    }
    return liked, follows
