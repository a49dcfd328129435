"""What an adapter version *is*: the SHA-256 of its `adapter_config.json` bytes followed by its
`adapter_model.safetensors` bytes, as 64 hex digits. The HTTP process records it when it
validates a version; every later read (a worker's, after a CPU-tier eviction, on each rank) must
hash the same, all 256 bits, or that version fails: other weights are never served under its
prefix namespace.

A cryptographic hash, so that whoever writes the files cannot make other bytes hash the same
(xxh64, which older logs carry in the events' `content_digest`, can be inverted). SHA-256 from
hashlib: no dependency beside the stdlib, and it releases the GIL on large buffers, so a worker
hashes on a helper thread while it reads the next chunk.
"""

from __future__ import annotations

import hashlib

SHA256_HEX_CHARS = 64


class ContentDigest:
    """Streaming: feed the config's bytes, then the weights file's bytes in order."""

    def __init__(self) -> None:
        self._hash = hashlib.sha256()
        self.num_bytes = 0  # fed so far

    def update(self, data: bytes | bytearray | memoryview) -> None:
        self._hash.update(data)
        self.num_bytes += memoryview(data).nbytes

    @property
    def value(self) -> str:
        """The SHA-256 so far, 64 lowercase hex digits ("" means "not checked" in events)."""
        return self._hash.hexdigest()


def content_sha256(config_bytes: bytes, weights_bytes: bytes) -> str:
    digest = ContentDigest()
    digest.update(config_bytes)
    digest.update(weights_bytes)
    return digest.value


def same_content(got: str, registered: str) -> bool:
    """Whether a read's SHA-256 is the registered one: all 64 hex digits of both, compared whole."""
    return len(registered) == SHA256_HEX_CHARS and got == registered


def short(sha256: str) -> str:
    """The first 16 hex digits, for messages (the check compares all of them)."""
    return sha256[:16]
