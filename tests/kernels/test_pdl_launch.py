"""Programmatic dependent launch of the decode-step kernels, checked without a GPU.

Every Triton kernel that runs in a decode step takes USE_PDL and is launched with
`USE_PDL=use_pdl, launch_pdl=use_pdl` (see ninfer/kernels/pdl.py). Here the launches are
recorded by a stand-in for JITFunction.run (nothing executes): with pdl_enabled forced on,
every kernel must get both; with the real pdl_enabled on CPU tensors, neither. Each recorded
launch is then compiled for sm_90 (Triton compiles on CPU) and its PTX must start with
griddepcontrol.wait, before any global store and before any branch, so that no program
touches memory the previous kernel may still be writing or reading; only the kernels in
PRE_WAIT_LOADS load before it, and only what no recent launch writes.
The GPU side (a CUDA graph of the whole chain vs eager) is tests/gpu/test_pdl.py.
"""

from __future__ import annotations

import importlib
import re
import sys

import pytest
import torch

triton = pytest.importorskip("triton")

KERNEL_MODULES = {
    "rms_norm": ("_rms_norm_kernel", "_add_rms_norm_kernel", "_gated_rms_norm_kernel"),
    "activation": ("_silu_and_mul_kernel", "_sigmoid_mul_kernel"),
    "gated_delta_rule": ("_gates_kernel", "_recurrent_kernel"),
    "causal_conv1d": ("_conv_update_kernel", "_conv_varlen_kernel"),
    "attention_prep": ("_prepare_qkv_kernel",),
    "paged_attention": ("_paged_attention_kernel", "_merge_splits_kernel"),
    "moe": ("_route_kernel", "_moe_up_kernel", "_moe_down_kernel", "_combine_kernel"),
    "moe_block": ("_block_up_kernel", "_block_down_kernel"),
    "gemv": ("_gemv_kernel", "_split_sum_kernel"),
    "nvfp4_gemv": ("_nvfp4_gemv_kernel",),
    "nvfp4_gemm": ("_nvfp4_gemm_kernel",),  # decode batches above 16 rows, and prefill
}
ALL_KERNELS = {name for names in KERNEL_MODULES.values() for name in names}


def compiled_kernel_module(monkeypatch: pytest.MonkeyPatch, name: str):
    """The kernel module `name` built for compilation (not the interpreter): every loaded kernel
    module with @triton.jit functions is dropped first, since one an interpreter test imported
    holds interpreted helpers a compilation cannot reference; sys.modules is restored afterwards."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for loaded in list(sys.modules):
        if loaded.startswith("ninfer.kernels.") and loaded.endswith((".triton", ".pdl", ".l2_prefetch")):
            monkeypatch.delitem(sys.modules, loaded)
    return importlib.import_module(name)


@pytest.fixture
def kernels(monkeypatch: pytest.MonkeyPatch):
    """The kernel modules built for compilation (not the interpreter), whatever other test
    modules imported before; sys.modules is restored afterwards."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    # With the shared @triton.jit helpers: an interpreter test may have imported them first, as
    # interpreted functions a compilation cannot reference.
    names = ["ninfer.kernels.pdl", "ninfer.kernels.l2_prefetch"] + [f"ninfer.kernels.{m}.triton" for m in KERNEL_MODULES]
    for name in names:
        monkeypatch.delitem(sys.modules, name, raising=False)
    modules = {name: importlib.import_module(name) for name in names}
    return {m: modules[f"ninfer.kernels.{m}.triton"] for m in KERNEL_MODULES}


@pytest.fixture
def launches(kernels, monkeypatch: pytest.MonkeyPatch):
    """record(force_pdl) -> [(JITFunction, args, kwargs)] of one call of every wrapper."""
    from triton.runtime.jit import JITFunction

    recorded: list = []

    def run(self, *args, grid, warmup, **kwargs):
        recorded.append((self, args, kwargs))

    monkeypatch.setattr(JITFunction, "run", run)

    def record(force_pdl: bool | None) -> list:
        if force_pdl is not None:
            for module in kernels.values():
                monkeypatch.setattr(module, "pdl_enabled", lambda tensor: force_pdl)
        recorded.clear()
        _call_every_wrapper(kernels)
        return list(recorded)

    return record


