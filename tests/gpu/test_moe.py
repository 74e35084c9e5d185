"""Triton MoE (router + grouped expert GEMM) on the GPU at the 35B-A3B shapes vs ref.py; CUDA-graph decode.

The expert kernels accumulate in fp32 and round the SwiGLU activation once to bf16 before
the down projection; the reference rounds every matmul output, the activation, each
weighted expert output and the running sum to bf16. Both are compared with a float64
evaluation of the same bf16 weights and inputs, by relative norm.
"""

from __future__ import annotations

import pytest
import torch

from ninfer.kernels.moe import fused_experts, ref, route

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

NUM_EXPERTS, TOP_K, HIDDEN, INTER = 256, 8, 2048, 512
EXPERTS_REL = 1e-2  # bf16 operands, fp32 accumulation: well under the bf16 reference's own error


@pytest.fixture(scope="module")
def experts() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator("cuda").manual_seed(0)
    gate_up = (torch.randn(NUM_EXPERTS, 2 * INTER, HIDDEN, device="cuda", generator=gen) * HIDDEN**-0.5).bfloat16()
    down = (torch.randn(NUM_EXPERTS, HIDDEN, INTER, device="cuda", generator=gen) * INTER**-0.5).bfloat16()
    return gate_up, down


def _relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    out, expected = out.double(), expected.double()
    assert torch.isfinite(out).all()
    return ((out - expected).norm() / expected.norm()).item()


@pytest.mark.parametrize("num_tokens", [1, 8, 300])
@pytest.mark.parametrize("renormalize", [True, False])
def test_route_matches_reference(num_tokens: int, renormalize: bool) -> None:
    gen = torch.Generator("cuda").manual_seed(num_tokens)
    # fp32 logits: no ties, so the chosen experts must be identical.
    logits = torch.randn(num_tokens, NUM_EXPERTS, device="cuda", generator=gen) * 2
    weights, ids = route(logits, TOP_K, renormalize)
    expected_weights, expected_ids = ref.route(logits, TOP_K, renormalize)
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, expected_weights, atol=1e-6, rtol=1e-5)
    # bf16 logits (the model's) can tie: then any tied expert is a valid choice, so compare
    # the chosen probabilities, which must be the top-k values in order.
    logits = logits.bfloat16()
    weights, ids = route(logits, TOP_K, renormalize=False)
    probs = torch.softmax(logits.float(), dim=-1)
    top_values = torch.topk(probs, TOP_K, dim=-1).values
    torch.testing.assert_close(probs.gather(1, ids), top_values, atol=0, rtol=0)
    # Our softmax may differ from torch's in the last fp32 bit, which can move a bf16 rounding.
    torch.testing.assert_close(weights.float(), top_values.bfloat16().float(), atol=0, rtol=2**-8)
    assert (ids.sort(dim=1).values.diff(dim=1) > 0).all()  # k distinct experts per token


# 1..8: decode kernels (<= 128 pairs); 17, 300, 1000, 2048: sorted, BLOCK_M 16, 16, 32, 64
@pytest.mark.parametrize("num_tokens", [1, 2, 8, 17, 300, 1000, 2048])
def test_fused_experts_matches_float64(num_tokens: int, experts: tuple[torch.Tensor, torch.Tensor]) -> None:
    gate_up, down = experts
    gen = torch.Generator("cuda").manual_seed(100 + num_tokens)
    x = torch.randn(num_tokens, HIDDEN, device="cuda", generator=gen).bfloat16()
    logits = torch.randn(num_tokens, NUM_EXPERTS, device="cuda", generator=gen)
    if num_tokens == 8:
        logits[:, 17] += 20  # every token shares expert 17: its owner program serves all 8 rows
    weights, ids = ref.route(logits.bfloat16(), TOP_K, True)
    out = fused_experts(x, weights, ids, gate_up, down)
    exact = ref.fused_experts(x.double(), weights.double(), ids, gate_up.double(), down.double())
    bf16_ref = ref.fused_experts(x, weights, ids, gate_up, down)
    err, ref_err = _relative_error(out, exact), _relative_error(bf16_ref, exact)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    assert err < EXPERTS_REL
    assert err <= ref_err * 1.5  # no worse than the all-bf16 reference


