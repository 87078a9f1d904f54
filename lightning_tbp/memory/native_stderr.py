"""Keep torch's profiler chatter off the console while the exact CPU meter runs.

torch 2.13's profiler writes two ``USDT:... SyncActivityProfilerHandler.cpp] profiler_start``/
``profiler_stop`` lines for every session, and its CPU allocator a ``CPUAllocator.cpp ...
Memory block of unknown size`` warning when a block allocated outside any session is freed
inside one. Both go from C++ straight to file descriptor 2; no environment variable read after
torch is imported silences them, and the exact meter runs sessions on every metered step (the
main job printed 154 such lines). So while the meter's sessions run, descriptor 2 is a pipe: a
thread forwards every byte to the real stderr as it comes, except these lines. A partial line
that cannot be the start of one (a progress bar redrawn with a carriage return) is forwarded at
once, so nothing else is held back or reordered.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading

#: The lines dropped, as torch 2.13 prints them.
CHATTER = re.compile(
    rb"USDT:[^\n]*SyncActivityProfilerHandler\.cpp:\d+\] profiler_(?:start|stop)"
    rb"|\[W[^\]\n]*CPUAllocator\.cpp:\d+\] Memory block of unknown size was allocated before the profiling started"
)
_CHATTER_STARTS = (b"USDT:", b"[W")
_DRAIN_SECONDS = 2.0


def _may_be_chatter(head: bytes) -> bool:
    """Whether a line beginning with ``head`` could still turn out to be chatter."""
    return any(start.startswith(head[: len(start)]) for start in _CHATTER_STARTS)


def _forward(pipe_fd: int, out_fd: int) -> None:
    """Copy the pipe to ``out_fd`` until it closes, without the chatter lines; then close ``out_fd``."""
    try:
        _copy(pipe_fd, out_fd)
    finally:
        os.close(out_fd)


def _copy(pipe_fd: int, out_fd: int) -> None:
    pending = b""
    continuing = False  # the start of the current line was forwarded already
    with os.fdopen(pipe_fd, "rb", buffering=0) as pipe:
        while chunk := pipe.read(1 << 16):
            data, pending, out = pending + chunk, b"", []
            if continuing:
                head, newline, data = data.partition(b"\n")
                out.append(head + newline)
                continuing = not newline
            if not continuing:
                *lines, tail = data.split(b"\n")
                out.extend(line + b"\n" for line in lines if not CHATTER.match(line))
                if tail and not _may_be_chatter(tail):
                    out.append(tail)
                    continuing = True
                else:
                    pending = tail
            _write_all(out_fd, b"".join(out))
    if pending and not CHATTER.match(pending):
        _write_all(out_fd, pending)


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data) :]


class ProfilerChatterFilter:
    """Between :meth:`start` and :meth:`stop`, descriptor 2 goes through the filter."""

    def __init__(self) -> None:
        self._saved: int | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is not None:
            return
        _flush_python_stderr()
        try:
            saved = os.dup(2)
        except OSError:  # no stderr to protect
            return
        read_fd, write_fd = os.pipe()
        os.dup2(write_fd, 2)
        os.close(write_fd)
        self._saved = saved
        self._thread = threading.Thread(
            target=_forward, args=(read_fd, saved), name="lightning_tbp-stderr-filter", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        if self._thread is None or self._saved is None:
            return
        _flush_python_stderr()
        os.dup2(self._saved, 2)  # the pipe's last writer is gone: the thread drains it and ends
        # A process forked meanwhile holds the pipe too; the thread then forwards its stderr until
        # it exits (and closes its copy of the real stderr itself).
        self._thread.join(timeout=_DRAIN_SECONDS)
        self._thread = self._saved = None


def _flush_python_stderr() -> None:
    with contextlib.suppress(AttributeError, ValueError, OSError):  # replaced, closed or detached
        sys.stderr.flush()
