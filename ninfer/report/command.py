"""`ninfer report LOG.jsonl [--out DIR]`: a campaign's summary on stdout and in DIR/report.md, plots beside it."""

from __future__ import annotations

import sys
from pathlib import Path

from ninfer.report.campaign import CampaignError, read_campaign
from ninfer.report.markdown import render_markdown
from ninfer.report.plots import write_plots
from ninfer.report.summary import summarize

PROG = "ninfer report"
SKIPPED_LINES_SHOWN = 20  # a damaged file could have millions: name the first ones, count the rest


def default_out(log: Path) -> Path:
    return log.with_name(f"{log.stem}-report")


def run_report(log: str, out: str | None = None) -> int:
    log_path = Path(log)
    try:
        campaign = read_campaign(log_path)
    except CampaignError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    for line in campaign.skipped[:SKIPPED_LINES_SHOWN]:
        print(f"{PROG}: {log_path}:{line.line_number}: {line.kind} ({line.reason}); skipped", file=sys.stderr)
    if len(campaign.skipped) > SKIPPED_LINES_SHOWN:
        print(f"{PROG}: ... {len(campaign.skipped) - SKIPPED_LINES_SHOWN:,} more lines skipped", file=sys.stderr)
    if not campaign.runs:
        print(f"{PROG}: error: {log_path} holds no request-log events "
              f"({campaign.lines_read:,} lines, {len(campaign.skipped):,} skipped)", file=sys.stderr)
        return 1
    text = render_markdown(campaign, [summarize(run) for run in campaign.runs])
    out_dir = Path(out) if out is not None else default_out(log_path)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "report.md").write_text(text, encoding="utf-8")
        plots = write_plots(campaign.runs, out_dir)
    except OSError as error:
        print(f"{PROG}: error: cannot write the report into {out_dir}: {error.strerror or error}", file=sys.stderr)
        return 1
    print(text)
    print(f"wrote {out_dir / 'report.md'}")
    if plots is None:
        print("plots need `pip install ninfer[report]` (matplotlib); only the markdown was written")
    else:
        print(f"wrote {len(plots)} plots: {', '.join(path.name for path in plots)}")
    return 0
