"""CUDA-graph decode vs eager decode: same logits, same tokens, through the real engine.

GPU tests (marked, skipped without CUDA): tiny random bf16 Llama and Qwen3.5 engines with
graphs on and off run the same staggered requests in lockstep; after every step the
per-slot logits must be bitwise equal (graph replay and eager launch the same kernels
with the same sizes) and so must the committed tokens, greedy and sampled alike.

The CPU test runs the same comparison with each "graph" replaced by a direct call of the
captured function, so the static-buffer plumbing (slot mapping, lengths, page-table rows,
packed sampling parameters, penalties) is checked in CI too.
"""

from __future__ import annotations

import argparse
import functools

import pytest
import torch
import transformers as tf

from ninfer.cli import add_serve_options, serve_config
from ninfer.config import EngineConfig
from ninfer.contract.request import EngineRequest, ThinkingBudget
from ninfer.contract.sampling import SamplingParams
from ninfer.engine.core import EngineCore
from ninfer.engine.cuda_graphs import DecodeGraphs
from ninfer.kernels.paged_attention import ref as paged_ref
from ninfer.models.config import ModelConfig
from ninfer.models.loader import load_model
from tests.models.helpers import normal_init, randomize_, save_hf, uniform_init
from tests.unit.conftest import make_byte_tokenizer

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

VOCAB = 257  # the byte tokenizer's ids
GDN_INIT = {"A_log": uniform_init(0.01, 2.0, torch.log), "linear_attn.norm.weight": normal_init(1.0, 0.3)}

ARCHITECTURES = {
    # Llama-family plain attention, head_dim 64, GQA 2.
    "llama": lambda: tf.LlamaForCausalLM(
        tf.LlamaConfig(
            vocab_size=VOCAB, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=512, num_hidden_layers=2, max_position_embeddings=1024,
        )
    ),
    # Qwen3.5 dense hybrid: GDN layers + gated attention with the real head_dim 256, GQA 3.
    "qwen3_5": lambda: tf.Qwen3_5ForCausalLM(
        tf.Qwen3_5TextConfig(
            vocab_size=VOCAB, hidden_size=256, num_attention_heads=6, num_key_value_heads=2, head_dim=256,
            intermediate_size=512, num_hidden_layers=4, max_position_embeddings=1024,
            linear_conv_kernel_dim=4, linear_key_head_dim=32, linear_value_head_dim=32,
            linear_num_key_heads=2, linear_num_value_heads=4,
            layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        )
    ),
    # Qwen3.5 MoE hybrid: the same trunk with routed experts (top-2 of 8) and a shared expert.
    "qwen3_5_moe": lambda: tf.Qwen3_5MoeForCausalLM(
        tf.Qwen3_5MoeTextConfig(
            vocab_size=VOCAB, hidden_size=256, num_attention_heads=6, num_key_value_heads=2, head_dim=256,
            num_hidden_layers=4, max_position_embeddings=1024, num_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=128, shared_expert_intermediate_size=128,
            linear_conv_kernel_dim=4, linear_key_head_dim=32, linear_value_head_dim=32,
            linear_num_key_heads=2, linear_num_value_heads=4,
            layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        )
    ),
}


@functools.cache
def _checkpoint(arch: str, tmp_root: str):
    hf = randomize_(ARCHITECTURES[arch]().eval(), seed=11, overrides=GDN_INIT)
    return save_hf(hf, f"{tmp_root}/{arch}")


def _model(arch: str, tmp_root: str, dtype: torch.dtype, device: str):
    config, tensors = _checkpoint(arch, tmp_root)
    return load_model(ModelConfig.from_hf(config), tensors.items(), dtype=dtype, device=device, progress=False)


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("graph-models"))


