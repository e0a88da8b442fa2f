"""Attention variants written in the DSL next to FlexAttention (and SDPA cuDNN where it runs the
variant), timed side by side in one run: causal, sliding window, softcap + causal, ALiBi + causal,
document mask. TFLOP/s are counted on the visible scores (4 D flops per visible query-key pair).

    python benchmarks/attention_variants.py [--iters 20] [--cases causal,window]
    python benchmarks/attention_variants.py --prebuild     # build this and the GPU tests' kernels

The softcap's tanh is one PTX `tanh.approx.f32` per score in the emitted CUDA (docs/ir.md,
"tile.tanh on the GPU"); the error column compares with FlexAttention's accurate tanh.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import wsched as ws  # noqa: E402
from attention_fusions import flex_mods as variant_flex_mods  # noqa: E402
from attention_fusions import make_attention, make_variant, union_mask, variant_inputs  # noqa: E402
from wsched.timing import median_ms, rel_error  # noqa: E402

WINDOW, SOFTCAP = 1024, 30.0
PREFIX, SINK_TOKENS = 1024, 4   # prefix LM: a bidirectional prefix; streaming: the window and sink tokens
# (label, our variant, B, H, S, D)
CASES = [("causal", "causal", 4, 16, 4096, 128), ("window", "window", 4, 16, 4096, 128),
         ("softcap", "softcap", 4, 16, 4096, 128), ("alibi", "alibi", 4, 16, 4096, 128),
         ("document", "document", 4, 16, 4096, 128), ("sinks", "sinks", 4, 16, 4096, 128),
         ("causal_d64", "causal", 4, 16, 4096, 64), ("window_d64", "window", 4, 16, 4096, 64),
         ("softcap_d64", "softcap", 4, 16, 4096, 64), ("alibi_d64", "alibi", 4, 16, 4096, 64),
         ("document_d64", "document", 4, 16, 4096, 64), ("causal_16k", "causal", 1, 16, 16384, 128),
         ("window_16k", "window", 1, 16, 16384, 128), ("prefix_lm", "prefix_lm", 4, 16, 4096, 128),
         ("streaming", "streaming", 4, 16, 4096, 128), ("prefix_lm_d64", "prefix_lm", 4, 16, 4096, 64),
         ("streaming_d64", "streaming", 4, 16, 4096, 64)]


def flex_mods(variant, extra):
    """(score_mod, mask_mod) of FlexAttention for one of our variants, on the same inputs: the
    make_variant ones from attention_fusions.flex_mods, the union masks here."""
    if variant == "prefix_lm":
        return None, lambda b, h, q, kv: (q >= kv) | (kv < PREFIX)
    if variant == "streaming":
        return None, lambda b, h, q, kv: ((q >= kv) & (q - kv < WINDOW)) | (kv < SINK_TOKENS)
    return variant_flex_mods(variant, extra, window=WINDOW, softcap=SOFTCAP)


def visible_pairs(variant, extra, B, S) -> float:
    """Query-key pairs the mask keeps, summed over the batch (per head)."""
    i = torch.arange(S, device="cuda")
    if variant in ("causal", "softcap", "alibi", "sinks"):
        return B * S * (S + 1) / 2
    if variant == "window":
        return B * float(torch.clamp(i + 1, max=WINDOW).sum())
    if variant in ("prefix_lm", "streaming"):
        _, mask_mod = flex_mods(variant, extra)
        return B * float(mask_mod(0, 0, i[:, None], i[None, :]).sum())
    doc = extra[0].reshape(B, S)
    return float(sum((torch.bincount(doc[b]).double() ** 2).sum() for b in range(B)))


def our_call(k, inputs):
    """A launch of our kernel on fixed inputs (pre-bound arguments where the kernel has them)."""
    if hasattr(k, "bind"):
        bound = k.bind(*inputs)
        return bound, bound
    return (lambda: k(*inputs)), (lambda: k(*inputs))


def documents_as_varlen(label, doc, q, k, v, ref, flops, t_flex, iters) -> list:
    """The document mask's attention written as packed sequences (`ws.varlen`: each document of
    each batch row one sequence), timed on the same values; its output checked against Flex's
    document mask. The row is ours as varlen next to Flex's document mask."""
    from attention_fusions import make_varlen_attention

    B, H, S, D = q.shape
    lengths = torch.cat([torch.bincount(doc.reshape(B, S)[b]) for b in range(B)])
    cu = torch.cat([torch.zeros(1, dtype=torch.int64, device=doc.device), lengths[lengths > 0].cumsum(0)]).int()
    packed = [x.transpose(1, 2).reshape(B * S, H, D).contiguous() for x in (q, k, v)]   # not timed
    kernel = ws.compile(make_varlen_attention(D, lse=False))
    run, outputs = our_call(kernel, (*packed, cu, cu))
    o = outputs().reshape(B, S, H, D).transpose(1, 2)
    t_ours = median_ms(run, iters=iters)
    err = rel_error(o, ref) if ref is not None else float("nan")
    print(f"{label} as ws.varlen ({len(cu) - 1} sequences)  wsched {flops / t_ours / 1e9:6.1f} TFLOP/s  "
          f"rel.err vs flex's document mask {err:.1e}", flush=True)
    return [f"{label} as ws.varlen", flops / t_ours / 1e9, flops / t_flex / 1e9, float("nan"), err, (D, S)]


def benchmark_fusion(variant, D):
    if variant in ("prefix_lm", "streaming"):
        return union_mask(D, variant, prefix=PREFIX, window=WINDOW, sinks=SINK_TOKENS, lse=False)
    return make_variant(D, variant, lse=False, window=WINDOW, softcap=SOFTCAP) if variant != "causal" \
        else make_attention(D, causal=True)


