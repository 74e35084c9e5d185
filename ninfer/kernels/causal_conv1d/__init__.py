"""Causal depthwise conv1d: the ops of ref.py, run by triton.py on CUDA (kernels/backend.py)."""

from ninfer.kernels.backend import dispatched
from ninfer.kernels.causal_conv1d import ref

causal_conv1d = dispatched(__name__, ref.causal_conv1d)
causal_conv1d_update = dispatched(__name__, ref.causal_conv1d_update)
commit_conv_state = dispatched(__name__, ref.commit_conv_state)
causal_conv1d_padded = dispatched(__name__, ref.causal_conv1d_padded)