def _requests() -> dict[int, list[EngineRequest]]:
    """Arrivals by step: greedy and sampled rows, penalties, a forced thinking close
    (a multi-token decode row, which must stay eager), different lengths so rows finish
    at different steps and later requests land on other graph rows. Prompt chunks ride with
    decode rows (eager), so "sampled" outlives the prompts to reach graph rounds and "late"
    outlives "sampled" to reach all-greedy ones."""
    text = lambda s: [ord(c) for c in s]  # noqa: E731
    sampled = SamplingParams(temperature=0.8, top_p=0.9, top_k=12, min_p=0.02, seed=1234)
    penalised = SamplingParams(temperature=0.7, presence_penalty=0.5, frequency_penalty=0.3, seed=99)
    budget = ThinkingBudget(max_thinking_tokens=3, close_token_ids=text("</t>"), think_end_token_id=256)
    return {
        0: [EngineRequest("greedy", text("The quick brown fox jumps. " * 2), SamplingParams(temperature=0.0), max_new_tokens=14)],
        1: [EngineRequest("sampled", text("Another prompt"), sampled, max_new_tokens=25)],
        4: [
            EngineRequest("penalties", text("abcabcabc"), penalised, max_new_tokens=11),
            EngineRequest("thinking", text("<think>hm"), SamplingParams(temperature=0.0), max_new_tokens=10, thinking_budget=budget),
        ],
        12: [EngineRequest("late", text("late arrival, long enough to chunk"), SamplingParams(temperature=0.0), max_new_tokens=40)],
    }


def _lockstep(graph_core: EngineCore, eager_core: EngineCore, max_steps: int = 400) -> dict[str, list[int]]:
    """Step both engines on the same arrivals; compare slot logits after every step."""
    arrivals = _requests()
    tokens: dict[str, list[int]] = {}
    for step in range(max_steps):
        for request in arrivals.get(step, []):
            tokens[request.request_id] = []
            assert graph_core.add_request(request) == eager_core.add_request(request) == []
        if step > max(arrivals) and not graph_core.has_work:
            assert not eager_core.has_work
            return tokens
        outs_graph, outs_eager = graph_core.step(), eager_core.step()
        assert graph_core.failed is None and eager_core.failed is None
        delta_graph = [(o.request_id, o.new_token_ids, o.finish_reason) for o in outs_graph]
        delta_eager = [(o.request_id, o.new_token_ids, o.finish_reason) for o in outs_eager]
        assert delta_graph == delta_eager, f"step {step}"
        got, want = graph_core.runner.slot_logits, eager_core.runner.slot_logits
        assert torch.equal(got, want), f"step {step}: max |diff| {(got - want).abs().max().item()}"
        for rid, new, _ in delta_graph:
            tokens[rid].extend(new)
    raise AssertionError("engines did not finish")


def _count_replays(graphs: DecodeGraphs) -> dict[int | str, int]:
    """Replays by batch size, and under "chained" those of rounds launched ahead (their
    rows read the previous round's ids on the device)."""
    counts: dict[int | str, int] = {}
    run = graphs.run

    def counted(chunks, previous_ids=None, **options):
        counts[len(chunks)] = counts.get(len(chunks), 0) + 1
        if any(c.previous_row is not None for c in chunks):
            counts["chained"] = counts.get("chained", 0) + 1
        return run(chunks, previous_ids, **options)

    graphs.run = counted
    return counts


def _count_sample_replays(graphs: DecodeGraphs) -> set[tuple[int, bool]]:
    """The (batch size, all greedy) sampling graphs replayed from now on."""
    seen: set[tuple[int, bool]] = set()

    class Counted:
        def __init__(self, key, graph):
            self.key, self.graph = key, graph

        def replay(self) -> None:
            seen.add(self.key)
            self.graph.replay()

    for key, graph in list(graphs.sample_graphs.items()):
        graphs.sample_graphs[key] = Counted(key, graph)
    return seen


def _config(**overrides) -> EngineConfig:
    # Decode overlap on also on the CPU: the lockstep tests replay chained rounds there too. Prompt
    # steps eager in both engines (step graphs run their products at a bucket's row count, which
    # rounds differently: tests/gpu/test_step_graphs.py compares them).
    overrides = {"decode_overlap": True, "step_graphs": False, **overrides}
    return EngineConfig(max_concurrency=4, prefill_chunk=16, max_context=192, prefix_reuse=False, **overrides)


# ---- CPU: the plumbing -------------------------------------------------------------------
class _Direct:
    """Stands in for a CUDA graph on CPU: replay() runs the captured region itself."""

    def __init__(self, graphs: DecodeGraphs, key: tuple, region):
        self.graphs, self.key, self.region = graphs, key, region

    def replay(self) -> None:
        self.graphs._outputs[self.key] = self.region()
        self.graphs.replayed.append(self.key)