@pytest.mark.parametrize("num_tokens", [300, 2048])
@pytest.mark.parametrize("grouped_mm", [False, True])
def test_prefill_paths_match_float64(num_tokens: int, grouped_mm: bool, experts) -> None:
    """Both prefill paths: the Triton grouped kernels and torch's grouped GEMM (the default on sm_90+)."""
    from ninfer.kernels.moe import triton as moe_triton

    assert moe_triton.grouped_mm_supported(torch.empty(1, device="cuda", dtype=torch.bfloat16), experts[0])
    gate_up, down = experts
    gen = torch.Generator("cuda").manual_seed(200 + num_tokens)
    x = torch.randn(num_tokens, HIDDEN, device="cuda", generator=gen).bfloat16()
    weights, ids = ref.route(torch.randn(num_tokens, NUM_EXPERTS, device="cuda", generator=gen).bfloat16(), TOP_K, True)
    out = moe_triton.fused_experts(x, weights, ids, gate_up, down, grouped_mm=grouped_mm)
    exact = ref.fused_experts(x.double(), weights.double(), ids, gate_up.double(), down.double())
    err = _relative_error(out, exact)
    ref_err = _relative_error(ref.fused_experts(x, weights, ids, gate_up, down), exact)
    assert err < EXPERTS_REL
    assert err <= ref_err * 1.5


@pytest.mark.parametrize("batch", [1, 8])
def test_decode_routing_and_experts_replay_in_a_cuda_graph(batch: int, experts) -> None:
    gate_up, down = experts
    router = (torch.randn(NUM_EXPERTS, HIDDEN, device="cuda") * HIDDEN**-0.5).bfloat16()
    x = torch.empty(batch, HIDDEN, device="cuda", dtype=torch.bfloat16)

    def step() -> torch.Tensor:
        weights, ids = route(x @ router.t(), TOP_K, True)
        return fused_experts(x, weights, ids, gate_up, down)

    x.copy_(torch.randn(batch, HIDDEN, device="cuda"))
    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()
    for _ in range(3):
        new = torch.randn(batch, HIDDEN, device="cuda").bfloat16()
        x.copy_(new)
        graph.replay()
        eager = step()
        assert torch.equal(static_out, eager)


@pytest.fixture(scope="module")
def shared_expert() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator("cuda").manual_seed(1)
    gate_up = (torch.randn(2 * INTER, HIDDEN, device="cuda", generator=gen) * HIDDEN**-0.5).bfloat16()
    down = (torch.randn(HIDDEN, INTER, device="cuda", generator=gen) * INTER**-0.5).bfloat16()
    gate = (torch.randn(1, HIDDEN, device="cuda", generator=gen) * HIDDEN**-0.5).bfloat16()
    return gate_up, down, gate


@pytest.mark.parametrize("num_tokens", [1, 2, 3, 4])
@pytest.mark.parametrize("with_shared", [True, False])
def test_moe_block_matches_float64(num_tokens: int, with_shared: bool, experts, shared_expert) -> None:
    """The fused decode block (router choice, experts, shared expert in two launches)."""
    from ninfer.kernels.moe_block import moe_block, ref as block_ref

    gen = torch.Generator("cuda").manual_seed(300 + num_tokens)
    x = torch.randn(num_tokens, HIDDEN, device="cuda", generator=gen).bfloat16()
    logits = torch.randn(num_tokens, NUM_EXPERTS, device="cuda", generator=gen)
    if num_tokens == 4:
        logits[:, 17] += 20  # every token streams expert 17 on its own
    logits = logits.bfloat16()
    shared = shared_expert if with_shared else (None, None, None)
    out = moe_block(x, logits, TOP_K, True, *experts, *shared)
    doubled = [None if w is None else w.double() for w in (*experts, *shared)]
    # The float64 evaluation takes the experts the bf16 router chose (float64 logits could break a tie otherwise).
    weights, ids = ref.route(logits, TOP_K, True)
    exact = ref.fused_experts(x.double(), weights.double(), ids, *doubled[:2])
    if with_shared:
        act = torch.nn.functional.linear(x.double(), doubled[2])
        act = torch.nn.functional.silu(act[:, :INTER]) * act[:, INTER:]
        exact = exact + torch.nn.functional.linear(act, doubled[3]) * torch.sigmoid(x.double() @ doubled[4].t())
    bf16_ref = block_ref.moe_block(x, logits, TOP_K, True, *experts, *shared)
    err, ref_err = _relative_error(out, exact), _relative_error(bf16_ref, exact)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    assert err < EXPERTS_REL
    assert err <= ref_err * 1.5  # no worse than the all-bf16 reference


