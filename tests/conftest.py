"""Shared test fixtures: golden files, and skipping GPU / nvcc tests where they cannot run."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

GOLDEN_DIR = Path(__file__).parent / "golden"

# Every lowering in the tests runs the verifier after each pass (docs/architecture.md, "The
# pipeline"): a pass that leaves a kernel the next one cannot take is caught where it happens.
os.environ.setdefault("WSCHED_DEBUG", "1")


def pytest_addoption(parser):
    parser.addoption("--update-golden", action="store_true", default=False,
                     help="rewrite tests/golden/* from the current output instead of comparing")


def _has_gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs an NVIDIA Hopper GPU (sm_90a)")
    skip_nvcc = pytest.mark.skip(reason="needs nvcc on PATH")
    gpu = _has_gpu()
    nvcc = shutil.which("nvcc") is not None
    for item in items:
        if "gpu" in item.keywords and not gpu:
            item.add_marker(skip_gpu)
        if "nvcc" in item.keywords and not nvcc:
            item.add_marker(skip_nvcc)


class Golden:
    """Compares text against tests/golden/<name>; `--update-golden` rewrites the file."""

    def __init__(self, update: bool):
        self.update = update

    def path(self, name: str) -> Path:
        return GOLDEN_DIR / name

    def check(self, name: str, text: str) -> None:
        path = self.path(name)
        if self.update:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            return
        if not path.exists():
            pytest.fail(f"golden file {path} is missing; run pytest --update-golden to create it")
        expected = path.read_text()
        if text != expected:
            import difflib
            diff = "".join(difflib.unified_diff(expected.splitlines(True), text.splitlines(True),
                                                fromfile=f"golden/{name}", tofile="actual", n=2))
            pytest.fail(f"output differs from golden/{name} (pytest --update-golden rewrites it):\n{diff}")


@pytest.fixture
def golden(request) -> Golden:
    return Golden(request.config.getoption("--update-golden"))
