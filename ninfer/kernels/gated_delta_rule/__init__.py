"""Gated delta rule: the ops of ref.py, run by triton.py on CUDA (kernels/backend.py)."""

from ninfer.kernels.backend import dispatched
from ninfer.kernels.gated_delta_rule import ref

gdn_gates = dispatched(__name__, ref.gdn_gates)
chunk_gated_delta_rule = dispatched(__name__, ref.chunk_gated_delta_rule)
chunk_gated_delta_rule_padded = dispatched(__name__, ref.chunk_gated_delta_rule_padded)
recurrent_gated_delta_rule = dispatched(__name__, ref.recurrent_gated_delta_rule)
recurrent_gated_delta_rule_with_gates = dispatched(__name__, ref.recurrent_gated_delta_rule_with_gates)
commit_gated_delta_rule = dispatched(__name__, ref.commit_gated_delta_rule)
