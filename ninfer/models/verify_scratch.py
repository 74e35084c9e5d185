"""VerifyScratch: what speculative verification rows leave behind in each Gated DeltaNet layer.

A verification step scores a request's last committed token and its drafts without writing
the request's state slot (the drafts may be rejected). Each layer keeps, per verification
row, its pre-conv q|k|v (to advance the conv state), its post-conv q|k|v and its raw gate
projections a|b (to advance the recurrent state); once the engine knows how many rows it
accepts, `CausalLM.commit_verified` replays exactly those rows into the slot, which leaves the state
plain decode would have reached. Rows are flat over the step's verification requests. The
verification kernels write these rows as they run (no copies): causal_conv1d's out and
inputs_out, recurrent_gated_delta_rule_with_gates' gates_out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class VerifyScratch:
    conv_inputs: torch.Tensor  # [num_layers, max_rows, conv_dim] pre-conv q|k|v, model dtype
    mixed: torch.Tensor  # [num_layers, max_rows, conv_dim] post-conv q|k|v, model dtype
    gates: torch.Tensor  # [num_layers, max_rows, 2 * num_v_heads] raw a | b, model dtype

    @classmethod
    def allocate(
        cls, num_layers: int, max_rows: int, conv_dim: int, num_v_heads: int, dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> VerifyScratch:
        def buffer(width: int) -> torch.Tensor:
            return torch.zeros((num_layers, max_rows, width), dtype=dtype, device=device)

        return cls(buffer(conv_dim), buffer(conv_dim), buffer(2 * num_v_heads))

    @property
    def max_rows(self) -> int:
        return self.conv_inputs.shape[1]

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv_inputs, self.mixed, self.gates))


@dataclass(frozen=True)
class VerifyRows:
    """The batch's first num_requests requests (num_tokens flat rows) are verification rows."""

    num_requests: int
    num_tokens: int
    scratch: VerifyScratch | None  # None for models without state layers
