"""What a file in the store may be: a regular file inside the store, nothing else.

A version directory is foreign input. A FIFO where a shard should be would block the first
read forever; a device could be read without end; a symlink could pull bytes from anywhere
on the replica's host into a checkpoint. So every file a version is read through is checked
first, with ``lstat``/``stat`` (which never open, so never block): a symlink must resolve
inside the store, and what it names (or the file itself) must be a regular file.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from rollfleet.schemas.errors import CorruptArtifact, HostileName

_KINDS = {
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
    stat.S_IFDIR: "a directory",
}


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _resolve(path: Path, root: Path) -> os.stat_result | None:
    """The stat of what ``path`` names, refusing a symlink that leaves ``root``; None if absent."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        real = os.path.realpath(path)
        if not _inside(real, os.path.realpath(root)):
            raise HostileName(f"{path.parent.name}/{path.name} is a symlink out of the store (to {real})")
        try:
            st = os.stat(real)
        except FileNotFoundError:
            raise CorruptArtifact(f"{path.parent.name}/{path.name} is a dangling symlink") from None
    return st


def check_file(path: Path, root: Path) -> bool:
    """Whether ``path`` exists; raises if it exists as anything but a regular file inside ``root``."""
    path = Path(path)
    st = _resolve(path, root)
    if st is None:
        return False
    if not stat.S_ISREG(st.st_mode):
        kind = _KINDS.get(stat.S_IFMT(st.st_mode), "not a regular file")
        raise CorruptArtifact(f"{path.parent.name}/{path.name} is {kind}, not a regular file")
    return True


def check_dir(path: Path, root: Path) -> bool:
    """Whether the version directory ``path`` exists; raises if it is a symlink out of ``root`` or not a directory."""
    st = _resolve(Path(path), root)
    if st is None:
        return False
    if not stat.S_ISDIR(st.st_mode):
        raise CorruptArtifact(f"{Path(path).name} is not a directory")
    return True


def read_file(path: Path, root: Path, limit: int) -> bytes | None:
    """A small store file's bytes (None if absent), checked first and read up to ``limit`` bytes."""
    if not check_file(path, root):
        return None
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise CorruptArtifact(f"{Path(path).name} is over its {limit} byte limit")
    return data
