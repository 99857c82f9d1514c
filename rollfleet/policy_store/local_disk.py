"""Whether an OSError met while materializing is the replica's own disk refusing a write.

A pure decision (an errno and a path in, a verdict out): the worker turns such an error into a
typed, retryable ``LocalDiskError`` whose code its registry entry names, rather than an OSError
whose words differ by platform. A full disk (ENOSPC, EDQUOT), a file over the process's size
limit (EFBIG) and a read-only filesystem (EROFS: what ext4 remounts to after I/O errors) can only
come from writing, and rollfleet writes only to the local checkpoint; a refused permission
(EACCES, EPERM) is the local disk's only where the path says so (reading the store can be refused
too: that is the store's problem, not this disk's).
"""

from __future__ import annotations

import errno
import os

from rollfleet.schemas.errors import LocalDiskError

WRITE_ONLY = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS})
PERMISSION = frozenset({errno.EACCES, errno.EPERM})


def is_local_disk_failure(code: int | None, path: str | None, local_root: str) -> bool:
    """``code``: the OSError's errno; ``path``: its filename, resolved (None when the OS named
    none, as for a failed write()); ``local_root``: the local checkpoint's directory, resolved."""
    if code in WRITE_ONLY:
        return True
    if code in PERMISSION and path is not None:
        root = local_root.rstrip(os.sep)
        return path == root or path.startswith(root + os.sep)
    return False


def as_local_disk_error(exc: OSError, local_dir: str) -> LocalDiskError | None:
    """``exc`` as a LocalDiskError when it is the local disk's refusal (see above), else None."""
    path = os.path.realpath(exc.filename) if isinstance(exc.filename, str) else None
    if not is_local_disk_failure(exc.errno, path, os.path.realpath(local_dir)):
        return None
    name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
    where = f" ({path})" if path else ""
    message = f"the local disk refused a write{where}: {name} {exc.strerror or ''}".rstrip()
    return LocalDiskError(message, errno_name=name, path=path)
