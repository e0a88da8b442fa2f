"""What the examples share: show a compiled kernel without a GPU."""

from __future__ import annotations

import shutil


def show_lowered(k) -> None:
    """Print the kernel's partition and loop IR, then build its CUDA with nvcc if nvcc is here."""
    print(k.partition)
    print(k.ir)
    if shutil.which("nvcc"):
        build = k.compile_cuda()
        print(f"nvcc: {build.cu_path}  {k.resources}  (cache {'hit' if build.cache_hit else 'miss'})")
    else:
        print("nvcc not found: skipping the sm_90a build")
