"""The report's text: one markdown document, printed and written to report.md."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime

from ninfer.report.campaign import Campaign
from ninfer.report.distribution import Distribution
from ninfer.report.summary import RunSummary

NONE = "–"


def render_markdown(campaign: Campaign, summaries: Sequence[RunSummary]) -> str:
    skipped = campaign.skipped_by_kind()
    skipped_text = ", ".join(f"{count} {kind}" for kind, count in skipped.items() if count)
    lines = [
        f"# Request log report: {campaign.path.name}",
        "",
        f"`{campaign.path}`: {campaign.lines_read:,} lines, {campaign.events_read:,} events read, "
        f"{len(campaign.skipped):,} lines skipped{f' ({skipped_text})' if skipped_text else ''}; "
        f"{len(summaries)} server run{'s' if len(summaries) != 1 else ''}.",
    ]
    for number, summary in enumerate(summaries, start=1):
        lines += ["", *_run_section(number, summary)]
    return "\n".join(lines) + "\n"


def run_label(number: int, model_id: str | None) -> str:
    """How the text and the plots name a run."""
    return f"Run {number}: {model_id or 'unknown model'}"


def _run_section(number: int, summary: RunSummary) -> list[str]:
    started_at = datetime.fromtimestamp(summary.start_unix_ms / 1000, tz=UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    lines = [
        f"## {run_label(number, summary.model_id)}",
        "",
        f"Started {started_at}; instance `{summary.instance_id}`"
        + (f", device {summary.device}, dtype {summary.dtype}"
           f"{f', weights {summary.weight_format}' if summary.weight_format else ''}." if summary.model_id is not None
           else "; its server_start is not in the file."),
    ]
    if summary.capacities:
        capacities = [[name, str(value)] for name, value in summary.capacities.items()]
        lines += ["", *_table(["capacity", "value"], capacities)]
    lines += ["", "### Requests", "", *_table(["outcome", "requests"], _outcomes(summary))]
    lines += ["", "### Latency", "", *_table(["metric", "samples", "p50", "p90", "p99"], [
        _distribution_row("TTFT (ms)", summary.ttft_seconds, 1000),
        _distribution_row("end to end (ms)", summary.e2e_seconds, 1000),
        _distribution_row("inter-token (ms)", summary.inter_token_seconds, 1000,
                          f"{summary.inter_token_seconds.samples:,} gaps in {summary.inter_token_requests:,} requests"),
        _distribution_row("decode rate per request (tok/s)", summary.decode_tokens_per_second, 1),
    ])]
    lines += ["", "Percentiles interpolate linearly between the closest samples. Decode rate: completion tokens "
              "after the first over the first-to-last token time, for requests with at least two tokens."]
    lines += ["", "### Prefix cache", "", *_prefix_cache(summary)]
    lines += ["", "### Engine throughput records", "", *_throughput(summary)]
    if summary.cache.records:
        lines += ["", "### Context cache (throughput records)", "", *_context_cache(summary)]
    return lines


def _outcomes(summary: RunSummary) -> list[list[str]]:
    rows = [["started", f"{summary.started:,}"], ["done", f"{summary.done:,}"]]
    rows += [[f"error: {phase}, {code or 'no code'}", f"{count:,}"] for (phase, code), count in summary.errors.items()]
    rows += [[f"rejected: {code or 'no code'}", f"{count:,}"] for code, count in summary.rejected.items()]
    rows.append(["started without an end in the file", f"{summary.without_terminal:,}"])
    return rows


def _distribution_row(metric: str, distribution: Distribution, scale: float, samples: str | None = None) -> list[str]:
    values = [distribution.p50, distribution.p90, distribution.p99]
    return [metric, samples or f"{distribution.samples:,}",
            *(NONE if value is None else f"{value * scale:,.1f}" for value in values)]


def _prefix_cache(summary: RunSummary) -> list[str]:
    lines = [
        f"Finished requests: {summary.prompt_tokens:,} prompt tokens, {summary.prefix_hit_tokens:,} of them reused "
        f"from the prefix cache (hit fraction {_fraction(summary.prefix_hit_fraction)}, {summary.done:,} requests).",
    ]
    if summary.reuse_paths:
        rows = [[path, f"{reuse.requests:,}", f"{reuse.prompt_tokens:,}", f"{reuse.hit_tokens:,}",
                 _fraction(reuse.hit_fraction)] for path, reuse in summary.reuse_paths.items()]
        lines += ["", *_table(["reuse path", "requests", "prompt tokens", "hit tokens", "hit fraction"], rows)]
    return lines


def _throughput(summary: RunSummary) -> list[str]:
    totals = summary.throughput
    if not totals.records:
        return ["No throughput records (the engine writes one per --log-stats-interval-ms while it works)."]
    host = totals.host_seconds
    mean_size = NONE if totals.mean_average_size is None else f"{totals.mean_average_size:.2f}"
    rows_per_round = NONE if totals.rows_per_round is None else f"{totals.rows_per_round:.2f}"
    lines = [
        f"{totals.records:,} records over {totals.interval_seconds:,.2f} s, the engine active "
        f"{totals.active_seconds:,.2f} s of it.",
        "",
        *_table(["quantity", "value"], [
            ["prefill tokens", f"{totals.prefill_tokens:,}"],
            ["decode tokens", f"{totals.decode_tokens:,}"],
            ["decode batch: mean of the records' average_size",
             f"{mean_size} ({totals.batch_records:,} records with decode rounds)"],
            ["decode batch: row-rounds / rounds", f"{rows_per_round} ({totals.decode_rounds:,} rounds)"],
            ["host active (s)", f"{host:,.3f}"],
            ["device wait (s)", f"{totals.device_wait_seconds:,.3f}"],
        ]),
        "",
        *_table(["host phase", "seconds", "share of host active"], [
            [phase, f"{seconds:,.3f}", f"{100 * seconds / host:.1f}%" if host else NONE]
            for phase, seconds in totals.host_phase_seconds.items()
        ]),
    ]
    if totals.detail_invocations:
        lines += ["", "Host slow paths (already inside the phases above, not added to them):", "",
                  *_table(["slow path", "seconds", "invocations", "ms per invocation"], [
                      [name, f"{totals.detail_seconds.get(name, 0.0):,.3f}", f"{count:,}",
                       f"{1000 * totals.detail_seconds.get(name, 0.0) / count:,.3f}" if count else NONE]
                      for name, count in totals.detail_invocations.items()
                  ])]
    return lines


def _context_cache(summary: RunSummary) -> list[str]:
    cache = summary.cache
    hits = ", ".join(f"{path} {count:,}" for path, count in sorted(cache.hits.items())) or "none"
    stops = ", ".join(f"{reason} {count:,}" for reason, count in sorted(cache.stop_reasons.items())) or "none"
    rows = [
        ["admissions resuming a checkpoint", f"{sum(cache.hits.values()):,} ({hits}), {cache.hit_tokens:,} tokens"],
        ["admissions from the root", f"{cache.misses:,}"],
        ["historical forks", f"{cache.historical_forks:,}"],
        ["checkpoints captured", f"{sum(cache.captures.values()):,}"],
        ["state spills / restores", f"{cache.state_spills:,} / {cache.state_restores:,}"],
        ["KV spills / restores", f"{cache.kv_spills:,} / {cache.kv_restores:,}"],
        ["copy-on-write pages", f"{cache.cow_pages:,}"],
        ["adoptions", f"{cache.adoptions:,}"],
        ["checkpoints dropped", f"{cache.drops:,}"],
        ["pressure searches", f"{cache.pressure_searches:,} ({stops})"],
        ["searches that hit a bound", f"{cache.budget_exhausted:,}"],
        ["root fallbacks despite a hit", f"{cache.maximal_root_fallbacks:,}"],
        *([f"pressure on {owner} checkpoints: state spills, KV spills, evictions",
           ", ".join(f"{counts[kind]:,}" for kind in ("state_spills", "kv_spills", "evictions"))]
          for owner, counts in cache.degradation.items()),
        ["peak materializing / capture pending", f"{cache.peak_materializing:,} / {cache.peak_capture_pending:,}"],
    ]
    last = cache.last_selection
    if last is not None:
        rows.append(["last selection", f"{last.target} ({last.reuse_path}), {last.reused_tokens:,} of "
                                        f"{last.prompt_tokens:,} tokens reused, {last.stop_reason}"])
    return [f"Sums over {cache.records:,} records.", "", *_table(["counter", "value"], rows)]


def _fraction(value: float | None) -> str:
    return NONE if value is None else f"{value:.3f}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(row) + " |" for row in rows)]
