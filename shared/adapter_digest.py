"""What an adapter version *is*: xxh64 of its `adapter_config.json` bytes followed by its
`adapter_model.safetensors` bytes. The HTTP process records it when it registers a version;
every later read (a worker's, after a CPU-tier eviction, on each rank) must hash the same,
or that version fails: other weights are never served under its prefix namespace."""

from __future__ import annotations

import xxhash


class ContentDigest:
    """Streaming: feed the config's bytes, then the weights file's bytes in order."""

    def __init__(self) -> None:
        self._hash = xxhash.xxh64(seed=0)
        self.num_bytes = 0  # fed so far

    def update(self, data: bytes | bytearray | memoryview) -> None:
        self._hash.update(data)
        self.num_bytes += memoryview(data).nbytes

    @property
    def value(self) -> int:
        """A nonzero u64 (0 means "not checked" in events)."""
        return self._hash.intdigest() or 1


def content_digest(config_bytes: bytes, weights_bytes: bytes) -> int:
    digest = ContentDigest()
    digest.update(config_bytes)
    digest.update(weights_bytes)
    return digest.value