class _DirectGraphs(DecodeGraphs):
    def capture(self) -> None:
        self.replayed: list[tuple] = []
        for batch_size in self.batch_sizes:
            for key, region in self.regions(batch_size):
                self._store_graph(key, _Direct(self, key, region))


def _direct_graphs(model, runner, batch_sizes=range(1, 5)) -> _DirectGraphs:
    """Decode graphs for `runner` whose replays call the captured regions directly (CPU)."""
    graphs = _DirectGraphs(
        model, runner.kv_cache, runner.state_cache, runner.slot_logits, runner.num_valid_tokens,
        batch_sizes, -(-192 // runner.kv_cache.page_size), runner.sampler,
    )
    graphs.capture()
    return graphs


def device_lengths_only(*args, prefetch_kv: bool = False, split_short_requests: bool = False, **kwargs):
    """The reference attention reading the device lengths, as the Triton kernel does (prefetch_kv and
    split_short_requests are the kernel's launch choices: the same result)."""
    return paged_ref.paged_attention(*args, **{**kwargs, "query_lens_cpu": None, "seq_lens_cpu": None})


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_static_buffers_match_eager_on_cpu(arch, tmp_root, monkeypatch):
    # The captured region must not read host copies of the lengths: make the CPU reference
    # attention read the device tensors instead, as the Triton kernel does.
    import ninfer.models.layers.attention as attention

    monkeypatch.setattr(attention, "paged_attention", device_lengths_only)
    model = _model(arch, tmp_root, torch.float32, "cpu")
    tokenizer = make_byte_tokenizer()
    eager = EngineCore(model, tokenizer, _config(cuda_graphs=False))
    graph = EngineCore(model, tokenizer, _config())
    assert graph.runner.graphs is None  # no CUDA here: the engine itself decodes eagerly
    runner = graph.runner
    runner.graphs = _direct_graphs(model, runner)
    replays = _count_replays(runner.graphs)
    tokens = _lockstep(graph, eager)
    assert set(replays) >= {1, 2, 3, 4, "chained"}, replays  # every captured size; rounds launched ahead
    assert all(len(t) > 0 for t in tokens.values())
    # Both sampling regions served rounds: all-greedy ones (argmax alone) and mixed ones.
    sampled = {key[2] for key in runner.graphs.replayed if key[0] == "sample"}
    assert sampled == {False, True}, runner.graphs.replayed


def _constrained_requests() -> list[EngineRequest]:
    """JSON answers under grammars on the byte vocabulary, greedy and sampled."""
    from ninfer.frontend.answer_format import AnswerFormat, JsonAnswer

    schema = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 6}, "n": {"type": "integer"}},
              "required": ["word", "n"], "additionalProperties": False}
    constraint = AnswerFormat(json=JsonAnswer(schema, "response_format")).constraint(None)
    text = lambda s: [ord(c) for c in s]  # noqa: E731
    return [
        EngineRequest(f"json{i}", text(f"Answer {i}: "), SamplingParams(temperature=0.0 if i % 2 else 0.9, seed=i),
                      max_new_tokens=24, stop_token_ids=[256], constraint=constraint)
        for i in range(4)
    ]


def _tokens(core: EngineCore, requests: list[EngineRequest]) -> dict[str, list[int]]:
    """Each request's tokens, all added at once and run to the end."""
    tokens: dict[str, list[int]] = {}
    for request in requests:
        tokens[request.request_id] = []
        assert core.add_request(request) == []
    while core.has_work:
        for out in core.step():
            tokens[out.request_id].extend(out.new_token_ids)
    assert core.failed is None
    return tokens


def _constrained_tokens(core: EngineCore) -> dict[str, list[int]]:
    return _tokens(core, _constrained_requests())


def _count_deferred_samples(graphs: DecodeGraphs) -> list[int]:
    """Rounds sampled after their forward (masks given once the previous round was committed)."""
    counts = []
    sample_eagerly = graphs.sample_eagerly

    def counted(chunks):
        counts.append(len(chunks))
        return sample_eagerly(chunks)

    graphs.sample_eagerly = counted
    return counts


