"""Keep torch's profiler chatter off the console while the exact CPU meter runs.

torch 2.13's profiler writes two ``USDT:... SyncActivityProfilerHandler.cpp] profiler_start``/
``profiler_stop`` lines for every session, a ``profiler_kineto.cpp ... Toggling CPU activity``
warning whenever op recording is switched (the meter's sessions record no ops, see
``compat.MemoryEventSession``), and its CPU allocator a ``CPUAllocator.cpp ... Memory block of
unknown size`` warning when a block allocated outside any session is freed inside one. All go
from C++ straight to file descriptor 2; no environment variable read after torch is imported
silences them, and the exact meter runs sessions on every metered step (the main job printed 154
such lines; in a distributed process each starts with its rank). So while the meter's sessions
run, descriptor 2 is a pipe: a thread forwards every byte to the real stderr as it comes, except
these lines. A partial line that cannot be the start
of one (a progress bar redrawn with a carriage return) is forwarded at once, and chatter written
after such a partial line is taken out of it, so nothing else is held back or reordered.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading

#: The lines dropped, as torch 2.13 prints them; in a process of a distributed group, torch puts
#: the rank before each (``[rank0]:``).
_WARNING = rb"\[W\d{4} [\d:.]+ "  # c10's warning header: [W1126 21:33:37.274944199 file.cpp:245]
_RANK = rb"(?:\[rank\d+\]:)?"
CHATTER = re.compile(
    _RANK
    + rb"(?:USDT:[\d-]+ [\d:]+ \d+:\d+ SyncActivityProfilerHandler\.cpp:\d+\] profiler_(?:start|stop)"
    + rb"|"
    + _WARNING
    + rb"CPUAllocator\.cpp:\d+\] Memory block of unknown size was allocated before the profiling"
    + rb"|"
    + _WARNING
    + rb"profiler_kineto\.cpp:\d+\] Toggling CPU activity with GPU activity on)"
)
_CHATTER_STARTS = (b"USDT:", b"[W")
_RANK_PREFIX = re.compile(rb"\[rank\d+\]:")
_RANK_PREFIX_BEGUN = re.compile(rb"\[(?:r(?:a(?:n(?:k\d*\]?)?)?)?)?")
_DRAIN_SECONDS = 2.0


def _may_be_chatter(head: bytes) -> bool:
    """Whether a line beginning with ``head`` could still turn out to be chatter."""
    rank = _RANK_PREFIX.match(head)
    if rank is not None:
        head = head[rank.end() :]
    elif _RANK_PREFIX_BEGUN.fullmatch(head):
        return True
    return any(start.startswith(head[: len(start)]) for start in _CHATTER_STARTS)


def _forward(pipe_fd: int, out_fd: int) -> None:
    """Copy the pipe to ``out_fd`` until it closes, without the chatter lines; then close ``out_fd``."""
    try:
        _copy(pipe_fd, out_fd)
    finally:
        os.close(out_fd)


def _copy(pipe_fd: int, out_fd: int) -> None:
    stripper = ChatterStripper()
    with os.fdopen(pipe_fd, "rb", buffering=0) as pipe:
        while chunk := pipe.read(1 << 16):
            _write_all(out_fd, stripper.feed(chunk))
    _write_all(out_fd, stripper.end())


class ChatterStripper:
    """The byte stream without chatter, given in chunks cut anywhere."""

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, chunk: bytes) -> bytes:
        """What can be passed on now: complete lines, and the tail up to where chatter could be
        starting (held until its line ends)."""
        *lines, tail = (self._pending + chunk).split(b"\n")
        held = next((i for i in range(len(tail)) if _may_be_chatter(tail[i:])), len(tail))
        self._pending = tail[held:]
        return b"".join(_without_chatter(line) for line in lines) + tail[:held]

    def end(self) -> bytes:
        """The rest, once the stream has ended."""
        rest, self._pending = self._pending, b""
        found = CHATTER.search(rest)
        return rest if found is None else rest[: found.start()]


def _without_chatter(line: bytes) -> bytes:
    """A complete line and its newline, or what came before the chatter on it: chatter is written
    as whole lines, but can follow a partial line of other output (a progress bar)."""
    found = CHATTER.search(line)
    return line + b"\n" if found is None else line[: found.start()]


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
        # the thread writes through a descriptor of its own, which it closes when the pipe ends
        self._thread = threading.Thread(
            target=_forward, args=(read_fd, os.dup(saved)), name="lightning_tbp-stderr-filter", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        if self._thread is None or self._saved is None:
            return
        _flush_python_stderr()
        os.dup2(self._saved, 2)  # the pipe's last writer is gone: the thread drains it and ends
        os.close(self._saved)
        # A process forked meanwhile holds the pipe too; the thread then forwards its stderr until
        # that process exits.
        self._thread.join(timeout=_DRAIN_SECONDS)
        self._thread = self._saved = None


def _flush_python_stderr() -> None:
    with contextlib.suppress(AttributeError, ValueError, OSError):  # replaced, closed or detached
        sys.stderr.flush()
