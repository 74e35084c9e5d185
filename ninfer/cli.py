"""Command line: `ninfer-serve [ARTIFACT] [options]`, `ninfer serve …`, `ninfer chat …`.

Options become frozen config objects validated once; an invalid value or combination
stops start-up with a message naming the option.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from ninfer.config import (
    DEFAULT_MIXED_PREFILL_CHUNK,
    DEFAULT_PREFILL_CHUNK,
    ConfigValueError,
    EngineConfig,
    ServeConfig,
)
from ninfer.context_cost_presets import ContextCostError, read_presets
from ninfer.contract.sampling import SamplingOverrides
from ninfer.log import LEVELS


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError("must be >= 0")
    return value


def _kv_capacity(text: str) -> int | str:
    if text == "auto":
        return text
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be a positive token count or 'auto'")
    return value


def add_serve_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("artifact", nargs="?", help="HF model directory, GGUF file or .ninfer container (default: the embedded SmolLM2-135M-Instruct)")
    net = parser.add_argument_group("network")
    net.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    net.add_argument("--port", type=int, default=8080, help="listen port (default 8080)")
    net.add_argument("--api-key", help="require this value as a Bearer token or x-api-key header (default: unset)")
    net.add_argument("--model-id", help="public OpenAI model alias (default: the artifact's model_id)")
    net.add_argument("--cors", action="store_true", help="add permissive browser CORS headers (default off)")
    net.add_argument("--no-web-ui", action="store_true", help="do not serve the chat page at / (default: served on every bind, as llama-server does; it holds no secret and asks for --api-key's key like any client)")
    net.add_argument("--request-log-jsonl", metavar="FILE", help="append one JSON object per server/request/throughput event to FILE (its directory must exist; default: off)")
    net.add_argument("--max-request-mib", type=int, default=384, help="request body limit before JSON parsing (default 384)")
    engine = parser.add_argument_group("engine")
    engine.add_argument("--max-context", type=int, default=8192, help="logical context ceiling of each sequence (default 8192)")
    engine.add_argument("--kv-capacity", type=_kv_capacity, help="shared KV pool in tokens, or 'auto' to size it from free GPU memory minus 1 GiB (default: --max-context)")
    engine.add_argument("--max-concurrency", type=int, default=1, help="maximum admitted requests, 1..8 (default 1)")
    engine.add_argument("--max-pending-requests", type=_non_negative_int, default=16, help="additional requests allowed to wait for admission (default 16)")
    engine.add_argument("--pending-timeout-ms", type=int, default=30000, help="maximum preparation-plus-admission wait (default 30000)")
    engine.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK, help=f"prompt tokens a step computes while no request decodes (default {DEFAULT_PREFILL_CHUNK})")
    engine.add_argument("--mixed-prefill-chunk", type=int, default=DEFAULT_MIXED_PREFILL_CHUNK, help=f"tokens of a step that carries decoding requests' rows, theirs included (prompt tokens fill the rest, at least half): larger admits a burst sooner, smaller keeps their inter-token time closer to idle (default {DEFAULT_MIXED_PREFILL_CHUNK})")
    engine.add_argument("--device", type=int, default=0, help="CUDA device index (default 0; CPU when no GPU is present)")
    engine.add_argument("--tensor-parallel", type=int, default=1, metavar="N", help="split the model over N ranks (1, 2, 4 or 8), one engine process each, on N devices from --device on (CPU: N processes); N must divide the attention heads and the Gated DeltaNet heads and intermediate sizes (default 1)")
    engine.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"], help="weight dtype (default auto: the artifact's on GPU; on CPU float32 activations with float16 Linear weights where the CPU has AVX2)")
    engine.add_argument("--kv-dtype", default="bf16", choices=["bf16", "int8", "fp8", "nvfp4", "k8v4"], help="KV-cache storage: bf16 (unquantized, the model's dtype), int8 or fp8 (one fp32 scale per token and head), nvfp4 (e2m1 with e4m3 scales per 16 values), k8v4 (int8 keys, nvfp4 values); smaller formats hold more tokens in the same memory (default bf16)")
    engine.add_argument("--quantize", choices=["fp8", "nvfp4"], help="quantize the model's bf16 Linear layers at load: fp8 (e4m3, one scale per output channel) or nvfp4 (e2m1, e4m3 scales per 16 values, an fp32 scale per row); a checkpoint's layers already in that format stay as stored; the routed MoE experts are quantized too; embeddings, lm_head and MoE routers stay bf16; each weight is quantized as it is read, so start-up needs the quantized model, never the bf16 one (default: weights as stored)")
    engine.add_argument("--no-prefix-reuse", action="store_true", help="disable compatible-prefix caching (default: reuse on)")
    engine.add_argument("--no-cuda-graph", action="store_true", help="decode eagerly instead of replaying CUDA graphs captured at start-up (default: graphs on, CUDA only)")
    engine.add_argument("--no-step-graphs", action="store_true", help="run prompt and mixed steps eagerly instead of replaying the CUDA graphs of their token bucket (default: on with --cuda-graph)")
    engine.add_argument("--no-decode-overlap", action="store_true", help="read each decode round's tokens before launching the next (default: the next round is launched first, hiding the host's work between rounds)")
    engine.add_argument("--device-state-slots", type=_non_negative_int, help="checkpoint StateImages beyond the active lanes (default: --max-concurrency)")
    engine.add_argument("--max-private-continuations", type=_non_negative_int, help="conversations that keep private checkpoints; beyond it the least recently used conversation's are dropped (default 2 x --max-concurrency)")
    engine.add_argument("--max-shared-prefixes", type=_non_negative_int, help="shared stable-prefix checkpoints (cache breakpoints) kept engine-wide (default max(--max-concurrency, 4))")
    engine.add_argument("--max-long-anchors-per-continuation", type=_non_negative_int, help="checkpoints a long prompt leaves at its latest message starts, so an edit there reuses what precedes it (default 2)")
    engine.add_argument("--context-cost-presets", metavar="FILE", help="JSON with prefill_seconds_per_token and/or host_transfer_bytes_per_second for the cache planner (default: measured rates for known shapes, else generic)")
    engine.add_argument("--host-kv-mib", type=_non_negative_int, help="pinned host memory for the KV pages of checkpoints spilled under KV pressure, in MiB (default 8192)")
    engine.add_argument("--host-state-slots", type=_non_negative_int, help="checkpoint StateImages in pinned host memory, where device checkpoints spill instead of being dropped (default 8)")
    spec = parser.add_argument_group("speculative decoding")
    spec.add_argument("--spec", choices=["mtp", "dflash", "dflash2"], help="speculative backend, frozen at start-up: mtp (the artifact's mtp.* head), dflash or dflash2 (a drafter companion directory); default off")
    spec.add_argument("--draft-tokens", type=int, help="drafted tokens verified per round: MTP 1..5, DFlash/DFlash2 1..15 (required with --spec)")
    spec.add_argument("--no-adaptive-drafts", action="store_true", help="verify --draft-tokens drafts every round (default: a request decodes plainly while its acceptance does not pay for the round, and probes again later)")
    spec.add_argument("--lm-head-draft", action="store_true", help="draft through the reduced-vocabulary proposal head (the target still scores the whole vocabulary; default off)")
    spec.add_argument("--draft-fp8", action="store_true", help="the drafter's weights in FP8 per output channel (the MTP head's or DFlash drafter's layers, the reduced proposal head): half the bytes a draft step reads; outputs stay exact, only the drafts may change (default off)")
    vision = parser.add_argument_group("vision")
    vision.add_argument("--vision", action="store_true", help="load the vision tower and accept image and video input (default off: media requests get 400 vision_disabled)")
    vision.add_argument("--media-cache-mib", type=_non_negative_int, default=1024, help="prepared media payloads kept for reuse, LRU; 0 disables retention (default 1024)")
    vision.add_argument("--media-live-mib", type=int, default=2048, help="all live prepared payloads: cached, in preparation or referenced by requests (default 2048)")
    vision.add_argument("--media-preprocess-threads", type=_non_negative_int, default=0, help="media decode/resize/pack workers; 0 picks at most 16 from the host's cores (default 0)")
    vision.add_argument("--media-allow-private-networks", action="store_true", help="let media URLs resolve to loopback, private and link-local addresses (default: refused)")
    engine.add_argument("--in-process-engine", action="store_true", help="run the engine in a thread of the API process instead of its own process")
    gen = parser.add_argument_group("generation")
    gen.add_argument("--default-max-tokens", type=int, default=8192, help="output limit when a request omits one (default 8192)")
    gen.add_argument("--default-thinking-budget", type=int, help="positive thinking-token cap for thinking-enabled requests (default unset)")
    gen.add_argument("--no-thinking", action="store_true", help="disable thinking by default (default: thinking on)")
    gen.add_argument("--preserve-thinking", action="store_true", help="keep closed-turn assistant reasoning in prompts by default (default off)")
    gen.add_argument("--tolerant-tool-calls", action="store_true", help="recover complete Qwen calls with malformed wrapper/suffix output (default off)")
    gen.add_argument("--temperature", type=float, help="process-level temperature override, 0..2")
    gen.add_argument("--top-p", type=float, help="process-level top-p override, 0..1")
    gen.add_argument("--top-k", type=int, help="process-level top-k override, 0..20 (0 selects the top-20 cap)")
    gen.add_argument("--min-p", type=float, help="process-level min-p override, 0..1")
    gen.add_argument("--presence-penalty", type=float, help="process-level presence-penalty override, -2..2")
    gen.add_argument("--frequency-penalty", type=float, help="process-level frequency-penalty override, -2..2")
    gen.add_argument("--seed", type=int, help="fixed seed when a request omits one (default: a fresh random seed per request)")
    gen.add_argument("--greedy", action="store_true", help="force exact argmax for all requests (default off)")
    store = parser.add_argument_group("responses store")
    store.add_argument("--response-store-max-records", type=_non_negative_int, default=1024, help="maximum locally retained Responses objects (default 1024)")
    store.add_argument("--response-store-max-mib", type=_non_negative_int, default=256, help="total local Response envelope/Item/context budget in MiB (default 256)")
    logs = parser.add_argument_group("logging")
    logs.add_argument("--log-level", default="info", choices=list(LEVELS), help="stderr verbosity (default info)")
    logs.add_argument("--log-stats-interval-ms", type=_non_negative_int, default=5000, help="throughput record interval; 0 disables it (default 5000)")


def _sampling_overrides(args: argparse.Namespace) -> SamplingOverrides:
    checks = [
        ("--temperature", args.temperature, 0.0, 2.0),
        ("--top-p", args.top_p, 0.0, 1.0),
        ("--top-k", args.top_k, 0, 20),
        ("--min-p", args.min_p, 0.0, 1.0),
        ("--presence-penalty", args.presence_penalty, -2.0, 2.0),
        ("--frequency-penalty", args.frequency_penalty, -2.0, 2.0),
    ]
    for flag, value, low, high in checks:
        if value is not None and not (low <= value <= high):
            raise ConfigValueError(f"{flag} must be in {low}..{high}")
    return SamplingOverrides(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        seed=args.seed,
    )


def serve_config(args: argparse.Namespace) -> tuple[ServeConfig, bool]:
    """-> (config, kv_capacity_auto)."""
    if args.no_prefix_reuse:
        capacity_flags = {
            "--device-state-slots": args.device_state_slots,
            "--host-state-slots": args.host_state_slots,
            "--host-kv-mib": args.host_kv_mib,
            "--max-private-continuations": args.max_private_continuations,
            "--max-shared-prefixes": args.max_shared_prefixes,
            "--max-long-anchors-per-continuation": args.max_long_anchors_per_continuation,
            "--context-cost-presets": args.context_cost_presets,
        }
        given = [flag for flag, value in capacity_flags.items() if value is not None]
        if given:
            raise ConfigValueError(f"--no-prefix-reuse cannot be combined with {', '.join(given)} (a context-cache capacity)")
    if args.context_cost_presets is not None:
        try:
            read_presets(args.context_cost_presets)  # a malformed file stops start-up here, named
        except ContextCostError as error:
            raise ConfigValueError(str(error)) from error
    kv_auto = args.kv_capacity == "auto"
    engine = EngineConfig(
        max_concurrency=args.max_concurrency,
        max_pending_requests=args.max_pending_requests,
        pending_timeout_ms=args.pending_timeout_ms,
        prefill_chunk=args.prefill_chunk,
        mixed_prefill_chunk=args.mixed_prefill_chunk,
        max_context=args.max_context,
        kv_capacity=None if kv_auto else args.kv_capacity,
        device_state_slots=args.device_state_slots,
        host_state_slots=args.host_state_slots,
        host_kv_mib=args.host_kv_mib,
        max_private_continuations=args.max_private_continuations,
        max_shared_prefixes=args.max_shared_prefixes,
        max_long_anchors=args.max_long_anchors_per_continuation,
        context_cost_presets=args.context_cost_presets,
        prefix_reuse=not args.no_prefix_reuse,
        cuda_graphs=not args.no_cuda_graph,
        step_graphs=not args.no_step_graphs,
        decode_overlap=False if args.no_decode_overlap else None,
        log_stats_interval_ms=args.log_stats_interval_ms,
        spec=args.spec,
        draft_tokens=args.draft_tokens,
        lm_head_draft=args.lm_head_draft,
        draft_fp8=args.draft_fp8,
        adaptive_drafts=not args.no_adaptive_drafts,
        vision=args.vision,
        kv_dtype=args.kv_dtype,
        tensor_parallel=args.tensor_parallel,
    )
    config = ServeConfig(
        engine=engine,
        sampling=_sampling_overrides(args),
        artifact=args.artifact,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        model_id=args.model_id,
        cors=args.cors,
        web_ui=not args.no_web_ui,
        max_request_mib=args.max_request_mib,
        default_max_tokens=args.default_max_tokens,
        default_thinking_budget=args.default_thinking_budget,
        no_thinking=args.no_thinking,
        preserve_thinking=args.preserve_thinking,
        tolerant_tool_calls=args.tolerant_tool_calls,
        greedy=args.greedy,
        log_level=args.log_level,
        dtype=args.dtype,
        quantize=args.quantize,
        device_index=args.device,  # resolved by the engine: the API process never imports torch
        engine_process=not args.in_process_engine,
        response_store_max_records=args.response_store_max_records,
        response_store_max_mib=args.response_store_max_mib,
        request_log_jsonl=args.request_log_jsonl,
        media_cache_mib=args.media_cache_mib,
        media_live_mib=args.media_live_mib,
        media_preprocess_threads=args.media_preprocess_threads,
        media_allow_private_networks=args.media_allow_private_networks,
        argv=tuple(sys.argv),
    )
    return config, kv_auto


def _run_serve(args: argparse.Namespace, prog: str) -> int:
    from ninfer.artifact import ArtifactError
    from ninfer.server.api_process import ListenError, serve

    try:
        config, kv_auto = serve_config(args)
        serve(config, kv_capacity_auto=kv_auto)
    except (ConfigValueError, ArtifactError) as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 2
    except ListenError as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


def serve_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ninfer-serve", description="Serve one model over OpenAI- and Anthropic-compatible HTTP.")
    add_serve_options(parser)
    return _run_serve(parser.parse_args(argv), "ninfer-serve")


def _run_chat(args: argparse.Namespace) -> int:
    from ninfer.artifact import ArtifactError
    from ninfer.chat import run_chat

    try:
        return asyncio.run(run_chat(args))
    except (ConfigValueError, ArtifactError) as error:
        print(f"ninfer chat: error: {error}", file=sys.stderr)
        return 2


def _run_write_checkpoint(args: argparse.Namespace) -> int:
    import torch

    from ninfer.bench.checkpoint import write_random_checkpoint
    from ninfer.log import setup_logging

    setup_logging(args.log_level)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    write_random_checkpoint(args.shape, args.directory, seed=args.seed, device=device, mtp=args.mtp,
                            weights=args.weights, vision=args.vision, constant_output=args.constant_output)
    return 0


def _run_pack(args: argparse.Namespace) -> int:
    from ninfer.artifact import ArtifactError
    from ninfer.artifact.packer import pack
    from ninfer.log import setup_logging

    setup_logging(args.log_level)
    try:
        report = pack(args.source, args.out, weights=args.weights, model_id=args.model_id, progress=sys.stderr.isatty())
    except ArtifactError as error:
        print(f"ninfer pack: error: {error}", file=sys.stderr)
        return 2
    parts = f", with {', '.join(report.parts)}" if report.parts else ""
    print(
        f"{report.path}: {report.model_id}, {report.weights} weights ({report.quantized_modules} quantized layers)"
        f"{parts}; {report.num_tensors} tensors, {report.num_bytes / 1e9:.2f} GB, packed in {report.seconds:.1f} s"
    )
    return 0


def _run_verify(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ninfer.artifact import ArtifactError
    from ninfer.artifact.ninfer_file import verify_container

    try:
        mismatched = verify_container(Path(args.container), progress=sys.stderr.isatty())
    except ArtifactError as error:
        print(f"ninfer verify: error: {error}", file=sys.stderr)
        return 2
    if mismatched:
        shown = ", ".join(mismatched[:8]) + (" …" if len(mismatched) > 8 else "")
        print(f"ninfer verify: {args.container}: {len(mismatched)} tensors do not match their SHA-256: {shown}", file=sys.stderr)
        return 1
    print(f"{args.container}: every tensor matches its SHA-256")
    return 0


def _run_compile_kernels(args: argparse.Namespace) -> int:
    """Compile recorded Triton kernels into this machine's kernel cache, without a GPU."""
    from pathlib import Path

    import triton

    from ninfer.assets.qwen_tokenizer import cache_dir
    from ninfer.kernels.backend import persist_compile_caches
    from ninfer.kernels.compile_manifest import KernelManifest, precompile_workers, start_precompile

    persist_compile_caches(str(cache_dir()))
    manifests = []
    for name in args.manifests:
        manifest = KernelManifest.load(Path(name))
        if manifest is None:
            print(f"ninfer compile-kernels: error: {name}: not a kernel manifest", file=sys.stderr)
            return 2
        if manifest.triton_version != triton.__version__:
            print(f"ninfer compile-kernels: error: {name}: recorded with Triton {manifest.triton_version}, this"
                  f" install has {triton.__version__} (its kernels would not be the ones a start looks up)",
                  file=sys.stderr)  # fmt: skip
            return 2
        manifests.append((Path(name), manifest))
    workers = args.workers or precompile_workers()
    local = cache_dir() / "kernel-manifests"
    for path, manifest in manifests:
        precompile = start_precompile(manifest, workers)
        done, errors, seconds = precompile.wait()
        print(f"{path}: {done} of {len(manifest.specializations)} kernels compiled for {manifest.target['backend']}"
              f" sm_{manifest.target['arch']} in {seconds:.1f} s ({workers} processes);"
              f" {precompile.num_autotuned} autotuning results written")  # fmt: skip
        for error in errors:
            print(f"  not compiled: {error}", file=sys.stderr)
        # Kept beside the cache it filled: a start then finds this machine's record and compiles nothing ahead.
        manifest.save(local / path.name.removesuffix(".gz"))
    print(f"kernel cache: {os.environ['TRITON_CACHE_DIR']}")
    return 0


