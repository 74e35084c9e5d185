"""Prefetching global memory into L2 from Triton (`prefetch.global.L2`, inline PTX).

Used before a PDL wait (ninfer.kernels.pdl) for bytes a kernel will read right after it:
a prefetch only moves lines into L2, which is where every SM's loads and stores meet, so
it can never return stale data, whatever the previous kernel is still writing. It costs
no registers, unlike an early load, and the load after the wait hits L2 instead of HBM.
Compiled kernels only: the CPU interpreter cannot run inline PTX (callers guard it with a
constexpr that is off there, such as USE_PDL).
"""

import triton
import triton.language as tl


@triton.jit
def prefetch_l2(ptrs, mask):
    """Prefetch the lines holding `ptrs` (any shape) where `mask`; one instruction per element,
    so pass one pointer per 128-byte line."""
    tl.inline_asm_elementwise(
        asm="""{
        .reg .pred p;
        setp.ne.b32 p, $2, 0;
        @p prefetch.global.L2 [$1];
        mov.b32 $0, 0;
        }""",
        constraints="=r,l,r",
        args=[ptrs, mask.to(tl.int32)],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )
