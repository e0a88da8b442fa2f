"""The README's main job and the attention and decode examples run on the CPU (lower, print the IR, build
with nvcc when present, simulate and compare with torch) — as a fresh machine would run them."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("example, expect", [
    ("persistent_matmul.py", "simulated 200x296x152"),
    ("fmha.py", "simulated B1 H2 S200 D128 causal"),
    ("decode.py", "simulated lengths [2100, 37, 0], H8/2 S1 on 16 SMs"),
])
def test_example_runs_on_the_cpu(example, expect):
    run = subprocess.run([sys.executable, str(ROOT / "examples" / example), "--cpu"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert expect in run.stdout and "relative error" in run.stdout
    assert "role producer" in run.stdout   # the lowered IR is printed
