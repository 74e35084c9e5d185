"""Messages on the wire between the API process and the engine process (msgpack)."""

from __future__ import annotations

import msgspec

from ninfer.contract.output import EngineOutput
from ninfer.contract.request import EngineRequest


class AddRequest(msgspec.Struct, tag=True):
    request: EngineRequest


class Abort(msgspec.Struct, tag=True):
    request_id: str


class Shutdown(msgspec.Struct, tag=True):
    pass


class Outputs(msgspec.Struct, tag=True):
    outputs: list[EngineOutput]


class Ready(msgspec.Struct, tag=True):
    info: dict[str, object]


class Stats(msgspec.Struct, tag=True):
    """One throughput record of the engine (its JSONL `throughput` event fields)."""

    record: dict[str, object]


class Gauges(msgspec.Struct, tag=True):
    """Pool occupancy when the engine turns idle: no throughput record covers an idle interval,
    so without it /metrics would show the last busy interval's usage for as long as it idles."""

    record: dict[str, object]


class Failed(msgspec.Struct, tag=True):
    """The engine can no longer serve: /health reports 503."""

    message: str


class Refused(msgspec.Struct, tag=True):
    """The engine will not start: an option the artifact cannot serve, or a malformed artifact
    (its start-up checks). The API process stops with the message as a command-line error."""

    message: str
    artifact: bool = False  # the artifact's fault (an ArtifactError), else an option's (a ConfigValueError)


ToEngine = AddRequest | Abort | Shutdown
FromEngine = Outputs | Ready | Failed | Refused | Stats | Gauges

_encoder = msgspec.msgpack.Encoder()
_to_engine = msgspec.msgpack.Decoder(ToEngine)
_from_engine = msgspec.msgpack.Decoder(FromEngine)


def encode(message: ToEngine | FromEngine) -> bytes:
    return _encoder.encode(message)


def decode_to_engine(data: bytes) -> ToEngine:
    return _to_engine.decode(data)


def decode_from_engine(data: bytes) -> FromEngine:
    return _from_engine.decode(data)