def _call_every_wrapper(k) -> None:
    gen = torch.Generator().manual_seed(0)
    bf16, f32, i64 = torch.bfloat16, torch.float32, torch.int64

    def r(*shape: int, dtype: torch.dtype = bf16) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    k["rms_norm"].rms_norm(r(3, 200), r(200), 1e-6, True)
    k["rms_norm"].add_rms_norm(r(3, 200), r(3, 200), r(200), 1e-6)
    k["rms_norm"].add_rms_norm(r(3, 200), r(3, 200), r(200), 1e-6, early_residual=True)
    k["rms_norm"].gated_rms_norm(r(3, 4, 64), r(3, 4, 64), r(64), 1e-6)
    k["rms_norm"].gated_rms_norm(r(3, 4, 64), r(3, 4, 64), r(64), 1e-6, early_gate=True)
    k["activation"].silu_and_mul(r(3, 512))
    k["activation"].sigmoid_mul(r(3, 256), r(3, 256))
    k["gated_delta_rule"].gdn_gates(r(3, 8), r(3, 8), r(8, dtype=f32), r(8, dtype=f32))
    slots = torch.tensor([2, 0, 1], dtype=i64)
    k["gated_delta_rule"].recurrent_gated_delta_rule(
        r(3, 2, 32), r(3, 2, 32), r(3, 4, 32), r(3, 4, dtype=f32), r(3, 4, dtype=f32),
        r(4, 4, 32, 32, dtype=f32), slots, (1, 1, 1),
    )
    # Speculative verification rows: the raw gates stored into the scratch, no state written.
    k["gated_delta_rule"].recurrent_gated_delta_rule_with_gates(
        r(6, 2, 32), r(6, 2, 32), r(6, 4, 32), r(6, 4), r(6, 4), r(4, dtype=f32), r(4, dtype=f32),
        r(4, 4, 32, 32, dtype=f32), slots[:2], (3, 3), False, gates_out=r(6, 8),
    )
    k["causal_conv1d"].causal_conv1d_update(r(3, 256), r(256, 4), r(4, 256, 3), slots)
    k["causal_conv1d"].causal_conv1d(r(10, 256), r(256, 4), r(4, 256, 3), slots[:2], (6, 4))
    # ... and their conv: output and input rows straight into the scratch, no state written.
    k["causal_conv1d"].causal_conv1d(
        r(8, 256), r(256, 4), r(4, 256, 3), slots[:2], (4, 4), update_state=False, out=r(8, 256), inputs_out=r(8, 256)
    )
    k_cache, v_cache = r(8, 16, 2, 64), r(8, 16, 2, 64)
    k["attention_prep"].prepare_qkv(
        r(3, 4, 64), r(3, 2, 64), r(3, 2, 64), r(64), r(64), 1e-6, True,
        r(3, 32), r(3, 32), k_cache, v_cache, torch.tensor([5, 17, 40], dtype=i64),
    )
    page_table = torch.arange(24, dtype=torch.int32).view(3, 8)
    attention = k["paged_attention"].paged_attention
    decode_starts = torch.arange(4, dtype=torch.int32)
    decode_lens = torch.tensor([9, 70, 128], dtype=torch.int32)
    attention(r(3, 4, 64), k_cache, v_cache, page_table, decode_starts, decode_lens, 0.125, max_query_len=1)
    attention(r(3, 4, 64), k_cache, v_cache, page_table, decode_starts, decode_lens, 0.125, max_query_len=1, prefetch_kv=True)
    prefill_starts = torch.tensor([0, 20, 40, 60], dtype=torch.int32)
    prefill_lens = torch.tensor([20, 70, 128], dtype=torch.int32)
    attention(r(60, 4, 64), k_cache, v_cache, page_table, prefill_starts, prefill_lens, 0.125, max_query_len=20)
    # A padded step (step graphs): a decode row's own split launch and merge, then the prompts.
    padded_starts = torch.tensor([0, 1, 40, 40], dtype=torch.int32)
    padded_lens = torch.tensor([70, 39, 0], dtype=torch.int32)
    attention(r(64, 4, 64), k_cache, v_cache, page_table, padded_starts, padded_lens, 0.125, max_query_len=64,
              prefetch_kv=True, split_short_requests=True)
    weights, ids = k["moe"].route(r(3, 16), 4, True)
    gate_up, down = r(16, 128, 64), r(16, 64, 64)
    k["moe"].fused_experts(r(3, 64), weights, ids, gate_up, down)  # decode grouping
    prefill_ids = torch.randint(0, 16, (40, 4), generator=gen)
    k["moe"].fused_experts(r(40, 64), r(40, 4), prefill_ids, gate_up, down)  # 160 pairs: sorted by expert
    shared = (r(96, 64), r(64, 48), r(1, 64))
    k["moe_block"].moe_block(r(2, 64), r(2, 16), 4, True, gate_up, down, *shared)  # decode: the fused block
    k["moe_block"].moe_block(r(1, 64), r(1, 16), 4, True, gate_up, down, *shared,
                             tiles=((8, 64, 1), (16, 64, 4, 3)))  # down split over the slots, then summed
    fp8_weight = r(1024, 2048).to(torch.float8_e4m3fn)
    k["gemv"].gemv(r(1, 2048), fp8_weight, r(1024, dtype=f32).abs())  # FMA path
    k["gemv"].gemv(r(4, 2048), fp8_weight, r(1024, dtype=f32).abs())  # tensor-core path
    k["gemv"].gemv(r(1, 4096), r(64, 4096))  # 64 rows: split K, then the split sum
    k["gemv"].gemv_silu_and_mul(r(1, 2048), fp8_weight, r(1024, dtype=f32).abs())  # gate | up epilogue, FMA
    k["gemv"].gemv_silu_and_mul(r(4, 2048), fp8_weight, r(1024, dtype=f32).abs())  # ... tensor cores
    conv = (r(256, 4), r(4, 256, 3))
    k["gemv"].gemv_causal_conv1d_update(r(1, 2048), fp8_weight, r(1024, dtype=f32).abs(), None, *conv, slots[:1])
    k["gemv"].gemv_causal_conv1d_update(r(3, 2048), fp8_weight, r(1024, dtype=f32).abs(), None, *conv, slots)
    nvfp4_codes = torch.randint(0, 256, (1024, 1024), dtype=torch.uint8, generator=gen)
    nvfp4_scales = r(1024, 128).abs().to(torch.float8_e4m3fn)
    k["nvfp4_gemv"].gemv_nvfp4(r(1, 2048), nvfp4_codes, nvfp4_scales, r(1024, dtype=f32).abs())
    k["nvfp4_gemm"].nvfp4_matmul(r(40, 2048), nvfp4_codes, nvfp4_scales, r(1024, dtype=f32).abs())


