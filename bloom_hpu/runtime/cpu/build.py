"""A C++ library built on first use so that a killed build never hangs a later run (DESIGN.md,
principle 13), compiled with ``torch.utils.cpp_extension`` and loaded into the process.

* **Named by what determines the binary.** The folder's name holds a hash of the sources' and
  headers' contents, the flags, the compiler's name, the torch build and the Python ABI: two clones,
  or a ``git pull`` that changes a source, never share a folder, while identical copies share one
  build.
* **One builder at a time, and no stale lock.** The builder holds ``fcntl.flock`` on the folder's
  ``build.lock``, which the kernel releases when its process ends, however it ends. A run that
  finds a live builder says so and waits at most ``$BLOOM_KERNELS_WAIT`` seconds (``DEFAULT_WAIT``),
  then raises ``BuildBusy`` so that its caller goes on without the library.
* **Appears whole or not at all.** Each build runs in a fresh ``build-*`` folder (PyTorch's own
  ``lock`` baton and the objects of a killed build die with that folder, removed by the next
  builder); its library is renamed into place, then the digest of its bytes beside it, and a
  library is loaded only where that digest agrees (else it is built again).

Folders live under ``$BLOOM_KERNELS_DIR``, else ``$TORCH_EXTENSIONS_DIR``, else PyTorch's default
(``~/.cache/torch_extensions``).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import platform
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT_ENV = "BLOOM_KERNELS_DIR"
WAIT_ENV = "BLOOM_KERNELS_WAIT"
DEFAULT_WAIT = 600.0  # seconds: a build takes 15 s to a few minutes on a busy 2-core machine
POLL = 0.25  # seconds between two tries of a held lock


class BuildError(Exception):
    """The library cannot be had (the message says why, in a few words)."""


class BuildBusy(BuildError):
    """Another live process was still building the library when the wait ran out."""


@dataclass(frozen=True)
class Recipe:
    """How to build one library. ``flag_sets`` are tried in order, the first that builds wins
    (a fallback for older compilers); ``headers``: files the sources include, hashed with them."""

    name: str  # a C identifier: the folder's and the library's name begin with it
    sources: tuple[Path, ...]
    flag_sets: tuple[tuple[str, ...], ...]
    headers: tuple[Path, ...] = ()
    ldflags: tuple[str, ...] = ()

    def key(self) -> str:
        """The hash of everything that determines the binary."""
        h = hashlib.sha256()
        for part in (self.name, repr(self.flag_sets), repr(self.ldflags), os.environ.get("CXX", "c++"),
                     torch.__version__, str(torch.version.git_version), str(torch.compiled_with_cxx11_abi()),
                     sys.implementation.cache_tag, getattr(sys, "abiflags", ""), platform.machine()):
            h.update(part.encode() + b"\0")
        for path in (*self.sources, *sorted(self.headers)):
            h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
        return h.hexdigest()[:16]

    def folder(self) -> Path:
        return build_root() / f"{self.name}_{self.key()}"


def build_root() -> Path:
    root = os.environ.get(ROOT_ENV) or os.environ.get("TORCH_EXTENSIONS_DIR")
    if not root:
        from torch.utils.cpp_extension import get_default_build_root

        root = get_default_build_root()
    return Path(root)


def wait_limit() -> float:
    try:
        return float(os.environ.get(WAIT_ENV, DEFAULT_WAIT))
    except ValueError:
        return DEFAULT_WAIT


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def load_library(recipe: Recipe, what: str, estimate: str) -> Path:
    """The path of ``recipe``'s library, built if needed and loaded into this process
    (``torch.ops.load_library``). ``what`` names it in the messages ('the AVX2 CPU kernels'),
    ``estimate`` says how long a build takes ('about a minute'). Raises BuildError."""
    folder = recipe.folder()
    library = folder / f"{folder.name}.so"
    if _complete(library):
        torch.ops.load_library(str(library))
        return library
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise BuildError(f"cannot be built in {folder} ({error.strerror})") from None
    with _build_lock(folder / "build.lock", what):
        if not _complete(library):  # else built by the process we waited for
            _build(recipe, folder, library, what, estimate)  # loads it, as torch's build does
            return library
    torch.ops.load_library(str(library))
    return library


def _complete(library: Path) -> bool:
    """``library`` is the file its build finished: its digest, written after it, agrees. Loading
    a damaged library can kill the process (SIGBUS), so it is checked before, never tried."""
    try:
        return _digest(library) == library.with_suffix(".sha256").read_text().strip()
    except OSError:
        return False


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@contextmanager
def _build_lock(path: Path, what: str):
    """Hold an exclusive flock on ``path``; while another process holds it, wait (saying so) at
    most ``wait_limit()`` seconds, then raise BuildBusy."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        waited_since, limit = None, wait_limit()
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                pid = os.pread(fd, 16, 0).decode(errors="replace").strip()
                holder = f"process {pid}" if pid.isdigit() else "another process"
                now = time.monotonic()
                if waited_since is None:
                    waited_since = now
                    say(f"waiting for {holder}, which is building {what} in {path.parent} "
                        f"(at most {limit:.0f} s, ${WAIT_ENV})")
                elif now - waited_since >= limit:
                    say(f"gave up after {limit:.0f} s waiting for {holder} to build {what}: "
                        f"this run goes without them")
                    raise BuildBusy(f"were still being built by {holder} after {limit:.0f} s") from None
                time.sleep(POLL)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)  # whom a waiting run waits for
        yield
    finally:
        os.close(fd)  # releases the flock


def _build(recipe: Recipe, folder: Path, library: Path, what: str, estimate: str) -> None:
    """Build into a fresh folder and rename the library into place; we hold the folder's lock, so
    every earlier ``build-*`` folder is a dead builder's leftover (its PyTorch ``lock`` included)."""
    from torch.utils import cpp_extension

    for leftover in folder.glob("build-*"):
        shutil.rmtree(leftover, ignore_errors=True)
    say(f"building {what} ({estimate}, once; in {folder})")
    started = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix="build-", dir=folder))
    try:
        failure = None
        for flags in recipe.flag_sets:
            try:
                built = cpp_extension.load(
                    name=library.stem, sources=[str(p) for p in recipe.sources], extra_cflags=list(flags),
                    extra_ldflags=list(recipe.ldflags), build_directory=str(workdir), is_python_module=False,
                    verbose=False)
                break
            except Exception as error:  # a compiler error, old torch headers...: the caller goes without
                last_line = (str(error).strip().splitlines() or [""])[-1]
                failure = BuildError(f"could not be built ({type(error).__name__}: {last_line})")
        else:
            say(f"could not build {what}: going on without them")
            raise failure
        # The library, then its digest, each complete before its name appears: whatever kills us, a
        # library without the digest of its bytes beside it is never loaded (``_complete``).
        digest = workdir / "digest"
        digest.write_text(_digest(Path(built)) + "\n")
        for path in (Path(built), digest):
            with open(path, "rb") as done:
                os.fsync(done.fileno())
        os.replace(built, library)
        os.replace(digest, library.with_suffix(".sha256"))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    say(f"built {what} in {time.perf_counter() - started:.0f} s")
