"""The event log is private to the user running the engine: its directory is 0700 and each
segment 0600, whatever the umask. The log can hold request content (`--event-log-content`)."""

from __future__ import annotations

import os
from typing import BinaryIO

DIR_MODE = 0o700
FILE_MODE = 0o600


def make_private_dir(directory: str) -> None:
    """Create `directory` and any missing parent as 0700; an existing one this user owns is made
    0700 too (an older build left it 0755). One another user owns is left as it is."""
    missing: list[str] = []
    path = os.path.abspath(directory)
    while not os.path.isdir(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    for path in reversed(missing):
        try:
            os.mkdir(path, DIR_MODE)
        except FileExistsError:
            pass  # made meanwhile by another engine sharing the directory
    info = os.stat(directory)
    if info.st_uid == os.getuid() and info.st_mode & 0o777 != DIR_MODE:
        os.chmod(directory, DIR_MODE)


def open_private(path: str, mode: str) -> BinaryIO:
    """`open(path, "xb")`, created 0600: a new file that no other user can read."""
    if mode != "xb":
        raise ValueError(f"open_private creates new files only (mode 'xb'), not {mode!r}")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), FILE_MODE)
    return os.fdopen(fd, "wb")