def _name(fn) -> str:
    return fn.fn.__name__


def test_every_decode_kernel_launches_with_pdl(launches) -> None:
    recorded = launches(force_pdl=True)
    assert {_name(fn) for fn, _, _ in recorded} == ALL_KERNELS
    for fn, args, kwargs in recorded:
        assert "USE_PDL" in fn.arg_names, _name(fn)
        assert kwargs.get("USE_PDL") is True and kwargs.get("launch_pdl") is True, _name(fn)


def test_no_pdl_on_cpu_tensors(launches) -> None:
    recorded = launches(force_pdl=None)  # the real pdl_enabled: CPU tensors never launch with PDL
    assert {_name(fn) for fn, _, _ in recorded} == ALL_KERNELS
    for fn, _, kwargs in recorded:
        assert kwargs.get("USE_PDL") is False and kwargs.get("launch_pdl") is False, _name(fn)


_DTYPES = {torch.uint8: "u8", torch.float8_e4m3fn: "fp8e4nv", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32", torch.int64: "i64"}


def _ptx(fn, args, kwargs) -> str:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constexprs = {}, {}
    for param in fn.params:
        value = args[param.num] if param.num < len(args) else kwargs[param.name]
        if param.is_constexpr:
            signature[param.name], constexprs[param.name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[param.name] = "*" + _DTYPES[value.dtype]
        elif isinstance(value, bool):
            signature[param.name] = "i1"
        elif isinstance(value, int):
            signature[param.name] = "i32" if -(2**31) <= value < 2**31 else "i64"
        else:
            signature[param.name] = "fp32"
    options = {key: kwargs[key] for key in ("num_warps", "num_stages", "launch_pdl") if key in kwargs}
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]


# Anything that touches global memory (an L2 prefetch included) or leaves the first basic block.
_BEFORE_WAIT = re.compile(r"\b(ld\.global|prefetch|st\.global|atom\.|red\.|cp\.async|bra|ret|exit)\b")
# Kernels that load, before the wait, only what the previous launch cannot be writing
# (ninfer/kernels/pdl.py): weights, and state that only the same kernel writes, a step
# earlier. No writes or branches before the wait even there; the results are checked on
# the GPU (each kernel's tests and the PDL chain in tests/gpu/test_pdl.py).
PRE_WAIT_LOADS = {
    # the norm weight; with early_residual / early_gate also the residual / gate, which the
    # callers guarantee were written before the previous launch
    "_rms_norm_kernel", "_add_rms_norm_kernel", "_gated_rms_norm_kernel",
    "_conv_update_kernel", "_recurrent_kernel",  # the slot, weights / gate parameters, the state
    "_gemv_kernel",  # the first weight tile (FMA path); with a conv epilogue the slots, conv weights and state
    "_nvfp4_gemv_kernel",  # the first tile of codes
    "_block_down_kernel",  # the shared expert gate's weight and x (x: written three launches earlier)
    "_paged_attention_kernel",  # prefetch_kv: the step's lengths and page table (then L2 prefetches)
}  # fmt: skip
_WRITE_OR_BRANCH = re.compile(r"\b(st\.global|atom\.|red\.|cp\.async|bra|ret|exit)\b")


@pytest.mark.slow
def test_wait_comes_first_in_the_sm90_ptx(launches) -> None:
    seen, loading_early = set(), set()
    for fn, args, kwargs in launches(force_pdl=True):
        key = (_name(fn), tuple(sorted((k, str(v)) for k, v in kwargs.items())))
        if key in seen:
            continue
        seen.add(key)
        ptx = _ptx(fn, args, kwargs)
        body = ptx[ptx.index(".entry") :]
        wait, trigger = body.find("griddepcontrol.wait"), body.find("griddepcontrol.launch_dependents")
        assert 0 <= wait < trigger, _name(fn)
        code = [line.split("//")[0].strip() for line in body[:wait].splitlines()]
        allowed_loads = _name(fn) in PRE_WAIT_LOADS
        offending = [line for line in code if (_WRITE_OR_BRANCH if allowed_loads else _BEFORE_WAIT).search(line)]
        assert not offending, (_name(fn), offending)
        if any("ld.global" in line or "prefetch" in line for line in code):
            loading_early.add(_name(fn))
    assert {name for name, _ in seen} == ALL_KERNELS
    assert loading_early == PRE_WAIT_LOADS  # the list above is what the kernels do


@pytest.mark.slow
def test_no_grid_dependency_control_without_pdl(launches) -> None:
    fn, args, kwargs = launches(force_pdl=False)[0]
    assert "griddepcontrol" not in _ptx(fn, args, kwargs)
