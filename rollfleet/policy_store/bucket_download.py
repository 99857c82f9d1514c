"""A bucket version's files fetched in resumable segments (``Bucket.download`` drives it).

Each file is cut into segments of ``segment_bytes``; a segment is one streamed, ranged GET,
written in place with ``pwrite``. A ``SegmentJournal`` beside each file records every
segment's progress after its write, so a download killed midway resumes where it stopped, to
within a step (``STEP_BYTES`` in ``bucket.py``), and one whose object changed starts that file
again. What a segment's GET is, and which errors it raises, is the caller's (``bucket.py``);
checking the finished files against their pins is too.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from rollfleet.schemas.errors import CorruptArtifact

_JOURNAL = ".progress"


class PinnedFile(Protocol):
    """What a download needs of a file's pin (``bucket.Pin``): the size and checksum it must have."""

    @property
    def size(self) -> int: ...

    @property
    def checksum(self) -> str: ...


# One segment still to fetch: (file, segment start, resume offset, segment end).
Segment = tuple[str, int, int, int]


@dataclass
class DownloadStats:
    """What one version's download read: bytes fetched now, bytes a previous attempt had kept."""

    fetched: int = 0
    resumed: int = 0
    files: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, fetched: int = 0, resumed: int = 0) -> None:
        with self._lock:
            self.fetched += fetched
            self.resumed += resumed


def open_segments(
    partial: Path, pins: Mapping[str, PinnedFile], segment_bytes: int, stats: DownloadStats
) -> tuple[list[Segment], dict[str, SegmentJournal]]:
    """Each pinned file's journal in ``partial``, opened (or started afresh), and the segments
    still to fetch; the bytes earlier attempts kept are counted in ``stats.resumed``."""
    segments: list[Segment] = []
    journals: dict[str, SegmentJournal] = {}
    for file, pin in sorted(pins.items()):
        size = pin.size
        journal = journals[file] = SegmentJournal(partial / file, size, pin.checksum)
        for start in range(0, size, segment_bytes):
            end = min(size, start + segment_bytes)
            upto = min(max(journal.done.get(start, start), start), end)
            stats.add(resumed=upto - start)
            if upto < end:
                segments.append((file, start, upto, end))
    return segments, journals


def fetch_segments(
    segments: list[Segment],
    journals: Mapping[str, SegmentJournal],
    fetch: Callable[[Segment], None],
    connections: int,
) -> None:
    """Every segment fetched on up to ``connections`` threads; then each file closed and its
    size checked (its journal closed even when a fetch failed, so the next attempt resumes)."""
    try:
        if segments:
            with ThreadPoolExecutor(min(connections, len(segments)), thread_name_prefix="rf-download") as pool:
                for _ in pool.map(fetch, segments):
                    pass
    finally:
        for journal in journals.values():
            journal.close()
    for journal in journals.values():
        journal.finish()


def rename_into_place(partial: Path, final: Path) -> None:
    """The finished, verified copy becomes the version directory in one rename; where a concurrent
    download of the same version got there first, its copy stands and this one is dropped."""
    try:
        os.rename(partial, final)
    except OSError:
        if not final.is_dir():
            raise
        shutil.rmtree(partial, ignore_errors=True)  # a concurrent download finished first


class SegmentJournal:
    """One file being downloaded: bytes written in place, each segment's progress recorded after its write.

    The journal holds ``<segment start> <written up to>`` lines; the last line of a segment wins.
    A process killed mid-step leaves that step unrecorded, so it is fetched again. The file's
    expected size and pinned checksum head the journal: another object's (a version published
    again under its number) restarts the file instead of mixing their bytes."""

    def __init__(self, path: Path, size: int, pin: str) -> None:
        self.path = path
        self.size = size
        self.done: dict[int, int] = {}
        self._jpath = path.with_name(path.name + _JOURNAL)
        fresh = True
        with contextlib.suppress(OSError, ValueError):
            lines = self._jpath.read_text().splitlines()
            if lines and lines[0] == f"{size} {pin}" and path.stat().st_size == size:
                fresh = False
                for line in lines[1:]:
                    start, _, upto = line.partition(" ")
                    if upto:  # a torn last line is ignored
                        self.done[int(start)] = max(self.done.get(int(start), 0), int(upto))
        if fresh:
            with open(path, "wb") as f:
                f.truncate(size)
            self._jpath.write_text(f"{size} {pin}\n")
        self._fd = os.open(path, os.O_RDWR)
        self._jfd = os.open(self._jpath, os.O_WRONLY | os.O_APPEND)
        self._lock = threading.Lock()

    def write(self, segment: int, offset: int, data: memoryview) -> None:
        written = 0
        while written < len(data):
            written += os.pwrite(self._fd, data[written:], offset + written)
        with self._lock:
            os.write(self._jfd, f"{segment} {offset + len(data)}\n".encode())

    def close(self) -> None:
        for fd in (self._fd, self._jfd):
            with contextlib.suppress(OSError):
                os.close(fd)

    def finish(self) -> None:
        if os.stat(self.path).st_size != self.size:
            raise CorruptArtifact(f"{self.path.name}: downloaded size differs from the listed {self.size}")
        self._jpath.unlink(missing_ok=True)