@pytest.mark.parametrize("num_tokens", [1, 4])
def test_moe_block_replays_in_a_cuda_graph(num_tokens: int, experts, shared_expert) -> None:
    from ninfer.kernels.moe_block import moe_block
    from tests.gpu.graph_replay import assert_replay_equals_eager

    router = (torch.randn(NUM_EXPERTS, HIDDEN, device="cuda") * HIDDEN**-0.5).bfloat16()

    def fresh(seed: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator("cuda").manual_seed(seed)
        return {"x": torch.randn(num_tokens, HIDDEN, device="cuda", generator=gen).bfloat16()}

    def step(inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        x = inputs["x"]
        return [moe_block(x, x @ router.t(), TOP_K, True, *experts, *shared_expert)]

    assert_replay_equals_eager(step, fresh)


@pytest.mark.parametrize("batch", [1, 4, 8])  # 1 and 4: the fused block; 8: route + grouped experts
@pytest.mark.parametrize("weights", ["unquantized", "nvfp4"])
def test_layer_graph_decode_matches_reference_ops(batch: int, weights: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """SparseMoE (256 experts, top-8, shared expert) on the fast ops, one CUDA graph replayed
    per decode step, against the same layer on the reference ops. nvfp4: the experts and the
    shared expert's projections quantized (Nvfp4Experts, Nvfp4Linear), the router kept.

    In fp32: bf16 router logits tie often enough at the top-8 boundary that the two routers
    could pick different (equally valid) experts; fp32 logits do not tie. The expert GEMMs
    then run in tf32 (Triton's fp32 dot), about 1e-3 relative."""
    from ninfer.models.config import ModelConfig
    from ninfer.models.layers.moe import SparseMoE

    config = ModelConfig(
        model_type="qwen3_5_moe_text",
        family="qwen3_5",
        vocab_size=32,
        hidden_size=HIDDEN,
        num_hidden_layers=1,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        intermediate_size=0,
        num_experts=NUM_EXPERTS,
        num_experts_per_tok=TOP_K,
        moe_intermediate_size=INTER,
        shared_expert_intermediate_size=INTER,
    )
    torch.manual_seed(0)
    layer = SparseMoE(config).to("cuda")
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_(0.0, param.shape[-1] ** -0.5)
        if weights == "nvfp4":
            from ninfer.models.quant.nvfp4 import quantize_nvfp4_

            assert quantize_nvfp4_(layer, skip=("gate",)) == 3  # experts, shared gate_up and down
    x = torch.empty(batch, HIDDEN, device="cuda")
    with torch.no_grad():
        x.normal_()
        layer(x)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = layer(x)
        for _ in range(3):
            new = torch.randn(batch, HIDDEN, device="cuda")
            x.copy_(new)
            graph.replay()
            monkeypatch.setenv("NINFER_KERNELS", "ref")
            expected = layer(new)
            monkeypatch.delenv("NINFER_KERNELS")
            err = _relative_error(static_out, expected)
            assert err < EXPERTS_REL


def test_expert_order_matches_a_stable_argsort() -> None:
    from ninfer.kernels.moe import triton as moe_triton

    gen = torch.Generator("cuda").manual_seed(3)
    ids = torch.randint(0, NUM_EXPERTS, (8192, TOP_K), device="cuda", generator=gen)
    sorted_tokens, rows, ends = moe_triton.expert_order(ids, NUM_EXPERTS)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    assert torch.equal(sorted_tokens, order // TOP_K)
    assert torch.equal(rows[order], torch.arange(flat.numel(), device="cuda"))
    assert torch.equal(ends.long(), torch.bincount(flat, minlength=NUM_EXPERTS).cumsum(0))
