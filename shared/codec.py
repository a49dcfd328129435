"""msgpack encoding of events. Decoding is typed: a frame that does not decode as the
channel's union raises `msgspec.DecodeError` (callers drop and count it); nothing is
ever unpickled."""

from __future__ import annotations

from typing import Any

import msgspec

from ledgerserve.shared import events

_encoder = msgspec.msgpack.Encoder()


def encode(event: events.Event) -> bytes:
    return _encoder.encode(event)


class ChannelDecoder:
    """Decoder for one channel's tagged union."""

    def __init__(self, union: Any) -> None:
        self._decoder = msgspec.msgpack.Decoder(union)

    def decode(self, frame: bytes) -> Any:
        return self._decoder.decode(frame)


def to_scheduler_decoder() -> ChannelDecoder:
    return ChannelDecoder(events.ToScheduler)


def from_scheduler_decoder() -> ChannelDecoder:
    return ChannelDecoder(events.FromScheduler)


def to_worker_decoder() -> ChannelDecoder:
    return ChannelDecoder(events.ToWorker)


def from_worker_decoder() -> ChannelDecoder:
    return ChannelDecoder(events.FromWorker)


def log_event_decoder() -> ChannelDecoder:
    return ChannelDecoder(events.LogEvent)
