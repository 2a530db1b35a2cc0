"""pyproject.toml against the tree: the package holds every subpackage and the C++ sources, and its
dependencies are requirements.txt's pins (no pip run: the install itself is CI's check)."""

from __future__ import annotations

from pathlib import Path

import pytest
from setuptools import find_packages

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def pyproject():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_packages_are_every_folder_of_bloom_hpu_and_generation(pyproject):
    include = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    found = set(find_packages(ROOT, include=include))
    folders = {".".join(p.parent.relative_to(ROOT).parts)
               for top in ("bloom_hpu", "generation") for p in (ROOT / top).rglob("__init__.py")}
    assert found == folders
    assert {"generation.search", "generation.jobs"} <= found


def test_the_cpu_kernel_sources_are_package_data(pyproject):
    packaged = {path for package, patterns in pyproject["tool"]["setuptools"]["package-data"].items()
                for pattern in patterns for path in (ROOT / package.replace(".", "/")).glob(pattern)}
    sources = {p for p in (ROOT / "bloom_hpu").rglob("*") if p.suffix in (".h", ".cpp")}
    assert sources and not sources - packaged, "C++ sources missing from [tool.setuptools.package-data]"


def test_dependencies_are_the_pins_of_requirements_txt(pyproject):
    lines = (ROOT / "requirements.txt").read_text().splitlines()
    pinned = {line.strip() for line in lines if line.strip() and not line.startswith("#")}
    project = pyproject["project"]
    assert set(project["dependencies"]) | set(project["optional-dependencies"]["test"]) == pinned


def test_the_gaudi_requirements_are_the_others_less_torch_and_deepspeed():
    """On a Gaudi, Habana's torch and DeepSpeed fork stay: requirements-hpu.txt must not name them."""
    def pins(name):
        lines = (ROOT / name).read_text().splitlines()
        return {line.strip() for line in lines if line.strip() and not line.startswith("#")}

    everything, gaudi = pins("requirements.txt"), pins("requirements-hpu.txt")
    assert gaudi == {p for p in everything if not p.startswith(("torch", "deepspeed"))}
