"""Shared pytest fixtures."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from bloom_hpu.checkpoint import DEFAULT_MODEL, DEFAULT_WEIGHTS
from utils.random_checkpoint import make_random_checkpoint

# Tests send Ctrl-C (SIGINT) to the servers, launchers and shells they start and expect Python's
# default. A suite started with SIGINT ignored (a background job of a shell without job control)
# would hand the ignore on to every child; with a handler here, the children start with the default.
signal.signal(signal.SIGINT, signal.default_int_handler)

# The CPU runtime's routes by rule, not by timing (bloom_hpu/runtime/cpu/choice.py), in this process
# and those it starts: a loaded machine must not change which route a test's model takes. The tests
# of the measured choice (tests/test_cpu_choice.py) ask for it explicitly.
os.environ.setdefault("BLOOM_CPU_CHOICE", "static")


@pytest.fixture(autouse=True)
def integer_rows_by_default():
    """After each test, the rows our integer products take in place are the build's default again
    (a test's measured choice sets them for the process): which rows another test's products
    multiply in place must not depend on the tests before it, nor on this machine's timing."""
    yield
    from bloom_hpu.runtime.cpu import integer_rows, kernels

    for built in kernels.loaded():
        integer_rows.restore_default(built)


@pytest.fixture
def verify_any_batch(monkeypatch):
    """Speculation verifies batches of any size here: on the CPU a greedy batch past
    ``guesses.CPU_VERIFY_ROWS`` rows x positions would step aside, and the tests of the verify
    pass need it to run (the step-aside has its own tests)."""
    from generation.search import guesses

    monkeypatch.setattr(guesses, "CPU_VERIFY_ROWS", 1 << 20)


@pytest.fixture(scope="session")
def make_ckpt(tmp_path_factory):
    """`make_ckpt(**kwargs) -> Path`: a random BLOOM checkpoint from `make_random_checkpoint(**kwargs)`.

    Folders are cached for the session (the same kwargs give the same folder), so treat them as
    read-only; copy one (shutil.copytree) before changing it.
    """
    made = {}

    def make(**kwargs):
        key = tuple(sorted((k, repr(v)) for k, v in kwargs.items()))
        if key not in made:
            made[key] = make_random_checkpoint(tmp_path_factory.mktemp("ckpt"), **kwargs)
        return made[key]

    return make


@pytest.fixture(scope="session")
def seed7_checkpoint(make_ckpt):
    """The suite's usual random checkpoint (3 layers, 64 wide, 4 heads, seed 7), made once; read-only."""
    return make_ckpt(hidden_size=64, n_layer=3, n_head=4, seed=7)


@pytest.fixture(scope="session")
def seed7_reference(seed7_checkpoint):
    """transformers' BloomForCausalLM on ``seed7_checkpoint``: the numerics reference (eval mode)."""
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers.BloomForCausalLM.from_pretrained(seed7_checkpoint).eval()


@pytest.fixture(scope="session")
def serve():
    """``serve(generator, model, key, metrics=False, **engine_config)``: a context manager serving
    ``generator`` through the real app on a loopback port (``servers.engine_server``); it yields a
    ``Running`` (generator, engine, port, ``client()``: the official openai client)."""
    from servers import engine_server

    return engine_server


@pytest.fixture(scope="session")
def tiny_checkpoint():
    """The embedded default checkpoint, checkpoints/bloom-tiny (read-only)."""
    return DEFAULT_WEIGHTS / DEFAULT_MODEL


@pytest.fixture(scope="session")
def eos_checkpoint(tmp_path_factory):
    """A random checkpoint whose EOS (id 2) embedding row is doubled, so that EOS wins now and then
    (every few rows/beams) and searches really exercise stopping at EOS."""
    from safetensors.torch import load_file, save_file

    folder = make_random_checkpoint(tmp_path_factory.mktemp("eos"), hidden_size=64, n_layer=2, n_head=4, seed=11)
    weights = load_file(folder / "model.safetensors")
    weights["word_embeddings.weight"][2] *= 2.0
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="session")
def eos_reference(eos_checkpoint):
    """transformers' BloomForCausalLM on ``eos_checkpoint``: the reference of the search tests."""
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers.BloomForCausalLM.from_pretrained(eos_checkpoint).eval()


@pytest.fixture(scope="session")
def eos_generator(eos_checkpoint):
    """Our cpu Generator on ``eos_checkpoint``."""
    from generation.generator import Generator

    return Generator.from_pretrained(eos_checkpoint)


@pytest.fixture(scope="session")
def scoring_setup(make_ckpt):
    """(checkpoint, our cpu Generator, transformers BloomForCausalLM) on one random checkpoint, for
    the request-file, log-prob, stop, eval and streaming tests."""
    from transformers import BloomForCausalLM

    from generation.generator import Generator

    folder = make_ckpt(hidden_size=64, n_layer=2, n_head=4, seed=7)
    return folder, Generator.from_pretrained(folder, device="cpu"), BloomForCausalLM.from_pretrained(folder).eval()


HPU_ENV_PREFIXES = ("PT_HPU_", "PT_ENABLE_", "HCL_")
HPU_STAND_IN = Path(__file__).resolve().parent / "graph_stand_in" / "bridge"


def _forget_habana() -> None:
    for name in [n for n in sys.modules if n == "habana_frameworks" or n.startswith("habana_frameworks.")]:
        del sys.modules[name]


@pytest.fixture
def hpu_stand_in(monkeypatch):
    """Put the stand-in for Habana's bridge (tests/graph_stand_in/bridge, see its README) on the import path
    with a clean environment; returns a function that imports its root the way a real bridge would
    be imported, and the HPU environment keys are restored afterwards.

    Load weights before: torch notices a ``habana_frameworks`` module and changes how it moves
    tensors. The bridge is forgotten again at the end, so no other test sees it."""
    import importlib

    def clear_environment():
        for key in [k for k in os.environ if k.startswith(HPU_ENV_PREFIXES)]:
            del os.environ[key]

    for key in [k for k in os.environ if k.startswith(HPU_ENV_PREFIXES)]:
        monkeypatch.delenv(key)  # put back when the test ends
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    _forget_habana()
    monkeypatch.syspath_prepend(str(HPU_STAND_IN))

    def bridge():
        return importlib.import_module("habana_frameworks.torch")

    yield bridge
    tracker = getattr(sys.modules.get("habana_frameworks.torch"), "LAZY_TRACKER", None)
    if tracker is not None:
        tracker.close()
    _forget_habana()
    clear_environment()  # what the test set; monkeypatch then restores the rest


def _graph_runtimes() -> list[str]:
    """The stand-in's two personalities, and the real CUDA card ("gpu") where there is one."""
    import torch

    return ["hpu", "cuda"] + (["gpu"] if torch.cuda.is_available() else [])


@pytest.fixture(params=_graph_runtimes())
def graph_stand_in(request, hpu_stand_in, monkeypatch):
    """The graph stand-in (tests/graph_stand_in) installed with one personality, HPU (lazy mode)
    or CUDA: ``make_backend`` then builds that backend over graphs that record and replay; on a
    machine with a CUDA card, also "gpu": the real card, its captures counted. Returns the
    ``Runtime`` (captures, lazy graphs); ``.personality`` says which, ``.device`` what to ask for."""
    from graph_stand_in import install

    runtime = install(request.param, monkeypatch.setattr)
    yield runtime
    runtime.close()