def _penalised_requests() -> list[EngineRequest]:
    """Greedy and sampled rows whose presence and frequency penalties change their tokens."""
    text = lambda s: [ord(c) for c in s]  # noqa: E731
    repeat = SamplingParams(temperature=0.0, presence_penalty=0.7, frequency_penalty=1.1)
    sampled = SamplingParams(temperature=0.8, top_k=12, presence_penalty=1.5, frequency_penalty=0.4, seed=5)
    return [EngineRequest("repeat", text("abcabcabc abc"), repeat, max_new_tokens=20),
            EngineRequest("sampled", text("Another prompt"), sampled, max_new_tokens=16)]


@pytest.mark.parametrize("requests", [_constrained_requests, _penalised_requests], ids=["constrained", "penalised"])
def test_rounds_launched_ahead_and_sampled_after_the_replay_equal_sync_rounds_on_cpu(tmp_root, monkeypatch, requests):
    """Under decode overlap through the graph layout, rows sampled eagerly from the replayed
    forward's logits: masked rows once the previous round is committed (output constraints),
    penalised rows counting their token in flight, read from the graphs' sampled row. The tokens
    equal the eager engine's synchronous rounds."""
    import ninfer.models.layers.attention as attention

    monkeypatch.setattr(attention, "paged_attention", device_lengths_only)
    model = _model("llama", tmp_root, torch.float32, "cpu")
    tokenizer = make_byte_tokenizer()
    sync = EngineCore(model, tokenizer, _config(cuda_graphs=False, decode_overlap=False))
    graph = EngineCore(model, tokenizer, _config())
    runner = graph.runner
    runner.graphs = _direct_graphs(model, runner)
    replays = _count_replays(runner.graphs)
    sampled_after = _count_deferred_samples(runner.graphs)
    assert _tokens(graph, requests()) == _tokens(sync, requests())
    assert replays.get("chained") and sampled_after, (replays, sampled_after)


@pytest.mark.gpu
@needs_cuda
def test_penalised_rounds_launched_ahead_equal_sync_on_gpu(tmp_root):
    model = _model("llama", tmp_root, torch.bfloat16, "cuda")
    tokenizer = make_byte_tokenizer()
    sync = EngineCore(model, tokenizer, _config(decode_overlap=False))
    graph = EngineCore(model, tokenizer, _config())
    replays = _count_replays(graph.runner.graphs)
    assert _tokens(graph, _penalised_requests()) == _tokens(sync, _penalised_requests())
    assert replays.get("chained", 0) >= 10, replays


@pytest.mark.gpu
@needs_cuda
def test_constrained_rounds_launched_ahead_equal_sync_on_gpu(tmp_root):
    model = _model("llama", tmp_root, torch.bfloat16, "cuda")
    tokenizer = make_byte_tokenizer()
    sync = _constrained_tokens(EngineCore(model, tokenizer, _config(decode_overlap=False)))
    core = EngineCore(model, tokenizer, _config())
    replays = _count_replays(core.runner.graphs)
    deferred = _count_deferred_samples(core.runner.graphs)
    assert _constrained_tokens(core) == sync
    assert replays.get("chained") and deferred, (replays, deferred)


def test_chained_rows_past_the_largest_graph_run_eagerly(tmp_root):
    """A round chained to a previous round with more rows than the largest captured graph
    (that one ran eagerly) replays only if every chained row is inside the sampled-ids row."""
    from ninfer.engine.scheduler import PENDING_TOKEN, ScheduledChunk

    model = _model("llama", tmp_root, torch.float32, "cpu")
    core = EngineCore(model, make_byte_tokenizer(), _config())
    runner = core.runner
    graphs = _direct_graphs(model, runner, (1, 2))

    def chunk(previous_row):
        return ScheduledChunk(
            request_id=f"r{previous_row}", token_ids=[PENDING_TOKEN], num_computed_tokens=5, page_ids=[0],
            state_slot=0, compute_logits=True, sample=True, sampling=SamplingParams(temperature=0.0),
            num_generated=1, output_token_ids=[], previous_row=previous_row,
        )

    assert graphs.can_run([chunk(0), chunk(1)])
    assert not graphs.can_run([chunk(0), chunk(2)])  # row 2 of a 3-row round: eager


def test_no_cuda_graph_option():
    parser = argparse.ArgumentParser()
    add_serve_options(parser)
    assert serve_config(parser.parse_args([]))[0].engine.cuda_graphs is True
    assert serve_config(parser.parse_args(["--no-cuda-graph"]))[0].engine.cuda_graphs is False
    assert serve_config(parser.parse_args([]))[0].engine.step_graph_tokens > 0
    assert serve_config(parser.parse_args(["--no-step-graphs"]))[0].engine.step_graph_tokens == 0
    assert serve_config(parser.parse_args(["--no-cuda-graph"]))[0].engine.step_graph_tokens == 0