def prebuild() -> None:
    """Build, in parallel into the build cache, the kernels of this benchmark, of
    benchmarks/attention.py and of tests/test_gpu_attention.py."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    from attention import CASES as PLAIN_CASES
    from attention_fusions import VARIANTS

    fusions = [make_variant(d, v) for d in (64, 128) for v in VARIANTS]
    fusions += [make_variant(d, v) for d in (96, 192) for v in ("softcap", "softcap_window")]
    fusions += [make_variant(128, v, gqa=True) for v in ("window", "alibi", "document", "softcap_window",
                                                         "document_causal")]
    fusions += [make_variant(128, "window", window=1024)] + [benchmark_fusion(c[1], c[5]) for c in CASES]
    # the plain kernels: the GPU tests' and benchmarks/attention.py's
    fusions += [make_attention(d, causal=c, lse=True) for d in (64, 96, 128, 192, 256) for c in (False, True)]
    fusions += [make_attention(d, causal="bottom_right", lse=True, gqa=True) for d in (96, 192)]
    fusions += [make_attention(128), make_attention(128, causal=True, gqa=True),
                make_attention(64, causal=True, dtype=ws.f16), make_attention(128, causal="bottom_right", lse=True)]
    fusions += [make_attention(D, causal=causal, gqa=HK != H) for B, H, HK, S, D, causal in PLAIN_CASES]
    fusions = list({f.name: f for f in fusions}.values())

    def build(f):
        t0 = time.time()
        try:
            r = ws.compile(f, build=True).resources
            return f"{f.name}: {time.time() - t0:.1f}s regs {r.registers} spills {r.spill_stores}/{r.spill_loads}"
        except Exception as e:   # report every failure, keep building the others
            return f"{f.name}: FAILED {type(e).__name__}: {e}"
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 4) as pool:
        for line in pool.map(build, fusions):
            print(line, flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--cases", default=",".join(c[0] for c in CASES))
    ap.add_argument("--prebuild", action="store_true")
    args = ap.parse_args(argv)
    if args.prebuild:
        return prebuild()
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  bf16, median of {args.iters}; "
          f"TFLOP/s on visible scores; window {WINDOW}, softcap {SOFTCAP:g}")
    rows, ours_causal = [], {}    # our causal TFLOP/s by (head dim, length)
    for label, variant, B, H, S, D in CASES:
        if label not in args.cases.split(","):
            continue
        f = benchmark_fusion(variant, D)
        k = ws.compile(f)
        inputs = variant_inputs(f, B, H, S, S, D, device="cuda", seed=1)
        q, kk, v, *extra = inputs
        run, outputs = our_call(k, inputs)
        out = outputs()
        o = out[0] if isinstance(out, tuple) else out
        flops = 4 * D * H * visible_pairs(variant, extra, B, S)
        t_ours = median_ms(run, iters=args.iters)
        ref, t_flex = None, float("nan")
        if variant != "sinks":    # FlexAttention has no sink logit
            # A fresh compile per case: one compiled function across shapes and mods hits the
            # recompile limit and falls back to an unfused path (a few TFLOP/s), not Flex's kernel.
            torch._dynamo.reset()
            flex = torch.compile(flex_attention, dynamic=False)
            score_mod, mask_mod = flex_mods(variant, extra)
            block_mask = create_block_mask(mask_mod, B if variant == "document" else None, None, S, S, device="cuda")

            def flex_fn():
                return flex(q, kk, v, score_mod=score_mod, block_mask=block_mask)
            ref = flex_fn()
            t_flex = median_ms(flex_fn, iters=args.iters)
        t_cudnn = float("nan")
        if variant == "causal":
            def cudnn():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return F.scaled_dot_product_attention(q, kk, v, is_causal=True)
            t_cudnn = median_ms(cudnn, iters=args.iters)
        err = rel_error(o, ref) if ref is not None else float("nan")
        row = [label, flops / t_ours / 1e9, flops / t_flex / 1e9, flops / t_cudnn / 1e9, err, (D, S)]
        if variant == "causal":
            ours_causal[D, S] = row[1]
        rows.append(row)
        if variant == "document":   # the same attention over the documents as packed sequences
            rows.append(documents_as_varlen(label, extra[0], q, kk, v, ref, flops, t_flex, args.iters))
        print(f"{label:>10} B{B} H{H} S{S} D{D}  wsched {row[1]:6.1f}  flex {row[2]:6.1f}  cuDNN {row[3]:6.1f} "
              f"TFLOP/s  vs flex {row[1] / row[2]:.2f}  vs our causal {row[1] / ours_causal.get((D, S), row[1]):.2f}  "
              f"rel.err vs flex {err:.1e}", flush=True)
    print("\n| variant | wsched TFLOP/s | FlexAttention | SDPA cuDNN | vs flex | vs our causal |\n|---|---|---|---|---|---|")
    for r in rows:
        cudnn = f"{r[3]:.0f}" if r[3] == r[3] else "n/a"
        flex_text, versus = (f"{r[2]:.0f}", f"{r[1] / r[2]:.2f}") if r[2] == r[2] else ("n/a", "")
        causal = f"{r[1] / ours_causal[r[5]]:.2f}" if r[5] in ours_causal else ""
        print(f"| {r[0]} | {r[1]:.0f} | {flex_text} | {cudnn} | {versus} | {causal} |")


if __name__ == "__main__":
    main()
