"""Campaign: a request-log file read into its server runs, with the lines it could not use.

The server appends, so one file may hold several runs; each run's events share its
`server_instance_id`. A line that is not JSON (a run killed mid-write leaves half a line), an
event of another schema or version, or an event whose fields do not fit is skipped and
counted, never fatal.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from ninfer.report.events import (
    EVENT_TYPES,
    Envelope,
    RequestDone,
    RequestError,
    RequestRejected,
    RequestStart,
    ServerStart,
    Throughput,
)
from ninfer.server.request_events import SCHEMA, SCHEMA_VERSION

NOT_JSON = "not JSON"
OTHER_SCHEMA = "another schema or version"
MALFORMED = "malformed event"


class CampaignError(Exception):
    """The file cannot be read at all."""


@dataclass(frozen=True)
class SkippedLine:
    line_number: int
    kind: str  # NOT_JSON, OTHER_SCHEMA or MALFORMED
    reason: str


@dataclass
class ServerRun:
    instance_id: str
    first_timestamp_unix_ms: int
    start: ServerStart | None = None
    started: list[RequestStart] = field(default_factory=list)
    rejected: list[RequestRejected] = field(default_factory=list)
    done: list[RequestDone] = field(default_factory=list)
    errors: list[RequestError] = field(default_factory=list)
    throughput: list[Throughput] = field(default_factory=list)

    @property
    def origin_unix_ms(self) -> int:
        """Zero of the run's time axis: its server_start, else its first event read."""
        return self.start.timestamp_unix_ms if self.start is not None else self.first_timestamp_unix_ms

    def add(self, event_name: str, event: msgspec.Struct) -> None:
        if event_name == "server_start":
            self.start = event
        else:
            getattr(self, _RUN_LISTS[event_name]).append(event)


_RUN_LISTS = {"request_start": "started", "request_rejected": "rejected", "request_done": "done",
              "request_error": "errors", "throughput": "throughput"}


@dataclass
class Campaign:
    path: Path
    lines_read: int = 0
    events_read: int = 0
    runs: list[ServerRun] = field(default_factory=list)
    skipped: list[SkippedLine] = field(default_factory=list)

    def skipped_by_kind(self) -> dict[str, int]:
        counts = dict.fromkeys((NOT_JSON, OTHER_SCHEMA, MALFORMED), 0)
        for line in self.skipped:
            counts[line.kind] += 1
        return counts


def read_campaign(path: Path) -> Campaign:
    if not path.exists():
        raise CampaignError(f"{path}: no such file")
    if path.is_dir():
        raise CampaignError(f"{path}: is a directory, not a request log")
    campaign = Campaign(path)
    runs: dict[str, ServerRun] = {}
    try:
        with path.open("rb") as file:
            for line_number, line in enumerate(file, start=1):
                campaign.lines_read = line_number
                if not line.strip():
                    continue
                parsed = _parse(line_number, line)
                if isinstance(parsed, SkippedLine):
                    campaign.skipped.append(parsed)
                    continue
                envelope, event = parsed
                run = runs.get(envelope.server_instance_id)
                if run is None:
                    run = runs[envelope.server_instance_id] = ServerRun(envelope.server_instance_id,
                                                                        envelope.timestamp_unix_ms)
                run.add(envelope.event, event)
                campaign.events_read += 1
    except OSError as error:
        raise CampaignError(f"{path}: cannot read it: {error.strerror or error}") from error
    campaign.runs = list(runs.values())
    return campaign


def _parse(line_number: int, line: bytes) -> tuple[Envelope, msgspec.Struct] | SkippedLine:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        return SkippedLine(line_number, NOT_JSON, f"{error.msg} at column {error.colno}")
    except UnicodeDecodeError:
        return SkippedLine(line_number, NOT_JSON, "not UTF-8 text")
    if not isinstance(record, dict):
        return SkippedLine(line_number, OTHER_SCHEMA, "JSON, but not an event object")
    schema, version = record.get("schema"), record.get("schema_version")
    if schema != SCHEMA or version != SCHEMA_VERSION:
        return SkippedLine(line_number, OTHER_SCHEMA, f"schema {schema!r} version {version!r}; "
                                                      f"this report reads {SCHEMA} version {SCHEMA_VERSION}")
    try:
        envelope = msgspec.convert(record, Envelope)
        event_type = EVENT_TYPES.get(envelope.event)
        if event_type is None:
            return SkippedLine(line_number, MALFORMED, f"unknown event {envelope.event!r}")
        return envelope, msgspec.convert(record, event_type)
    except msgspec.ValidationError as error:
        return SkippedLine(line_number, MALFORMED, f"{record.get('event', 'event')}: {error}")