def test_no_decode_overlap_option():
    parser = argparse.ArgumentParser()
    add_serve_options(parser)
    assert serve_config(parser.parse_args([]))[0].engine.decode_overlap is None  # on where the device is CUDA
    assert serve_config(parser.parse_args(["--no-decode-overlap"]))[0].engine.decode_overlap is False


# ---- GPU ---------------------------------------------------------------------------------
@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_graph_decode_equals_eager_on_gpu(arch, tmp_root):
    model = _model(arch, tmp_root, torch.bfloat16, "cuda")
    tokenizer = make_byte_tokenizer()
    eager = EngineCore(model, tokenizer, _config(cuda_graphs=False))
    graph = EngineCore(model, tokenizer, _config())
    assert eager.runner.graphs is None
    assert graph.runner.graphs is not None, "graphs were not captured"
    assert sorted(graph.runner.graphs.graphs) == [1, 2, 3, 4]
    assert sorted(graph.runner.graphs.sample_graphs) == [(b, greedy) for b in (1, 2, 3, 4) for greedy in (False, True)]
    replays = _count_replays(graph.runner.graphs)
    sample_replays = _count_sample_replays(graph.runner.graphs)
    tokens = _lockstep(graph, eager)
    assert set(replays) >= {1, 2, 3, 4, "chained"}, replays
    assert all(len(t) > 0 for t in tokens.values())
    assert {greedy for _, greedy in sample_replays} == {False, True}, sample_replays  # argmax-only and general


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_decode_overlap_equals_sync_on_gpu(arch, tmp_root):
    """Rounds launched ahead (graph replays reading the previous round's ids on the device)
    commit the same tokens as reading every round first, greedy and sampled alike."""
    model = _model(arch, tmp_root, torch.bfloat16, "cuda")
    tokenizer = make_byte_tokenizer()
    finals = {}
    for overlap in (False, True):
        core = EngineCore(model, tokenizer, _config(decode_overlap=overlap))
        replays = _count_replays(core.runner.graphs)
        # Four at once, into the four lanes: the rounds' rows must not differ between the
        # runs (a request admitted a round later would change later batches). No thinking
        # budget: its rows keep the rounds synchronous (penalised rows: the test above).
        text = lambda s: [ord(c) for c in s]  # noqa: E731
        sampled = lambda seed: SamplingParams(temperature=0.8, top_p=0.9, top_k=12, seed=seed)  # noqa: E731
        requests = [
            EngineRequest("greedy", text("The quick brown fox jumps. " * 2), SamplingParams(temperature=0.0), max_new_tokens=14),
            EngineRequest("sampled", text("Another prompt"), sampled(1234), max_new_tokens=9),
            EngineRequest("greedy-short", text("abc"), SamplingParams(temperature=0.0), max_new_tokens=11),
            EngineRequest("sampled-long", text("a longer prompt, chunked in prefill"), sampled(7), max_new_tokens=17),
        ]
        tokens = _tokens(core, requests)
        assert ("chained" in replays) == overlap, replays
        finals[overlap] = tokens
    assert finals[True] == finals[False]


@pytest.mark.gpu
@needs_cuda
def test_replay_writes_fresh_logits(tmp_root):
    """The static logits are rewritten by every replay (poisoned in between)."""
    model = _model("llama", tmp_root, torch.bfloat16, "cuda")
    core = EngineCore(model, make_byte_tokenizer(), _config())
    graphs = core.runner.graphs
    assert graphs is not None
    core.add_request(EngineRequest("r", [ord(c) for c in "poison test"], SamplingParams(temperature=0.0), max_new_tokens=6))
    replays = _count_replays(graphs)
    while core.has_work:
        before = replays.get(1, 0)
        with torch.inference_mode():  # the graph's outputs are inference tensors
            graphs.logits(1).fill_(float("nan"))
        core.step()
        if replays.get(1, 0) > before:
            assert torch.isfinite(graphs.logits(1)[:, : core.runner.num_valid_tokens]).all()
    assert replays.get(1, 0) >= 4
