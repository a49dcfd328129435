"""Opening an adapter's files: contained, regular, read within a byte limit.

The containment rule: when the adapter directory lies inside one of the `--lora-allowed-dir`
roots (adapters loaded at run time), every file read from it must also resolve inside one
of the roots once links are followed. Adapters elsewhere (start-up `--lora-modules`, which
are trusted) may link anywhere, e.g. into a Hugging Face cache's `blobs/`. The resolved file
is opened, not the link, and anything but a regular file (a FIFO, a device) is refused
without blocking; on Linux the opened file's path is checked again, so a directory swapped
for a link between the check and the open is refused too.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence

from ledgerserve.shared.adapter_types import AdapterError

_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def is_inside(path: str, roots: Sequence[str]) -> bool:
    """Whether the real path `path` lies inside (or is) the real path of one of `roots`."""
    for root in roots:
        real_root = os.path.realpath(root)
        if os.path.commonpath([path, real_root]) == real_root:
            return True
    return False


def open_file(directory: str, name: str, roots: Sequence[str]) -> tuple[int, str]:
    """(fd, resolved path) of the regular file `name` in `directory` (a real path). With
    `roots`, the file must resolve inside one of them; a refusal never names the target."""
    real = os.path.realpath(os.path.join(directory, name))
    if roots and not is_inside(real, roots):
        raise AdapterError(f"{name} is a link that leaves --lora-allowed-dir; refused.")
    try:
        if not stat.S_ISREG(os.stat(real).st_mode):
            raise AdapterError(f"{name} is not a regular file.")
        fd = os.open(real, _OPEN_FLAGS)  # O_NOFOLLOW: a link put there since is refused
    except FileNotFoundError:
        raise AdapterError(f"The adapter has no {name}.") from None
    except OSError as e:
        raise AdapterError(f"{name} cannot be read ({type(e).__name__}).") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise AdapterError(f"{name} is not a regular file.")
    if _opened_path(fd) not in (real, None):  # a directory on the way was swapped for a link since
        os.close(fd)
        raise AdapterError(f"{name} changed while it was being opened; refused.")
    return fd, real


def _opened_path(fd: int) -> str | None:
    """The path the kernel opened for `fd` (Linux); None where that cannot be known."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None


def read_at(fd: int, offset: int, num_bytes: int, name: str) -> bytes:
    """Exactly `num_bytes` from `offset`, or an AdapterError saying the file is truncated."""
    chunks = []
    while num_bytes > 0:
        chunk = os.pread(fd, min(num_bytes, 1 << 24), offset)
        if not chunk:
            raise AdapterError(f"{name} is truncated.")
        chunks.append(chunk)
        offset += len(chunk)
        num_bytes -= len(chunk)
    return b"".join(chunks)


def file_size(fd: int) -> int:
    return os.fstat(fd).st_size
