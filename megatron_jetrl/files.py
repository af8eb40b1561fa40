"""Small files other processes read while we write them: the run's config, ``latest``, the admin key file, the
training's end marker, a resumed ``metrics.jsonl``; and directories written beside their place and moved into it
whole (a checkpoint, the weights the disk transport pushes).

``write_atomic`` writes a temporary file of this writer's own in the same directory, flushes it to the disk and
renames it over the target: a reader (another node's process, a resume after a crash or a power loss) sees the old
file or the new one, never a part, and several writers of one path (every node's ``jetrl launch`` writes the run's
config) each rename a whole file. The mode is set before the rename, so a private file is never readable by others
under its final name, whatever the umask or the mode of the file it replaces.
"""
from __future__ import annotations

import os
import shutil
import tempfile


def write_atomic(path: str, data: str | bytes, mode: int = 0o644) -> None:
    """Replace ``path`` with ``data`` (text as UTF-8) in one rename, the file's mode ``mode``."""
    path = os.path.abspath(path)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=os.path.basename(path) + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())  # the bytes before the name: a crash after the rename leaves no empty file
        os.chmod(tmp, mode)  # mkstemp's 0600 otherwise
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def replace_dir(src: str, dst: str) -> None:
    """Move the complete directory ``src`` to ``dst``, replacing a directory there: the old one is renamed aside
    (``dst.old``) and deleted once the new one holds the name. The name is without a whole version for the time of
    two renames, not for as long as a large directory takes to delete (a reader starting then finds one version),
    and a crash in between leaves the old version whole beside it (cleared by the next replacement)."""
    dst = os.path.normpath(dst)
    old = None
    if os.path.exists(dst):
        old = dst + ".old"
        shutil.rmtree(old, ignore_errors=True)  # an interrupted replacement's
        os.replace(dst, old)
    os.replace(src, dst)
    if old is not None:
        shutil.rmtree(old)
