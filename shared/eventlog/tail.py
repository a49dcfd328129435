"""Bad bytes where a record should start: the torn tail a crash leaves, or damage.

They are a torn tail only at the end of the run's last segment with no whole record anywhere
after them; otherwise they are damage (LogCorruption with the seq and byte offset).

Looking for a whole record after the bad bytes takes linear time however hostile they are. A
record's payload is always the msgpack array `[seq, prev_record_hash, event]`, so a place is
only a candidate when its payload starts with a 3-item array and an unsigned seq not below the
bad record's, and its length fits in what is left: the candidates are found with a C-level
pattern search, not a byte-by-byte loop. Each candidate's checksum costs its length, and all of
them together may cost at most `SCAN_BUDGET_FACTOR` times the bytes left (plus
`SCAN_BUDGET_BYTES`). A real torn tail, one cut record and maybe zeros or garbage after it,
never comes near that; bytes crafted so that it runs out are reported as damage, not dropped.
"""

from __future__ import annotations

import re
import struct
import zlib

from ledgerserve.shared.eventlog.format import MAX_RECORD_BYTES, RECORD_HEAD, LogCorruption

SCAN_BUDGET_FACTOR = 4
SCAN_BUDGET_BYTES = 1 << 24
CANDIDATE_COST_BYTES = 256  # what one candidate costs the budget before its checksum is taken
# a record's head (8 bytes) then its payload's start: a 3-item array and an unsigned int (the seq)
_PAYLOAD_START = re.compile(rb"(?=\x93[\x00-\x7f\xcc\xcd\xce\xcf])", re.DOTALL)
_UINT_FORMATS = {0xCC: ">B", 0xCD: ">H", 0xCE: ">I", 0xCF: ">Q"}


def check_bad_record(data: bytes, offset: int, length: int, seq: int, path: str, is_last: bool) -> None:
    """No whole record at `offset` (`length`: its length field, -1 if cut). Returns if that is a
    torn tail: the run's last segment, and no whole record anywhere after it. Raises
    LogCorruption otherwise."""
    runs_past = length < 0 or (length <= MAX_RECORD_BYTES and offset + 8 + length > len(data))
    if not is_last:
        reason = "segment ends in a torn record, but it is not the run's last segment" if runs_past else _reason(length)
        raise LogCorruption(reason, seq, offset, path)
    found = whole_record_after(data, offset + 1, seq)
    if found is None:
        raise LogCorruption(
            f"{len(data) - offset} bytes that are no record end the log, and too many places in them look like "
            "the start of one to tell in linear time whether a whole record follows",
            seq,
            offset,
            path,
        )
    if found:
        reason = f"record length {length} runs past the end, but whole records follow" if runs_past else _reason(length)
        raise LogCorruption(reason, seq, offset, path)


def _reason(length: int) -> str:
    if length > MAX_RECORD_BYTES:
        return f"record length {length} is implausible"
    if length == 0:
        return "record of length 0"
    return "bad record checksum"


def whole_record_after(data: bytes, start: int, min_seq: int) -> bool | None:
    """Whether a checksummed record with a seq of at least `min_seq` starts anywhere in
    data[start:] (then the bad bytes before it are damage, not a torn tail); None when the scan
    budget ran out first."""
    end = len(data)
    budget = SCAN_BUDGET_FACTOR * (end - start) + SCAN_BUDGET_BYTES
    view = memoryview(data)
    for match in _PAYLOAD_START.finditer(data, start + 8):
        offset = match.start() - 8
        budget -= CANDIDATE_COST_BYTES
        length = RECORD_HEAD.unpack_from(data, offset)[0]
        fits = 0 < length <= min(end - offset - 8, MAX_RECORD_BYTES)
        if not fits or _seq_at(data, offset + 9) < min_seq:
            if budget < 0:
                return None
            continue
        budget -= length
        if budget < 0:
            return None
        if zlib.crc32(view[offset + 8 : offset + 8 + length]) == RECORD_HEAD.unpack_from(data, offset)[1]:
            return True
    return False


def _seq_at(data: bytes, offset: int) -> int:
    """The msgpack unsigned int at `offset` (the candidate pattern guarantees its first byte); -1
    if it is cut off."""
    head = data[offset]
    if head <= 0x7F:
        return head
    fmt = _UINT_FORMATS[head]
    try:
        return struct.unpack_from(fmt, data, offset + 1)[0]
    except struct.error:
        return -1
