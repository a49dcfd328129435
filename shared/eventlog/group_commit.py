"""Group commit: the event log's fsyncs run on a thread of their own, so the scheduler's loop never
waits on the disk. The loop writes and flushes each input's records, asks for them to be made
durable (`request`), and goes on planning; the thread fsyncs everything flushed before each fsync
began, one fsync at a time, each covering every record asked for meanwhile. The loop holds what a
client could see (tokens, replies) until `durable_seq` covers its records, and learns of each
fsync's end through `wake_fd`, a pipe it polls beside its sockets.

A failed fsync is kept in `error` and ends the thread: nothing later becomes durable, so nothing
held is ever released. Rotation and close `pause` the thread (waiting out an fsync in flight) and
sync inline.

Test-only fault (`LEDGERSERVE_TEST_FAULT_LOG_LOSS_SEQ`, shared/env.py): at the first fsync that would
cover record K or later the process dies instead, leaving the segment's durable size beside it: a
test cuts the records not yet synced, as a power cut would.
"""

from __future__ import annotations

import os
import signal
import threading
import time

from ledgerserve.shared import env

DURABLE_BYTES_SUFFIX = ".durable-bytes"


class Syncer:
    def __init__(self, fd: int, seq: int, size: int) -> None:
        """`fd`: the segment being written; records up to `seq` (`size` bytes) are durable."""
        self._cond = threading.Condition()
        self._fd = fd
        self._wanted = (seq, size)
        self._durable = (seq, size)
        self._in_flight = False
        self._paused = False
        self._closed = False
        self.error: OSError | None = None
        self._done: list[tuple[int, int, int]] = []  # (seq, start_ns, end_ns) of fsyncs that ended
        self.wake_fd, self._wake_write = os.pipe()
        os.set_blocking(self.wake_fd, False)
        os.set_blocking(self._wake_write, False)
        self._fault_seq = env.fault_log_loss_seq()
        self._thread = threading.Thread(target=self._run, name="event-log-fsync", daemon=True)
        self._thread.start()

    @property
    def durable_seq(self) -> int:
        with self._cond:
            return self._durable[0]

    def request(self, seq: int, size: int) -> None:
        """Make the records up to `seq` (the segment's first `size` bytes, flushed) durable."""
        with self._cond:
            if seq > self._wanted[0]:
                self._wanted = (seq, size)
                self._cond.notify()

    def take_done(self) -> list[tuple[int, int, int]]:
        """The fsyncs that ended since the last call: (seq covered, start ns, end ns)."""
        try:
            while os.read(self.wake_fd, 4096):
                pass
        except BlockingIOError:
            pass  # drained
        with self._cond:
            done, self._done = self._done, []
        return done

    def pause(self) -> None:
        """Wait out an fsync in flight and start none until `resume`."""
        with self._cond:
            self._paused = True
            while self._in_flight:
                self._cond.wait()

    def resume(self, fd: int, seq: int, size: int) -> None:
        """Go on with segment `fd`, durable (synced inline) up to `seq` (`size` bytes)."""
        with self._cond:
            self._fd, self._durable, self._paused = fd, (seq, size), False
            self._wanted = max(self._wanted, self._durable)
            self._cond.notify()
        self._wake()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()
        for fd in (self.wake_fd, self._wake_write):
            os.close(fd)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and (self._paused or self._wanted <= self._durable or self.error):
                    self._cond.wait()
                if self._closed:
                    return
                target, fd, self._in_flight = self._wanted, self._fd, True
            start_ns = time.monotonic_ns()
            try:
                self._maybe_lose(target[0], fd)
                os.fsync(fd)
            except OSError as exc:
                self.error = exc
            with self._cond:
                self._in_flight = False
                if self.error is None:
                    self._durable = max(self._durable, target)
                    self._done.append((target[0], start_ns, time.monotonic_ns()))
                self._cond.notify_all()
            self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_write, b"\0")
        except BlockingIOError:
            pass  # the pipe is full: the loop has wake-ups enough waiting

    def _maybe_lose(self, seq: int, fd: int) -> None:
        """The test fault: the process dies before this fsync, and the segment's size that the last
        fsync made durable goes to `<segment>.durable-bytes`: the test cuts the segment there, as a
        power cut would (cutting it here would race the loop's writes)."""
        if self._fault_seq is None or seq < self._fault_seq:
            return
        with open(os.readlink(f"/proc/self/fd/{fd}") + DURABLE_BYTES_SUFFIX, "w", encoding="ascii") as f:
            f.write(str(self._durable[1]))
        os.kill(os.getpid(), signal.SIGKILL)
