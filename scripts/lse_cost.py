"""Attention with and without the LSE output: kernel time (pre-bound launch) and full-call time."""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import wsched as ws  # noqa: E402
from attention_fusions import make_attention  # noqa: E402
from wsched.timing import median_ms  # noqa: E402

B, H, S, D = 4, 16, 4096, 128
q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
flops = 4 * B * H * S * S * D / 2
for lse in (False, True):
    f = make_attention(D, causal=True, lse=lse)
    ck = ws.compile(f)
    bound = ck.bind(q, k, v)   # arguments bound once: the kernel alone
    t_kernel = median_ms(bound, iters=30)
    t_call = median_ms(lambda: ck(q, k, v), iters=30)
    print(f"lse={lse}: kernel {flops / t_kernel / 1e9:.0f} TFLOP/s, full call {flops / t_call / 1e9:.0f} TFLOP/s "
          f"({(t_call - t_kernel) * 1e3:.0f} us host)  {ck.resources}")
