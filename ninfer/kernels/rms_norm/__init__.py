"""RMSNorm: the ops of ref.py, run by triton.py on CUDA (kernels/backend.py)."""

from ninfer.kernels.backend import dispatched
from ninfer.kernels.rms_norm import ref

rms_norm = dispatched(__name__, ref.rms_norm)
add_rms_norm = dispatched(__name__, ref.add_rms_norm)
gated_rms_norm = dispatched(__name__, ref.gated_rms_norm)
