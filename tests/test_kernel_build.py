"""Builds of our CPU kernels can be interrupted (``bloom_hpu/runtime/cpu/build.py``): a build killed
at a random point by SIGINT, SIGTERM or SIGKILL leaves the next run to finish; a stale lock of a
dead build never makes a run wait; a live build makes a run wait, saying so, for a bounded time; a
damaged library is rebuilt, never loaded; different sources or flags never share a folder.

Most tests build a tiny library through the same mechanism, with a compiler slowed by a wrapper so
that a build lasts some seconds; one test kills a real build of the kernels and checks the tokens
of the run after it against PyTorch's operations. Every run gets its own build root
(``$BLOOM_KERNELS_DIR``) and every subprocess a timeout.
"""

from __future__ import annotations

import fcntl
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bloom_hpu.runtime.cpu import capability, kernels
from bloom_hpu.runtime.cpu.build import ROOT_ENV, WAIT_ENV, Recipe

from isas import KERNEL_ISAS, ROOT

SIGNALS = {"SIGINT": signal.SIGINT, "SIGTERM": signal.SIGTERM, "SIGKILL": signal.SIGKILL}
TINY_SOURCE = 'extern "C" int bloom_tiny_answer() { return 42; }\n'
# Load the tiny library through the mechanism and call it: prints 42, or 'busy' when the wait ran out.
TINY_RUN = """
import ctypes, sys
from pathlib import Path
from bloom_hpu.runtime.cpu.build import BuildBusy, Recipe, load_library
recipe = Recipe("tiny", (Path(sys.argv[1]),), (("-O1",),))
try:
    path = load_library(recipe, "the tiny library", "a few seconds")
except BuildBusy:
    print("busy")
else:
    print(ctypes.CDLL(str(path)).bloom_tiny_answer())
"""
SLOW_CXX = "#!/bin/sh\nsleep 1\nexec {cxx} \"$@\"\n"  # each compiler call (version check, compile, link) 1 s longer


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    """(the tiny source, its Recipe, the environment of a run): a private build root, the slowed
    compiler; the test's own environment matches, so that ``recipe.folder()`` is the run's."""
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler")
    source = tmp_path / "tiny.cpp"
    source.write_text(TINY_SOURCE)
    cxx = tmp_path / "slow-c++"
    cxx.write_text(SLOW_CXX.format(cxx=shutil.which(os.environ.get("CXX", "c++"))))
    cxx.chmod(0o755)
    monkeypatch.setenv(ROOT_ENV, str(tmp_path / "root"))
    monkeypatch.setenv("CXX", str(cxx))
    monkeypatch.delenv(WAIT_ENV, raising=False)
    return source, Recipe("tiny", (source,), (("-O1",),)), dict(os.environ)


def start(args, env, stderr_path: Path) -> subprocess.Popen:
    """A run in its own session (so that its compiler, orphaned by a kill, can be cleaned up),
    its stderr to a file that the test can read while it runs."""
    with open(stderr_path, "w") as stderr:
        return subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True,
                                start_new_session=True)


def wait_for(path: Path, text: str, process: subprocess.Popen, timeout: float = 120) -> str:
    """Wait until ``text`` appears in the file ``path`` (a run's stderr); fail if the run ends first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        seen = path.read_text()
        if text in seen:
            return seen
        if process.poll() is not None:
            pytest.fail(f"the run ended (rc {process.returncode}) without saying {text!r}: {seen}")
        time.sleep(0.05)
    pytest.fail(f"{text!r} not said within {timeout} s: {path.read_text()}")


def end_session(process: subprocess.Popen) -> None:
    """Kill what is left of a run's session (a compiler its killed parent left running)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass


def run_tiny(source: Path, env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", TINY_RUN, str(source)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("name", list(SIGNALS))
@pytest.mark.slow
def test_a_build_killed_at_a_random_point_leaves_the_next_run_to_finish(tiny, tmp_path, name):
    source, recipe, env = tiny
    delay = random.uniform(0.0, 4.0)  # the slowed build lasts ~4-8 s from its 'building' line
    killed = start([sys.executable, "-c", TINY_RUN, str(source)], env, tmp_path / "killed.err")
    try:
        wait_for(tmp_path / "killed.err", "building the tiny library", killed)
        time.sleep(delay)
        killed.send_signal(SIGNALS[name])
        killed.wait(timeout=60)
    finally:
        end_session(killed)
    after = run_tiny(source, env)
    why = f"killed by {name} {delay:.2f} s into its build: {(tmp_path / 'killed.err').read_text()}"
    assert after.returncode == 0, f"{why}\nthe next run: {after.stderr}"
    assert after.stdout.split() == ["42"], why
    folder = recipe.folder()
    assert sorted(p.name for p in folder.iterdir()) == ["build.lock", f"{folder.name}.sha256", f"{folder.name}.so"], why
    again = run_tiny(source, env)  # built once: the run after loads it
    assert again.stdout.split() == ["42"] and "building" not in again.stderr


@pytest.mark.slow
def test_a_stale_torch_lock_of_a_dead_build_does_not_hang_a_run(tiny):
    """What a build killed by the old mechanism left: PyTorch's baton ``lock`` file, whose owner is
    gone, and a lock file naming a dead process. The next run clears them and builds."""
    source, recipe, env = tiny
    folder = recipe.folder()
    (folder / "build-dead").mkdir(parents=True)
    (folder / "build-dead" / "lock").touch()
    (folder / "build.lock").write_text("999999\n")
    run = run_tiny(source, env, timeout=120)
    assert run.returncode == 0 and run.stdout.split() == ["42"], run.stderr
    assert "waiting" not in run.stderr and not (folder / "build-dead").exists()


@pytest.mark.slow
def test_a_damaged_library_is_rebuilt_not_loaded(tiny):
    source, recipe, env = tiny
    assert run_tiny(source, env).stdout.split() == ["42"]
    library = recipe.folder() / f"{recipe.folder().name}.so"
    library.write_bytes(library.read_bytes()[:1000])  # cut short, as a copy or a full disk leaves it
    run = run_tiny(source, env)
    assert run.returncode == 0 and run.stdout.split() == ["42"], run.stderr
    assert "building the tiny library" in run.stderr


@pytest.mark.slow
def test_a_run_that_finds_a_live_build_waits_says_so_and_uses_it(tiny, tmp_path):
    source, recipe, env = tiny
    first = start([sys.executable, "-c", TINY_RUN, str(source)], env, tmp_path / "first.err")
    try:
        wait_for(tmp_path / "first.err", "building the tiny library", first)
        second = run_tiny(source, env)
        out, _ = first.communicate(timeout=120)
    finally:
        end_session(first)
    assert first.returncode == 0 and out.split() == ["42"], (tmp_path / "first.err").read_text()
    assert second.returncode == 0 and second.stdout.split() == ["42"], second.stderr
    assert f"waiting for process {first.pid}, which is building the tiny library" in second.stderr
    assert "building the tiny library (" not in second.stderr  # it used the first run's build


def test_a_wait_for_a_live_build_is_bounded(tiny):
    """A builder that never finishes (here: the test holds the build's lock) makes a run wait at
    most $BLOOM_KERNELS_WAIT seconds, then go on without the library, saying so in one line."""
    source, recipe, env = tiny
    recipe.folder().mkdir(parents=True)
    with open(recipe.folder() / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        lock.write(f"{os.getpid()}\n")
        lock.flush()
        started = time.monotonic()
        run = run_tiny(source, {**env, WAIT_ENV: "2"}, timeout=60)
        took = time.monotonic() - started
    assert run.returncode == 0 and run.stdout.split() == ["busy"], run.stderr
    assert f"waiting for process {os.getpid()}" in run.stderr
    assert f"gave up after 2 s waiting for process {os.getpid()}" in run.stderr
    assert took < 30


@pytest.mark.slow
def test_the_cli_goes_on_without_kernels_when_another_build_outlasts_the_wait(tiny_checkpoint, tmp_path,
                                                                              monkeypatch):
    """The kernels' own folder locked by a 'builder' that never ends: ./bloom.py says it waits, gives
    up, and generates with PyTorch's operations the tokens of --cpu_path plain; asked for those
    kernels by name, it stops with a clear error instead."""
    isa = capability.detect().kernel_isa
    if isa not in KERNEL_ISAS:
        pytest.skip("no kernel build runs on this CPU")
    monkeypatch.setenv(ROOT_ENV, str(tmp_path / "root"))
    env = {**os.environ, WAIT_ENV: "2"}
    folder = kernels.recipe(isa).folder()
    folder.mkdir(parents=True)
    cli = [sys.executable, str(ROOT / "bloom.py"), "--weights", str(tiny_checkpoint), "--max_length", "16", "--quiet",
           "Hello"]
    with open(folder / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        auto = subprocess.run(cli, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        named = subprocess.run(cli + ["--cpu_path", isa], cwd=ROOT, env=env, capture_output=True, text=True,
                               timeout=300)
    plain = subprocess.run(cli + ["--cpu_path", "plain"], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=300)
    assert auto.returncode == 0, auto.stderr
    assert "gave up after 2 s waiting for another process" in auto.stderr
    assert "CPU fast path: PyTorch operations" in auto.stderr and auto.stdout == plain.stdout
    assert named.returncode != 0 and "were still being built" in named.stderr, named.stderr
    assert "Traceback" not in named.stderr


def test_folders_are_named_by_what_determines_the_binary(tmp_path, monkeypatch):
    monkeypatch.setenv(ROOT_ENV, str(tmp_path))
    clone_a, clone_b = tmp_path / "a" / "tiny.cpp", tmp_path / "b" / "tiny.cpp"
    clone_a.parent.mkdir()
    clone_b.parent.mkdir()
    clone_a.write_text(TINY_SOURCE)
    clone_b.write_text(TINY_SOURCE)
    a, b = Recipe("tiny", (clone_a,), (("-O1",),)), Recipe("tiny", (clone_b,), (("-O1",),))
    assert a.folder() == b.folder()  # two clones of the same sources share one build
    clone_b.write_text(TINY_SOURCE.replace("42", "43"))  # a pull that changes a source
    assert a.folder() != b.folder()
    assert a.folder() != Recipe("tiny", (clone_a,), (("-O2",),)).folder()
    header = tmp_path / "tiny.h"
    header.write_text("#define A 1\n")
    with_header = Recipe("tiny", (clone_a,), (("-O1",),), headers=(header,))
    before = with_header.folder()
    header.write_text("#define A 2\n")
    assert with_header.folder() != before
    before = a.folder()
    monkeypatch.setattr(torch, "__version__", "0.0.0")  # another torch build
    assert a.folder() != before
    monkeypatch.undo()
    monkeypatch.setenv(ROOT_ENV, str(tmp_path))
    folders = {kernels.recipe(isa).folder() for isa in kernels.FLAGS}
    assert len(folders) == len(kernels.FLAGS) and all(f.parent == tmp_path for f in folders)
    assert all(f.name.startswith("bloom_cpu_") and f.name not in ("bloom_cpu_avx2", "bloom_cpu_avx512")
               for f in folders)  # never the one folder every version of the library shared


@pytest.mark.slow
def test_a_real_build_killed_then_run_again_gives_the_tokens_of_pytorch_ops(tiny_checkpoint, tmp_path):
    """One real build of the kernels in a private root, killed by a random signal at a random point
    while it compiles; the run after builds them again and generates PyTorch's operations' tokens."""
    if not KERNEL_ISAS:
        pytest.skip("no kernel build runs on this CPU")
    isa = KERNEL_ISAS[-1]
    env = {**os.environ, ROOT_ENV: str(tmp_path / "root")}
    env.pop(WAIT_ENV, None)
    cli = [sys.executable, str(ROOT / "bloom.py"), "--weights", str(tiny_checkpoint), "--max_length", "24", "--quiet",
           "--cpu_path", isa, "Hello, my name is"]
    name, delay = random.choice(list(SIGNALS)), random.uniform(0.0, 15.0)
    killed = start(cli, env, tmp_path / "killed.err")
    try:
        wait_for(tmp_path / "killed.err", "CPU kernels (about a minute", killed, timeout=300)
        time.sleep(delay)
        killed.send_signal(SIGNALS[name])
        killed.wait(timeout=60)
    finally:
        end_session(killed)
    run = subprocess.run(cli, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    plain = subprocess.run(cli[:-2] + ["plain", cli[-1]], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=300)
    why = f"killed by {name} {delay:.1f} s into its build"
    assert run.returncode == 0, f"{why}: {run.stderr}"
    assert "CPU kernels in" in run.stderr and "CPU fast path: AVX" in run.stderr, f"{why}: {run.stderr}"
    assert run.stdout == plain.stdout and run.stdout.strip(), why
    ahead = subprocess.run([sys.executable, str(ROOT / "utils" / "build_kernels.py"), "--isa", isa], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=300)
    assert ahead.returncode == 0 and "building" not in ahead.stderr, ahead.stderr  # built once, found by the tool
    assert ahead.stdout.startswith(f"{isa}: {tmp_path / 'root'}"), ahead.stdout
