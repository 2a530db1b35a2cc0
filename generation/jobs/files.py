"""The user's files are sacred: output paths that cannot clobber inputs, writes that keep links and
device files what they are, and one writer per results file.

- ``check_distinct``: an output path may not be an input or another output, compared after
  resolving links (and by inode when the file exists, which also catches hard links).
- ``replace_file``: a regular file (or a link to one) is rewritten atomically, through a temporary
  file next to the real target, then renamed over it: the link stays a link. Anything else (a
  device, a FIFO) is written through, never renamed over. A full disk is reported by name.
- ``lock_results``: an exclusive ``flock`` on a results file, so two runs never append to it at
  once; the second one stops with a clear line.
- ``read_user_file``: an input file's bytes, or one line naming the file and what is wrong.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from pathlib import Path

from ..run.batch import InputError


def read_user_file(path: str | Path, what: str) -> bytes:
    """The bytes of the user's ``what`` file (e.g. "input", "requests"), or an InputError naming it."""
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        raise InputError(f"{what} file {path} does not exist") from None
    except IsADirectoryError:
        raise InputError(f"{what} file {path} is a folder") from None
    except OSError as error:
        raise InputError(f"cannot read {what} file {path}: {error.strerror or error}") from None


def _identity(path: str | Path) -> tuple:
    """What makes two paths the same file: (device, inode) when it exists, else the resolved path."""
    try:
        st = os.stat(path)
        return ("inode", st.st_dev, st.st_ino)
    except OSError:
        return ("path", os.path.realpath(path))


def check_distinct(inputs: dict[str, str | Path | None], outputs: dict[str, str | Path | None]) -> None:
    """Refuse an output that is the same file as an input or as another output.

    ``inputs`` / ``outputs`` map a flag's name (``--requests``) to its path (``None``: not given)."""
    seen: dict[tuple, str] = {}
    for name, path in inputs.items():
        if path is not None:
            seen.setdefault(_identity(path), name)
    for name, path in outputs.items():
        if path is None:
            continue
        same = seen.get(_identity(path))
        if same is not None:
            raise InputError(f"{name} {path} is the same file as {same}: it would be overwritten; "
                             "choose another path")
        seen[_identity(path)] = name


def is_regular_or_new(path: Path) -> bool:
    """True when ``path`` is missing or (after links) a regular file: safe to replace by rename."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except FileNotFoundError:
        return True


def disk_error(path: str | Path, error: OSError) -> InputError:
    if error.errno == errno.ENOSPC:
        return InputError(f"no space left on the device writing {path}: free some space and run again")
    return InputError(f"cannot write {path}: {error.strerror or error}")


def replace_file(path: str | Path, data: bytes) -> None:
    """Write ``data`` as the whole content of ``path`` without ever leaving it half written."""
    path = Path(path)
    try:
        if not is_regular_or_new(path):
            # A device or a FIFO: a rename would replace it with a regular file. Write through.
            with open(path, "wb") as f:
                f.write(data)
            return
        target = Path(os.path.realpath(path))  # a link keeps pointing at the file it names
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        finally:
            if tmp.exists():
                tmp.unlink()
    except OSError as error:
        raise disk_error(path, error) from None


def lock_results(path: str | Path):
    """Open ``path`` for appending under an exclusive lock; the caller closes it (which unlocks).

    A second run on the same results file would answer the same pending requests again: it stops
    here instead."""
    try:
        f = open(path, "ab")
    except OSError as error:
        raise InputError(f"cannot open results file {path}: {error.strerror or error}") from None
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise InputError(f"results file {path} is in use by another run; wait for it to end "
                         "(a rerun afterwards skips what it answered)") from None
    except OSError:
        pass  # a file system without locks (some network mounts): go on unlocked
    return f
