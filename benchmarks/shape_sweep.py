"""Ours next to the best reference at shapes drawn at random, in one run: where does a shape that no
benchmark table lists fall below the references?

    python benchmarks/shape_sweep.py [--seed 0] [--families matmul,prefill,decode] [--n 24] [--iters 20]

Families, each a draw of `--n` shapes (seeded: a run repeats its shapes):

    matmul   bf16 A [M, K] @ B, B as [K, N] (`kn`) or [N, K] (`nk`, nn.Linear's weight), M from 1 to
             8192 (log-uniform, often odd), N and K multiples of 8 from 256 to 16384 (TMA needs
             16-byte rows), not always multiples of a tile; reference torch.matmul (cuBLAS)
    prefill  attention with S = T from 100 to 8192 (often no multiple of a tile), B 1-8, 8-32 heads,
             MHA or GQA (4 query heads a KV head), head dim 64 or 128, causal or not; references SDPA
             cuDNN and flash, the faster one counts
    decode   S = 1-4 queries against T = 200-32768 keys (ragged), B 1-128, H32 over 1, 4, 8 or 32 KV
             heads, D128; references SDPA cuDNN, flash and memory-efficient, the fastest counts
    variants a score function or mask written in the DSL (tests/attention_fusions.make_variant:
             causal, sliding window, softcap, ALiBi, document, document + causal, softcap + window),
             window 48-2048 and softcap 20 or 50 drawn too, S = T from 100 to 4096, B 1-4, 8 or 16 heads,
             MHA or GQA, head dim 64 or 128; reference FlexAttention (torch.compile, the same
             score_mod / mask_mod, a block mask), compiled per shape (slow to start)

Every call is timed cold (`decode.ColdTimer`: an L2 flush and a sleep kernel ahead of each call,
the median of `--iters`), ours pre-bound (`k.bind`: the kernel, not the Python call). Each row
prints our time, the best reference's, the ratio (reference time / ours: > 1 is faster) and our
error against that reference's output (outputs poisoned with NaN first; a row above 2e-2 is
WRONG and the script exits with 1). A summary per family closes the run: geometric mean, the
worst ratios, and how many rows fall below 0.9.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import wsched as ws  # noqa: E402
from attention_fusions import flex_mods, make_attention, make_variant, variant_inputs  # noqa: E402
from decode import ColdTimer  # noqa: E402
from matmul import linear, matmul  # noqa: E402
from wsched.timing import rel_error  # noqa: E402

TOLERANCE = 2e-2
SLOW = 0.9   # rows below this ratio are listed in the summary


def log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))


def draw_matmul(rng: random.Random) -> dict:
    return dict(layout=rng.choice(("kn", "nk")), M=log_uniform(rng, 1, 8192),
                N=8 * (log_uniform(rng, 256, 16384) // 8), K=8 * (log_uniform(rng, 256, 16384) // 8))


def draw_prefill(rng: random.Random) -> dict:
    H = rng.choice((8, 12, 16, 32))
    gqa = rng.random() < 0.4 and H % 4 == 0
    return dict(B=rng.choice((1, 2, 4, 8)), H=H, HK=H // 4 if gqa else H, S=log_uniform(rng, 100, 8192),
                D=rng.choice((64, 128)), causal=rng.random() < 0.5)


def draw_decode(rng: random.Random) -> dict:
    return dict(B=rng.choice((1, 2, 4, 16, 32, 128)), H=32, HK=rng.choice((1, 4, 8, 32)),
                T=log_uniform(rng, 200, 32768), S=rng.choice((1, 1, 2, 4)), D=128)


SWEPT_VARIANTS = ("causal", "window", "softcap", "alibi", "document", "document_causal", "softcap_window")


def draw_variants(rng: random.Random) -> dict:
    H = rng.choice((8, 16))
    return dict(variant=rng.choice(SWEPT_VARIANTS), B=rng.choice((1, 2, 4)), H=H, G=rng.choice((1, 1, 4)),
                S=log_uniform(rng, 100, 4096), D=rng.choice((64, 128)), window=rng.choice((48, 256, 1000, 2048)),
                softcap=rng.choice((20.0, 50.0)))


def fits(nbytes: int) -> bool:
    free, _ = torch.cuda.mem_get_info()
    return nbytes < 0.4 * free


class Sweep:
    def __init__(self, iters: int):
        self.timer = ColdTimer(iters)
        self.kernels: dict = {}
        self.rows: dict[str, list] = {}

    def kernel(self, key, make):
        if key not in self.kernels:
            self.kernels[key] = ws.compile(make())
        return self.kernels[key]

    def row(self, family: str, label: str, bound, out: torch.Tensor, refs: dict, flops: float | None) -> None:
        """Time the pre-bound call of ours and each reference (name -> fn returning the output in
        `out`'s shape), check ours against the first reference that runs."""
        for t in bound.outputs.values():
            t.fill_(float("nan"))
        bound()
        torch.cuda.synchronize()
        mine = out.float().clone()
        ours = self.timer(bound)
        times, err = {}, None
        for name, fn in refs.items():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                try:
                    ref = fn()
                except RuntimeError:   # a backend that does not take the case
                    torch.cuda.empty_cache()
                    continue
                if err is None:
                    err = rel_error(mine, ref.reshape(mine.shape))
                times[name] = self.timer(fn)
        best = min(times, key=times.get) if times else None
        ratio = times[best] / ours if best else float("nan")
        ok = err is not None and err < TOLERANCE
        rate = f"  {flops / ours / 1e6:6.0f} TFLOP/s" if flops else ""
        print(f"{family:>8} {label:<40} ours {ours:9.1f} us  {best or '-':>9} {times.get(best, float('nan')):9.1f} us"
              f"  ratio {ratio:5.2f}{rate}  err {err if err is not None else float('nan'):.1e}"
              f"{'' if ok else '  WRONG'}", flush=True)
        self.rows.setdefault(family, []).append((label, ratio, ok))

    def summary(self) -> bool:
        print()
        good = True
        for family, rows in self.rows.items():
            ratios = [r for _, r, _ in rows if r == r]
            geo = math.exp(sum(math.log(r) for r in ratios) / len(ratios)) if ratios else float("nan")
            slow = sorted((r, label) for label, r, _ in rows if r == r and r < SLOW)
            worst = sorted((r, label) for label, r, _ in rows if r == r)[:3]
            wrong = [label for label, _, ok in rows if not ok]
            good &= not wrong
            print(f"{family}: {len(rows)} shapes, geomean {geo:.2f}, min {min(ratios, default=float('nan')):.2f}, "
                  f"below {SLOW}: {len(slow)}, wrong: {len(wrong)}")
            for r, label in worst:
                print(f"    {r:.2f}  {label}")
            for label in wrong:
                print(f"    WRONG {label}")
        return good

    def matmul(self, layout: str, M: int, N: int, K: int) -> None:
        if not fits(2 * (M * K + N * K + M * N)):
            return
        k = self.kernel(layout, lambda: matmul if layout == "kn" else linear)
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16) / K ** 0.25
        b = torch.randn((K, N) if layout == "kn" else (N, K), device="cuda", dtype=torch.bfloat16) / K ** 0.25
        out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        bt = b if layout == "kn" else b.t()
        self.row("matmul", f"{layout} M{M} N{N} K{K}", k.bind(a, b, out={"out": out}), out,
                 {"cuBLAS": lambda: torch.matmul(a, bt)}, 2 * M * N * K)

    def prefill(self, B: int, H: int, HK: int, S: int, D: int, causal: bool) -> None:
        gqa = HK != H
        k = self.kernel(("attn", D, causal, gqa), lambda: make_attention(D, causal=causal, gqa=gqa))
        q = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)
        kk = torch.randn(B, HK, S, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(B, HK, S, D, device="cuda", dtype=torch.bfloat16)
        ours_in = (q.view(B, HK, H // HK, S, D), kk.view(B, HK, 1, S, D), v.view(B, HK, 1, S, D)) if gqa else (q, kk, v)
        bound = k.bind(*ours_in)
        out = next(iter(bound.outputs.values()))
        refs = {name: self._sdpa(backend, q, kk, v, causal, gqa)
                for name, backend in (("cuDNN", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION))}
        flops = 4 * B * H * S * S * D * (0.5 if causal else 1.0)
        label = f"B{B} H{H}{'/' + str(HK) if gqa else ''} S{S} D{D}{' causal' if causal else ''}"
        self.row("prefill", label, bound, out, refs, flops)

    def decode(self, B: int, H: int, HK: int, T: int, S: int, D: int) -> None:
        if not fits(4 * B * HK * T * D):
            return
        k = self.kernel(("attn", D, False, True), lambda: make_attention(D, gqa=True))
        q = torch.randn(B, HK, H // HK, S, D, device="cuda", dtype=torch.bfloat16)
        kk = torch.randn(B, HK, 1, T, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(B, HK, 1, T, D, device="cuda", dtype=torch.bfloat16)
        bound = k.bind(q, kk, v)
        out = next(iter(bound.outputs.values()))
        qr, kr, vr = q.view(B, H, S, D), kk.view(B, HK, T, D), v.view(B, HK, T, D)
        refs = {name: self._sdpa(backend, qr, kr, vr, False, True)
                for name, backend in (("cuDNN", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                                      ("efficient", SDPBackend.EFFICIENT_ATTENTION))}
        self.row("decode", f"B{B} H{H}/{HK} T{T} S{S}", bound, out, refs, None)

    def variants(self, variant: str, B: int, H: int, G: int, S: int, D: int, window: int, softcap: float) -> None:
        from torch.nn.attention.flex_attention import create_block_mask, create_mask, flex_attention

        gqa = G > 1
        window = window if "window" in variant else 100      # the draws a variant does not read: one kernel
        softcap = softcap if "softcap" in variant else 30.0
        k = self.kernel(("variant", variant, D, gqa, window, softcap),
                        lambda: make_variant(D, variant, gqa=gqa, lse=False, window=window, softcap=softcap))
        inputs = variant_inputs(k.fusion if hasattr(k, "fusion") else k.primary.fusion, B, H, S, S, D, device="cuda",
                                seed=S, gqa_groups=G if gqa else None)
        q, kk, v, *extra = inputs
        bound = k.bind(*inputs)
        out = next(iter(bound.outputs.values()))
        qf, kf, vf = q.reshape(B, H, S, D), kk.reshape(B, H // G, S, D), v.reshape(B, H // G, S, D)
        score_mod, mask_mod = flex_mods(variant, extra, window, softcap)
        torch._dynamo.reset()   # a fresh compile per shape (attention_variants.py says why)
        flex = torch.compile(flex_attention, dynamic=False)
        block_mask = create_block_mask(mask_mod, B if variant.startswith("document") else None, None, S, S,
                                       device="cuda")

        def flex_fn():
            return flex(qf, kf, vf, score_mod=score_mod, block_mask=block_mask, enable_gqa=gqa)
        visible = float(create_mask(mask_mod, B if variant.startswith("document") else 1, 1, S, S, device="cuda").sum())
        flops = 4 * D * H * visible * (1 if variant.startswith("document") else B)   # on the visible scores
        extra_text = {"window": f" w{window}", "softcap": f" cap{softcap:g}", "softcap_window": f" cap{softcap:g} w{window}"}
        label = f"{variant}{extra_text.get(variant, '')} B{B} H{H}{'/' + str(H // G) if gqa else ''} S{S} D{D}"
        self.row("variants", label, bound, out, {"Flex": flex_fn}, flops)

    @staticmethod
    def _sdpa(backend, q, k, v, causal, gqa):
        def fn():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
        return fn


DRAW = {"matmul": draw_matmul, "prefill": draw_prefill, "decode": draw_decode, "variants": draw_variants}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--families", default="matmul,prefill,decode")
    ap.add_argument("--n", type=int, default=24, help="shapes per family")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args(argv)
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  seed {args.seed}, cold L2, "
          f"median of {args.iters}; ratio = best reference time / ours")
    sweep = Sweep(args.iters)
    for family in args.families.split(","):
        rng = random.Random(f"{args.seed}-{family}")
        for _ in range(args.n):
            getattr(sweep, family)(**DRAW[family](rng))
    return 0 if sweep.summary() else 1


if __name__ == "__main__":
    sys.exit(main())
