"""The report's PNG plots; matplotlib is optional (`pip install ninfer[report]`).

Every run of the campaign is one series (or one panel), its time axis starting at the run's
server_start, so runs of different configurations read side by side.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from ninfer.report.campaign import ServerRun
from ninfer.report.markdown import run_label

TIME_AXIS = "time since server start (s)"


def write_plots(runs: Sequence[ServerRun], out: Path) -> list[Path] | None:
    """The plots that have data, written into `out`; None when matplotlib is not installed."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    plots: list[tuple[str, Callable]] = [
        ("ttft_over_time.png", _ttft),
        ("decode_rate_over_time.png", _decode_rate),
        ("prefix_hit_per_request.png", _prefix_hits),
        ("decode_batch_over_time.png", _decode_batch),
        ("host_device_per_interval.png", _host_device),
    ]
    written = []
    for name, draw in plots:
        # A Figure on its own Agg canvas: no pyplot state, no display needed.
        figure = Figure(figsize=(9, 4.5), layout="constrained")
        FigureCanvasAgg(figure)
        if draw(figure, runs):
            figure.savefig(out / name, dpi=110)
            written.append(out / name)
    return written


def _seconds_since_start(run: ServerRun, timestamp_unix_ms: int) -> float:
    return (timestamp_unix_ms - run.origin_unix_ms) / 1000


def _label(number: int, run: ServerRun) -> str:
    return run_label(number, run.start.identity.model_id if run.start else None)


def _scatter_per_run(figure, runs: Sequence[ServerRun], points: Callable[[ServerRun], list[tuple[float, float]]],
                     title: str, xlabel: str, ylabel: str, connect: bool = False) -> bool:
    axes = figure.subplots()
    plotted = False
    for number, run in enumerate(runs, start=1):
        xy = points(run)
        if xy:
            xs, ys = zip(*xy, strict=True)
            axes.plot(xs, ys, marker="o", markersize=3, linestyle="-" if connect else "none", label=_label(number, run))
            plotted = True
    axes.set_title(title)
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    axes.grid(alpha=0.3)
    if plotted:
        axes.legend(fontsize="small")
    return plotted


def _ttft(figure, runs: Sequence[ServerRun]) -> bool:
    def points(run: ServerRun) -> list[tuple[float, float]]:
        return [(_seconds_since_start(run, e.timestamp_unix_ms), e.timings_seconds.ttft)
                for e in run.done if e.timings_seconds.ttft is not None]

    return _scatter_per_run(figure, runs, points, "Time to first token per finished request",
                            f"request end, {TIME_AXIS}", "TTFT (s)")


def _decode_rate(figure, runs: Sequence[ServerRun]) -> bool:
    def points(run: ServerRun) -> list[tuple[float, float]]:
        return [(_seconds_since_start(run, e.timestamp_unix_ms), e.decode_tokens_per_second)
                for e in run.done if e.decode_tokens_per_second is not None]

    return _scatter_per_run(figure, runs, points, "Decode rate per request: (completion tokens - 1) / decode time",
                            f"request end, {TIME_AXIS}", "decode rate (tokens/s)")


def _prefix_hits(figure, runs: Sequence[ServerRun]) -> bool:
    # Start order is turn order for one agent session: a miss mid-session shows as a dip.
    def points(run: ServerRun) -> list[tuple[float, float]]:
        ordered = sorted(run.done, key=lambda e: e.request_seq)
        fractions = [e.prefix_hit_fraction for e in ordered]
        return [(index, fraction) for index, fraction in enumerate(fractions, start=1) if fraction is not None]

    from matplotlib.ticker import MaxNLocator

    plotted = _scatter_per_run(figure, runs, points, "Prefix-cache hit fraction per finished request",
                               "request, in start order", "hit tokens / prompt tokens", connect=True)
    figure.axes[0].set_ylim(-0.02, 1.02)
    figure.axes[0].xaxis.set_major_locator(MaxNLocator(integer=True))
    return plotted


def _decode_batch(figure, runs: Sequence[ServerRun]) -> bool:
    def points(run: ServerRun) -> list[tuple[float, float]]:
        return [(_seconds_since_start(run, r.timestamp_unix_ms), r.average_size)
                for r in run.throughput if r.average_size is not None]

    # Points, not a line: intervals without decode rounds have no batch, and a line would bridge them.
    plotted = _scatter_per_run(figure, runs, points, "Decode batch per throughput interval (mean rows per round)",
                               f"interval end, {TIME_AXIS}", "decode batch (requests)")
    figure.axes[0].set_ylim(bottom=0)
    return plotted


def _host_device(figure, runs: Sequence[ServerRun]) -> bool:
    """One panel per run: each interval's host-active and device-wait seconds, stacked."""
    with_records = [(number, run) for number, run in enumerate(runs, start=1) if run.throughput]
    if not with_records:
        return False
    figure.set_size_inches(9, 1 + 3 * len(with_records))
    figure.suptitle("Host-active vs device-wait time per throughput interval")
    panels = figure.subplots(len(with_records), 1, squeeze=False)[:, 0]
    for axes, (number, run) in zip(panels, with_records, strict=True):
        records = run.throughput
        # Each bar spans its interval, ending at the record's timestamp.
        lefts = [_seconds_since_start(run, r.timestamp_unix_ms) - r.interval_seconds for r in records]
        widths = [r.interval_seconds for r in records]
        host = [r.host_work.elapsed_seconds.total for r in records]
        device = [r.host_work.device_wait_seconds for r in records]
        axes.bar(lefts, host, width=widths, align="edge", label="host active")
        axes.bar(lefts, device, width=widths, align="edge", bottom=host, label="device wait")
        axes.set_title(_label(number, run), fontsize="medium")
        axes.set_xlabel(f"interval, {TIME_AXIS}")
        axes.set_ylabel("seconds")
        axes.grid(alpha=0.3)
        axes.legend(fontsize="small")
    return True
