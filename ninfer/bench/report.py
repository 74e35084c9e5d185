"""Bench outputs: JSON, a markdown table and a PNG plot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_json(results: dict[str, Any], out: Path) -> Path:
    path = out / "bench.json"
    path.write_text(json.dumps(results, indent=2) + "\n")
    return path


def markdown_table(results: dict[str, Any]) -> str:
    ceilings = results["ceilings"]
    matmul_clock = ceilings.get("matmul_sm_clock_mhz")
    lines = [
        f"Device: {results['device']} · copy {ceilings['copy_bytes_per_s'] / 1e12:.2f} TB/s · "
        f"bf16 matmul {ceilings['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s"
        f"{f' at SM {matmul_clock:.0f} MHz' if matmul_clock else ''} (measured in this run) · torch {results['torch']}",
        "",
        "| model | weights | case | batch | tokens | result | roofline | % of roofline | peak GiB | SM MHz |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["results"]:
        unit = "s" if r["kind"] == "ttft" else "tok/s"
        if r["kind"] == "verify":
            unit += f" (k={r['draft_tokens']}, all accepted"
            unit += f"; round {r['round_ratio']:.3f}x plain)" if r.get("round_ratio") else ")"
        roof = f"{r['roofline_tokens_per_s']:,.1f}" if r["roofline_tokens_per_s"] else "–"
        frac = f"{100 * r['fraction_of_roofline']:.0f}%" if r["fraction_of_roofline"] is not None else "–"
        clock = f"{r['sm_clock_mhz']:.0f}" if r.get("sm_clock_mhz") else "–"
        lines.append(
            f"| {r['shape']} | {_weights_label(r)} | {r['kind']} | {r['batch']} | {r['tokens']:,} | "
            f"{r['tokens_per_s']:,.2f} {unit} | {roof} | {frac} | {r['peak_memory_gib']:.1f} | {clock} |"
        )
    skipped = results.get("skipped") or []  # older result files have none
    if skipped:
        lines += ["", "Not run (their KV does not fit beside the model on this device):", *(f"- {s}" for s in skipped)]
    failures = results.get("failures") or []
    if failures:
        lines += ["", "Failed:", *(f"- {f}" for f in failures)]
    return "\n".join(lines) + "\n"


def _weights_label(result: dict[str, Any]) -> str:
    """The weights, and the KV format when it is not bf16 (older result files have none)."""
    kv = result.get("kv_dtype", "bf16")
    return result["weights"] if kv == "bf16" else f"{result['weights']}, KV {kv}"


def write_markdown(results: dict[str, Any], out: Path) -> Path:
    path = out / "bench.md"
    path.write_text(markdown_table(results))
    return path


def write_plot(results: dict[str, Any], out: Path) -> Path | None:
    """Decode tok/s per case next to its roofline and the peer; None when matplotlib is absent."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    decode = [r for r in results["results"] if r["kind"] in ("decode", "hf_decode")]
    if not decode:
        return None
    labels = [f"{r['shape']} {_weights_label(r)}\n{'HF ' if r['kind'] == 'hf_decode' else ''}b{r['batch']} "
              f"{r['tokens'] // 1024}K" for r in decode]
    ours = [r["tokens_per_s"] for r in decode]
    roofs = [r["roofline_tokens_per_s"] or 0 for r in decode]
    fig, ax = plt.subplots(figsize=(max(8, len(decode) * 0.7), 4.5))
    xs = range(len(decode))
    ax.bar([x - 0.2 for x in xs], roofs, width=0.4, label="roofline (measured bandwidth)", color="#cccccc")
    colors = ["#d9534f" if r["kind"] == "hf_decode" else "#2b7bba" for r in decode]
    ax.bar([x + 0.2 for x in xs], ours, width=0.4, label="measured", color=colors)
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set_ylabel("decode tokens/s")
    ax.set_yscale("log")
    ax.set_title(f"NInfer decode on {results['device']} (red: HF transformers)")
    ax.legend()
    fig.tight_layout()
    path = out / "bench.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
