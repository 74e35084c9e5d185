"""What each --kv-dtype costs in accuracy: KL divergence of next-token distributions vs plain KV.

One model, one long real text (this repository's docs and sources by default), prefilled in
chunks through the model's own attention path once per KV format in lockstep: the plain
cache (the model's dtype) is the reference, and at every position the KL divergence
KL(reference || quantized) of the next-token distributions and whether the argmax agrees
are recorded. Within a chunk, queries read the keys and values already stored in the
cache's format (store, then attend), so every position sees quantized history exactly as
the server computes it.

Writes kv-accuracy.json, kv-accuracy.md and kv-accuracy.png (KL by position) into --out.

  python3 benchmarks/kv_dtype_accuracy.py --tokens 4096 --out /tmp/kv
  python3 benchmarks/kv_dtype_accuracy.py --model /models/Qwen3.6-27B --device cuda --tokens 32768 --out $OUT/kv
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from ninfer.artifact import default_model_path, open_artifact
from ninfer.models.forward_batch import ForwardBatch
from ninfer.models.kv_cache import KV_DTYPES, kv_bytes_per_token

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TEXTS = [
    "docs/architecture.md",
    "docs/api.md",
    "docs/kernels.md",
    "README.md",
    "ninfer/engine/core.py",
    "ninfer/engine/scheduler/scheduler.py",
]
PAGE_SIZE = 16


class Lane:
    """One KV format's caches and the model's position in the text."""

    def __init__(self, model, kv_dtype: str, num_tokens: int):
        num_pages = -(-num_tokens // PAGE_SIZE) + 1
        self.kv, self.states = model.allocate_caches(num_pages, PAGE_SIZE, 2, kv_format=kv_dtype)
        self.page_table = torch.arange(1, num_pages, dtype=torch.int32).unsqueeze(0)  # page 0 unused
        self.num_computed = 0

    @torch.inference_mode()
    def logits(self, model, chunk: torch.Tensor, device: torch.device) -> torch.Tensor:
        batch = ForwardBatch.build(
            query_lens=[len(chunk)],
            num_computed_tokens=[self.num_computed],
            page_table=self.page_table,
            state_slots=[1],
            kv_cache=self.kv,
            state_cache=self.states,
            logits_indices=list(range(len(chunk))),
            mrope=model.config.mrope_section is not None,
            device=device,
        )
        hidden = model(chunk.to(device), batch)
        self.num_computed += len(chunk)
        return model.compute_logits(hidden[batch.logits_indices]).float()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="artifact (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--texts", nargs="*", default=DEFAULT_TEXTS, help="text files, concatenated (default: repository docs and sources)")
    parser.add_argument("--tokens", type=int, default=4096, help="positions measured (default 4096)")
    parser.add_argument("--chunk", type=int, default=512, help="prefill chunk (default 512)")
    parser.add_argument("--formats", default="int8,fp8,nvfp4,k8v4", help="comma list of --kv-dtype names to compare with bf16")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    parser.add_argument("--out", default="kv-accuracy", help="output folder")
    args = parser.parse_args(argv)
    formats = [name for name in args.formats.split(",") if name]
    unknown = [name for name in formats if name not in KV_DTYPES or name == "bf16"]
    if unknown:
        parser.error(f"unknown --formats {unknown}; choose from {[n for n in KV_DTYPES if n != 'bf16']}")

    device = torch.device(args.device)
    artifact = open_artifact(args.model or default_model_path())
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = artifact.load_model(dtype=dtype, device=device, progress=sys.stderr.isatty())
    text = "\n\n".join((ROOT / name).read_text() if not Path(name).is_absolute() else Path(name).read_text() for name in args.texts)
    ids = torch.tensor(artifact.tokenizer.encode(text)[: args.tokens + 1])
    if len(ids) <= args.tokens:
        parser.error(f"the texts hold {len(ids)} tokens; give more (--texts) or ask for fewer (--tokens)")
    num_tokens = args.tokens
    lanes = {name: Lane(model, name, num_tokens) for name in ["bf16", *formats]}
    kl = {name: torch.empty(num_tokens) for name in formats}
    agree = {name: torch.empty(num_tokens, dtype=torch.bool) for name in formats}
    reference_nll = torch.empty(num_tokens)
    started = time.perf_counter()
    for start in range(0, num_tokens, args.chunk):
        chunk = ids[start : min(start + args.chunk, num_tokens)]
        reference = torch.log_softmax(lanes["bf16"].logits(model, chunk, device), dim=-1)
        targets = ids[start + 1 : start + 1 + len(chunk)].to(device)
        reference_nll[start : start + len(chunk)] = -reference.gather(1, targets[:, None])[:, 0].cpu()
        for name in formats:
            ours = torch.log_softmax(lanes[name].logits(model, chunk, device), dim=-1)
            kl[name][start : start + len(chunk)] = (reference.exp() * (reference - ours)).sum(-1).clamp(min=0).cpu()
            agree[name][start : start + len(chunk)] = (reference.argmax(-1) == ours.argmax(-1)).cpu()
        print(f"  {start + len(chunk)}/{num_tokens} positions, {time.perf_counter() - started:.0f} s", file=sys.stderr)

    spec = model.cache_spec()
    bf16_bytes = kv_bytes_per_token(spec.num_attention_layers, spec.num_kv_heads, spec.head_dim, 2)
    results = {
        "model": artifact.model_id,
        "model_type": artifact.config.model_type,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "activation_dtype": str(dtype).removeprefix("torch."),
        "tokens": num_tokens,
        "texts": args.texts,
        "reference_perplexity": float(reference_nll.mean().exp()),
        "formats": {},
    }
    for name in formats:
        values = kl[name]
        results["formats"][name] = {
            "kv_bytes_per_token": lanes[name].kv.bytes_per_token,
            "bytes_vs_bf16": lanes[name].kv.bytes_per_token / bf16_bytes,
            "mean_kl": float(values.mean()),
            "median_kl": float(values.median()),
            "p99_kl": float(values.quantile(0.99)),
            "max_kl": float(values.max()),
            "top1_agreement": float(agree[name].float().mean()),
            "mean_kl_by_quarter": [float(part.mean()) for part in values.chunk(4)],
        }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kv-accuracy.json").write_text(json.dumps(results, indent=1) + "\n")
    lines = [
        f"KV formats vs plain {results['activation_dtype']} KV: {results['model']} on {results['device']}, "
        f"{num_tokens} positions of real text (reference perplexity {results['reference_perplexity']:.2f}).",
        "",
        "| --kv-dtype | KV bytes/token (vs bf16) | mean KL | median KL | p99 KL | max KL | top-1 agreement | mean KL by quarter of the text |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, row in results["formats"].items():
        quarters = " / ".join(f"{v:.2e}" for v in row["mean_kl_by_quarter"])
        lines.append(
            f"| {name} | {row['kv_bytes_per_token']} ({row['bytes_vs_bf16']:.2f}x) | {row['mean_kl']:.2e} | "
            f"{row['median_kl']:.2e} | {row['p99_kl']:.2e} | {row['max_kl']:.2e} | {100 * row['top1_agreement']:.1f}% | {quarters} |"
        )
    (out / "kv-accuracy.md").write_text("\n".join(lines) + "\n")
    _plot(kl, out / "kv-accuracy.png", results)
    print("\n".join(lines))
    return 0


def _plot(kl: dict[str, torch.Tensor], path: Path, results: dict) -> None:
    """KL by position, smoothed; skipped without matplotlib (`pip install ninfer[report]`)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return
    figure = Figure(figsize=(8, 4.5), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots()
    window = 64
    for name, values in kl.items():
        smooth = torch.nn.functional.avg_pool1d(values[None, None], window, stride=window)[0, 0]
        axes.plot(((torch.arange(len(smooth)) + 0.5) * window).tolist(), smooth.tolist(), label=name)
    axes.set_yscale("log")
    axes.set_xlabel("position in the text (tokens)")
    axes.set_ylabel(f"KL(plain || format), mean of {window} positions")
    axes.set_title(f"KV-cache formats on {results['model']} ({results['device']})")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
