"""A test-only model that answers with given token sequences instead of computing anything.

After each prompt it emits one of its scripts token by token, then the end-of-turn token. Which
script is chosen by a rule on the prompt's last computed chunk (the default rule: always the
first), so a test server can act like an agent: call a tool, then answer once the tool's result
is in the prompt. The prompt end and the chosen script live in the sequence's state slot, so
concurrent and resumed requests stay independent and checkpoints restore them like real state.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ninfer.models.causal_lm import CacheSpec, CausalLM
from ninfer.models.config import ModelConfig
from ninfer.models.forward_batch import ForwardBatch

# A rule: the tokens of a request's last prompt chunk -> the index of the script to answer with.
ScriptRule = Callable[[list[int]], int]


class ScriptedLM(CausalLM):
    def __init__(
        self, vocab_size: int, scripts: Sequence[list[int]], end_token: int, choose: ScriptRule = lambda chunk: 0
    ):
        super().__init__()
        self.config = ModelConfig(
            model_type="scripted", family="scripted", vocab_size=vocab_size, hidden_size=1,
            num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1, head_dim=1,
            intermediate_size=1, layer_types=("linear_attention",),
        )  # fmt: skip
        self.scripts = [list(script) for script in scripts]
        self.end_token = end_token
        self.choose = choose
        self.anchor = torch.nn.Parameter(torch.zeros(1))
        self.lm_head = torch.nn.Identity()

    def cache_spec(self) -> CacheSpec:
        # Two recurrent values per slot: the prompt end and the chosen script.
        return CacheSpec(num_attention_layers=1, num_kv_heads=1, head_dim=1, num_linear_layers=1,
                         conv_dim=1, conv_kernel=2, num_v_heads=1, k_head_dim=1, v_head_dim=2)

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        recurrent = batch.state_cache.recurrent[0]
        out = torch.zeros(len(input_ids), 2)
        start = 0
        for b, query_len in enumerate(batch.query_lens_cpu):
            state = recurrent[int(batch.state_slots[b])].view(-1)
            seq_len = batch.seq_lens_cpu[b]
            if query_len > 1 or state[0] == 0:  # a prompt chunk: remember where the prompt ends
                state[0] = seq_len
                state[1] = self.choose(input_ids[start : start + query_len].tolist())
            for i in range(query_len):
                position = seq_len - query_len + i
                out[start + i, 0] = position + 1 - state[0]  # index into the script
                out[start + i, 1] = state[1]
            start += query_len
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = torch.full((hidden.shape[0], self.config.vocab_size), -1e9)
        for row, (index, script_id) in enumerate(hidden.long().tolist()):
            script = self.scripts[script_id]
            logits[row, script[index] if 0 <= index < len(script) else self.end_token] = 0.0
        return logits