def _run_bench(args: argparse.Namespace) -> int:
    from pathlib import Path

    import torch

    from ninfer.bench.report import markdown_table, write_json, write_markdown, write_plot
    from ninfer.bench.suite import BenchOptions, Suite
    from ninfer.log import setup_logging

    setup_logging(args.log_level)
    if not torch.cuda.is_available():
        print("ninfer bench: error: needs a CUDA GPU", file=sys.stderr)
        return 2

    def ints(text: str) -> list[int]:
        return [int(x) for x in text.split(",") if x]

    try:
        options = BenchOptions(
            shapes=args.shapes.split(","),
            weights=args.weights.split(","),
            batches=ints(args.batches),
            contexts=ints(args.contexts),
            prefill_lengths=ints(args.prefill),
            prefill_chunk=args.prefill_chunk,
            decode_rounds=args.decode_rounds,
            peer=args.peer,
            cuda_graphs=not args.no_cuda_graph,
            decode_overlap=not args.no_decode_overlap,
            profile_dir=args.out if args.profile else None,
            verify_drafts=ints(args.verify_drafts),
            lm_head_draft=not args.no_lm_head_draft,
            draft_fp8=args.draft_fp8,
            kv_dtypes=args.kv_dtypes.split(","),
        )
    except ValueError as error:
        print(f"ninfer bench: error: {error}", file=sys.stderr)
        return 2
    results = Suite(options).run()
    results["command"] = "ninfer bench " + " ".join(sys.argv[2:])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(results, out)
    write_markdown(results, out)
    write_plot(results, out)
    print(markdown_table(results))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ninfer", description="NInfer: one-GPU LLM inference server.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve_parser = sub.add_parser("serve", help="run the HTTP server (same as ninfer-serve)")
    add_serve_options(serve_parser)
    chat = sub.add_parser("chat", help="one chat turn on an artifact, streamed to stdout")
    chat.add_argument("prompt", help="the user message")
    chat.add_argument("--model", help="HF model directory, GGUF file or .ninfer container (default: the embedded SmolLM2-135M-Instruct)")
    chat.add_argument("--system", help="a system message")
    chat.add_argument("--max-tokens", type=int, default=256, help="output limit (default 256)")
    chat.add_argument("--temperature", type=float, help="sampling temperature (default: the model's)")
    chat.add_argument("--seed", type=int, help="sampling seed")
    chat.add_argument("--greedy", action="store_true", help="exact argmax decoding")
    chat.add_argument("--no-thinking", action="store_true", help="disable thinking on templates with a switch")
    chat.add_argument("--device", type=int, default=0, help="CUDA device index (CPU when no GPU is present)")
    chat.add_argument("--tensor-parallel", type=int, default=1, metavar="N", help="split the model over N ranks (1, 2, 4 or 8; default 1)")
    chat.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    chat.add_argument("--log-level", default="warning", choices=list(LEVELS))
    bench = sub.add_parser("bench", help="GPU benchmark: random-weight Qwen3.5 shapes vs roofline and HF transformers")
    bench.add_argument("--shapes", default="27b,35b-a3b", help="comma list of 27b, 35b-a3b, tiny (default 27b,35b-a3b)")
    bench.add_argument("--weights", default="bf16,fp8", help="comma list of bf16, fp8 (per output channel), fp8-block (Qwen's 128x128 block scales), nvfp4 (default bf16,fp8)")
    bench.add_argument("--kv-dtypes", default="bf16", help="comma list of --kv-dtype formats to run our cases with: bf16, int8, fp8, nvfp4, k8v4 (default bf16)")
    bench.add_argument("--batches", default="1,2,4,8", help="decode batch sizes (default 1,2,4,8)")
    bench.add_argument("--contexts", default="4096,131072", help="decode context lengths (default 4096,131072)")
    bench.add_argument("--prefill", default="8192,65536", help="prefill prompt lengths (default 8192,65536)")
    bench.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK, help=f"prefill chunk (default {DEFAULT_PREFILL_CHUNK}, as ninfer-serve)")
    bench.add_argument("--decode-rounds", type=int, default=20, help="timed decode rounds per case (default 20)")
    bench.add_argument("--peer", default="hf", choices=["hf", "none"], help="run HF transformers on the same weights (default hf)")
    bench.add_argument("--no-cuda-graph", action="store_true", help="eager decode")
    bench.add_argument("--no-decode-overlap", action="store_true", help="report decode rounds with the host reading each round before launching the next (default: the next is launched first, as the engine does)")
    bench.add_argument("--profile", action="store_true", help="also profile the smallest decode case and the shortest prefill per model: kernel table (profile-*.txt), critical-path increments (increments-*.txt), timeline (trace-*.json.gz)")
    bench.add_argument("--verify-drafts", default="", help="speculative verify cases: comma list of draft counts K (e.g. 1,2,3,5,7; default none)")
    bench.add_argument("--no-lm-head-draft", action="store_true", help="verify cases draft through the full lm_head instead of the reduced-vocabulary proposal head")
    bench.add_argument("--draft-fp8", action="store_true", help="verify cases: the drafter's weights in FP8 per output channel, as ninfer-serve --draft-fp8")
    bench.add_argument("--out", default="bench-results", help="output folder for bench.json, bench.md, bench.png")
    bench.add_argument("--log-level", default="info", choices=list(LEVELS))
    write = sub.add_parser("write-checkpoint", help="write a random-weight checkpoint in the real layout (for end-to-end benchmarks)")
    write.add_argument("directory", help="output folder (tmpfs such as /dev/shm is fastest)")
    write.add_argument("--shape", default="27b", choices=["27b", "35b-a3b"], help="model shape (default 27b)")
    write.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    write.add_argument("--mtp", action="store_true", help="with the MTP head (mtp.* tensors) of the real checkpoints, for --spec mtp")
    write.add_argument("--weights", default="bf16", choices=["bf16", "fp8", "nvfp4"], help="stored format: bf16; fp8: Qwen's 128x128 block-scaled FP8; nvfp4: NVIDIA ModelOpt's NVFP4 (default bf16)")
    write.add_argument("--vision", action="store_true", help="with the VLM's vision tower (model.visual.*), for ninfer-serve --vision")
    write.add_argument("--constant-output", action="store_true", help="output norms (the trunk's and the MTP head's) zero: greedy decoding emits token 0 every step and the MTP head drafts it, so speculative rounds accept every draft (served figures at full acceptance)")
    write.add_argument("--device", help="where to build the weights (default: cuda when present, else cpu)")
    write.add_argument("--log-level", default="info", choices=list(LEVELS))
    pack = sub.add_parser("pack", help="write an artifact (HF directory, GGUF file or .ninfer) as one .ninfer container")
    pack.add_argument("source", help="the artifact to pack")
    pack.add_argument("out", help="the container to write (conventionally NAME.ninfer)")
    pack.add_argument("--weights", default="bf16", choices=["bf16", "fp8", "nvfp4"], help="bf16; fp8: FP8 checkpoint weights as stored (128x128 blocks), every other Linear layer per output channel; nvfp4: NVFP4 checkpoint weights as stored, every other Linear layer quantized to NVFP4 (default bf16)")
    pack.add_argument("--model-id", help="identity.model_id of the container (default: the source's model id)")
    pack.add_argument("--log-level", default="info", choices=list(LEVELS))
    verify = sub.add_parser("verify", help="check every tensor of a .ninfer container against its stored SHA-256")
    verify.add_argument("container", help="the .ninfer file")
    kernels = sub.add_parser(
        "compile-kernels",
        help="compile recorded Triton kernels into the kernel cache, no GPU needed (an image built so "
        "starts its first server like a restart)",
    )
    kernels.add_argument("manifests", nargs="+", help="kernel manifests, as a GPU start records them in "
                         "~/.cache/ninfer/kernel-manifests/ (file names kept: they name the model and GPU)")  # fmt: skip
    kernels.add_argument("--workers", type=int, help="compile processes (default: the CPUs but two)")
    report = sub.add_parser("report", help="summary tables and plots of a --request-log-jsonl file")
    report.add_argument("log", help="the JSONL file the server wrote (one or more server runs)")
    report.add_argument("--out", help="output folder for report.md and the PNG plots (default: <log stem>-report next to the log)")
    args = parser.parse_args(argv)
    if args.command == "write-checkpoint":
        return _run_write_checkpoint(args)
    if args.command == "serve":
        return _run_serve(args, "ninfer serve")
    if args.command == "bench":
        return _run_bench(args)
    if args.command == "pack":
        return _run_pack(args)
    if args.command == "verify":
        return _run_verify(args)
    if args.command == "compile-kernels":
        return _run_compile_kernels(args)
    if args.command == "report":
        from ninfer.report import run_report

        return run_report(args.log, args.out)
    return _run_chat(args)


if __name__ == "__main__":
    sys.exit(main())
