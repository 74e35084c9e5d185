"""Which expert kernels and tiles fused_experts (triton.py) runs for a number of (token, expert)
pairs, as plain Python: the step graphs end a token bucket at each change (token_switches), so a
step padded to its bucket runs the kernels its eager step runs, and sums in the same order."""

from __future__ import annotations

DECODE_MAX_PAIRS = 128  # up to here one program per pair (no sort by expert): capture-safe decode
# FP8 and NVFP4 experts at prefill sizes: from this many pairs the experts are dequantized to x's
# dtype for torch's grouped GEMM instead of running the Triton grouped kernels on quantized tiles.
# H100, 35B-A3B, 8K tokens: 2.37 ms against 2.73, of which the dequantization is 0.96 ms whatever
# the tokens; scaled linearly the two meet near 6K tokens.
FP8_GROUPED_MM_MIN_PAIRS = 49152
_TILE_ROWS = (16, 32, 64)  # BLOCK_M steps; TILES in triton.py is keyed by them


def _next_power_of_2(value: int) -> int:
    return 1 << max(0, value - 1).bit_length()


def tile_rows(num_pairs: int, num_experts: int) -> tuple[bool, int]:
    """(decode mode, BLOCK_M) for num_pairs pairs. Decode: the pairs padded to a power of two;
    prefill: rows per expert on average, which decide how full a block is (weights are read
    once per block)."""
    if num_pairs <= DECODE_MAX_PAIRS:
        return True, max(_TILE_ROWS[0], _next_power_of_2(num_pairs))
    rows_per_expert = -(-num_pairs // num_experts)
    return False, min(_TILE_ROWS[-1], max(_TILE_ROWS[0], _next_power_of_2(rows_per_expert)))


def token_switches(num_experts: int, top_k: int) -> tuple[int, ...]:
    """The largest token count of each choice tile_rows and the grouped-GEMM threshold make, in
    order: a bucket ending at each holds only counts that choose alike."""
    counts = {max_pairs // top_k for max_pairs in (16, 32, 64, DECODE_MAX_PAIRS)}
    counts |= {rows * num_experts // top_k for rows in _TILE_ROWS[:-1]}
    counts.add(-(-FP8_GROUPED_MM_MIN_PAIRS // top_k) - 1)
    return tuple(sorted(count for count in counts if count >= 1))
