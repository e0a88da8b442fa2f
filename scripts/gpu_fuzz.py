"""GPU fuzzer: random schedules x shapes x fusions, each launch under a watchdog.

    python scripts/gpu_fuzz.py                       # 128 kernels, 2560 cases: build, run, summary
    python scripts/gpu_fuzz.py --kernels 8 --cases 40 --budget 120
    python scripts/gpu_fuzz.py --device cuda:1       # on another device than the current one
    python scripts/gpu_fuzz.py --repro '<case json>' # rerun one case printed by a failure

Kernels, one family after another (`--families`):

    matmul     the matmul family (tests/fusions.py), a schedule from `schedule_space(fusion)`
               (BM 64/128, split-K, ...)
    attention  plain attention (tests/attention_fusions.py: head dim 64/128/256, causal top-left
               / bottom-right, GQA, LSE), each kernel's schedule from `schedule_space` or (one
               time in two) drawn beyond it (`sampled_attention_schedule`: one or two consumer
               warpgroups, 32..192 keys a block, split-KV 1..32, GQA packing) or the per-call
               default of `ws.compile(fusion)`
    paged      attention over a paged K/V cache with per-sequence key lengths (pages of 16, 32,
               64, 256, shuffled; empty, one-key and ragged sequences), schedules drawn the same way
    variant    score functions and masks (causal, window, softcap, ALiBi, document, sinks; head
               dims 64/96/128/192), schedules drawn the same way
    varlen     packed sequences (ws.varlen / ws.packed: head dims 64/96/128/256, causal top-left /
               bottom-right, GQA, LSE): empty, one-token, block-boundary and ragged sequences,
               queries and keys of their own lengths, schedules drawn the same way
    mixed      packed chunks of new tokens (ws.varlen Q) against paged (16/32/64/256) or contiguous
               caches with key lengths: empty chunks, one-token chunks, caches without keys
    cluster    the matmul family with clusters of 2 or 4 CTAs along M or N and TMA multicast
               (`sampled_cluster_schedule`), on the matmul shapes

They are built first, in parallel (nvcc processes), into the build cache. Cases: shapes drawn
per kernel — odd sizes, K (keys T) long enough to reuse every stage and shorter than one tile,
fewer and more tiles than SMs, decode-like calls (a few queries, many keys).

Every case runs in a worker process: outputs poisoned with NaN, the kernel launched, the device
synchronized, the result compared in fp32 with `fusion.reference` on the same inputs. The
parent is the watchdog: a case that does not answer in `--case-timeout` seconds is a hang; it is
reported with its repro (fusion, schedule, shape, seed), the worker is killed (which tears its
CUDA context down) and a fresh one takes the next case; a kernel that hung is not run again.
A CUDA error also restarts the worker (a fault leaves its context unusable).

The summary (cases, hangs, wrong answers, errors) is printed and written as JSON to
`$OUT/gpu_fuzz.json` when OUT is set (or to --json). `--inject-hang` first runs a kernel that
spins forever, to show that the watchdog catches a real GPU hang and the run recovers.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import multiprocessing
import os
import random
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

NOMINAL_SMS = 132              # H100 / H200; shapes aim at both sides of it
MAX_SCORES = 64_000_000        # B*H*S*T bound: the fp32 reference materialises the scores
MATMUL_FUSIONS = ("matmul", "matmul_f16", "mlp", "linear_relu_residual", "scaled_silu_f32", "gated")
FAMILIES = ("matmul", "attention", "paged", "variant", "varlen", "mixed", "cluster")
# (rel L2, max |error| / max |ref|) a correct kernel stays under, by output element type: one
# bf16 rounding of the output (2^-8) and of P in attention, accumulation-order noise in fp32.
TOLERANCE = {"bfloat16": (1e-2, 6e-2), "float16": (1e-2, 6e-2), "float32": (1e-3, 1e-2)}

SPIN_SOURCE = """\
// wsched gpu_fuzz: a kernel that never ends, to test the watchdog
extern "C" __global__ void wsched_fuzz_spin(volatile int* flag) { while (*flag == 0) { } }
"""


# --------------------------------------------------------------------------------------------
# fusions and schedules, as JSON a repro line can carry


def fusion_of(spec: dict):
    if spec["family"] == "matmul":
        import fusions

        return getattr(fusions, spec["name"])
    from attention_fusions import make_attention, make_paged_attention, make_variant, make_varlen_attention

    if spec["family"] == "paged":
        return make_paged_attention(spec["head_dim"], spec["page_size"], causal=spec["causal"],
                                    lengths=spec["lengths"], lse=spec["lse"])
    if spec["family"] == "variant":
        return make_variant(spec["head_dim"], spec["variant"], gqa=spec["gqa"], lse=spec["lse"])
    if spec["family"] == "varlen":
        return make_varlen_attention(spec["head_dim"], causal=spec["causal"], lse=spec["lse"], gqa=spec["gqa"])
    if spec["family"] == "mixed":
        from attention_fusions import make_varlen_paged_attention

        return make_varlen_paged_attention(spec["head_dim"], spec["page_size"], causal=spec["causal"], lse=spec["lse"])
    return make_attention(spec["head_dim"], causal=spec["causal"], lse=spec["lse"], gqa=spec["gqa"])


def fusion_label(spec: dict) -> str:
    return spec["name"] if spec["family"] == "matmul" else fusion_of(spec).name


def schedule_json(schedule) -> dict | None:
    """The schedule as JSON; None for the per-call default of `ws.compile(fusion)`."""
    return None if schedule is None else {"workload": schedule.workload, "fields": dataclasses.asdict(schedule)}


def schedule_of(data: dict | None):
    from wsched.workloads import workload_named

    if data is None:
        return None
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in data["fields"].items()}
    return workload_named(data["workload"]).schedule_type(**fields)


def short_of(schedule) -> str:
    return "default (per-call choice)" if schedule is None else schedule.short()


def sampled_attention_schedule(fusion, rng: random.Random, tries: int = 40):
    """A schedule drawn beyond `schedule_space`, which holds the workload's tuned corners only:
    the default with drawn overrides (one or two consumer warpgroups, 32 to 192 keys a block,
    stages, the softmax overlapped or not, split-KV up to 32, GQA packing), kept only if the
    workload takes it for the fusion (a caller may pass any such schedule; one that spills is a
    build error, not a wrong answer); or None (one time in five): the per-call default of
    `ws.compile(fusion)`, which picks among the decode, split-KV and prefill kernels."""
    from wsched.workloads import workload_for

    workload = workload_for(fusion)
    if rng.random() < 0.2:
        return None
    head_dim = fusion.inputs[0].shape[-1]
    for _ in range(tries):
        consumers = rng.choice((1, 2))
        overrides = dict(tile=(64 * consumers, rng.choice((32, 64, 64, 128, 128, 192)), head_dim),
                         consumer_warpgroups=consumers, mma_inflight=rng.choice((0, 1)),
                         split_kv=rng.choice((1, 1, 2, 3, 8, 32)), pack_gqa=rng.random() < 0.5)
        if rng.random() < 0.3:
            overrides["stages"] = rng.randint(1, 4)
        schedule = workload.taken(fusion, **overrides)
        if schedule is not None:
            return schedule
    return workload.default_schedule(fusion)


def sampled_cluster_schedule(fusion, rng: random.Random, tries: int = 40):
    """A matmul schedule with a cluster (`MatmulSchedule.cluster`): 2 or 4 CTAs on tiles along M
    (sharing B) or N (sharing A), one or two consumer warpgroups, BN 64..256, stages, either
    epilogue and raster; kept only if the workload takes it for the fusion."""
    from wsched.workloads import workload_for

    workload = workload_for(fusion)
    for _ in range(tries):
        n, consumers = rng.choice((2, 2, 4)), rng.choice((1, 2))
        overrides = dict(cluster=(n, 1, 1) if rng.random() < 0.5 else (1, n, 1),
                         tile=(64 * consumers, rng.choice((64, 128, 192, 256)), 64), consumer_warpgroups=consumers,
                         epilogue=rng.choice(("tma_store", "direct")), raster=rng.choice(("row", "column")))
        if rng.random() < 0.3:
            overrides["stages"] = rng.randint(1, 4)
        schedule = workload.taken(fusion, **overrides)
        if schedule is not None:
            return schedule
    return workload.default_schedule(fusion, cluster=(2, 1, 1))


def attention_specs() -> list[dict]:
    return [{"family": "attention", "head_dim": d, "causal": causal, "lse": lse, "gqa": gqa}
            for d in (64, 128, 256) for causal in (False, True, "bottom_right")
            for lse in (False, True) for gqa in (False, True)]


def paged_specs() -> list[dict]:
    return [{"family": "paged", "head_dim": d, "page_size": page, "causal": causal, "lengths": lengths, "lse": lse}
            for d in (64, 128, 256) for page in (16, 32, 64, 256) for causal in (False, True)
            for lengths in (True, False) for lse in (True, False)]


def variant_specs() -> list[dict]:
    from attention_fusions import VARIANTS

    return [{"family": "variant", "head_dim": d, "variant": variant, "gqa": gqa, "lse": True}
            for d in (64, 96, 128, 192) for variant in VARIANTS for gqa in (False, True)]


def varlen_specs() -> list[dict]:
    return [{"family": "varlen", "head_dim": d, "causal": causal, "lse": lse, "gqa": gqa}
            for d in (64, 96, 128, 256) for causal in (False, True, "bottom_right")
            for lse in (False, True) for gqa in (False, True)]


def mixed_specs() -> list[dict]:
    return [{"family": "mixed", "head_dim": d, "page_size": page, "causal": causal, "lse": lse}
            for d in (64, 128, 256) for page in (16, 32, 64, 256, None) for causal in (False, True)
            for lse in (False, True)]


def plan_kernels(count: int, rng: random.Random, families: tuple[str, ...] = FAMILIES) -> list[dict]:
    """`count` distinct (fusion, schedule) pairs: the families in turn, each fusion and head dim
    in turn within its family; matmul schedules drawn from the workload's space, attention ones
    from the space or beyond it (`sampled_attention_schedule`), one time in two."""
    from wsched.workloads import workload_for

    def dealt(specs: list[dict]) -> list[dict]:   # shuffled, then dealt round-robin by head dim
        rng.shuffle(specs)
        dims = sorted({spec["head_dim"] for spec in specs})
        by_dim = [[spec for spec in specs if spec["head_dim"] == d] for d in dims]
        return [group[i % len(group)] for i in range(max(map(len, by_dim))) for group in by_dim]

    specs = {"matmul": [{"family": "matmul", "name": n} for n in MATMUL_FUSIONS],
             "cluster": [{"family": "matmul", "name": n} for n in MATMUL_FUSIONS],
             "attention": dealt(attention_specs()), "paged": dealt(paged_specs()), "variant": dealt(variant_specs()),
             "varlen": dealt(varlen_specs()), "mixed": dealt(mixed_specs())}
    spaces: dict[str, list] = {}
    kernels, seen = [], set()
    for slot in range(count * 4):
        if len(kernels) == count:
            break
        family = families[slot % len(families)]
        turn = slot // len(families)
        spec = specs[family][turn % len(specs[family])]
        label = fusion_label(spec)
        fusion = fusion_of(spec)
        if family == "cluster":
            schedule = sampled_cluster_schedule(fusion, rng)
        elif family == "matmul" or rng.random() < 0.5:   # the workload's space, or a drawn schedule
            if label not in spaces:
                spaces[label] = list(workload_for(fusion).schedule_space(fusion))
            schedule = rng.choice(spaces[label])
        else:
            schedule = sampled_attention_schedule(fusion, rng)
        if (label, schedule) in seen:
            continue
        seen.add((label, schedule))
        kernels.append({"kernel": len(kernels), "fusion": spec, "label": label,
                        "schedule": schedule_json(schedule), "short": short_of(schedule)})
    return kernels


# --------------------------------------------------------------------------------------------
# shapes


def _mult(value: int, m: int) -> int:
    return max(m, value // m * m)


def matmul_shape(kernel: dict, regime: str, rng: random.Random) -> dict:
    fields = kernel["schedule"]["fields"]
    bm, bn, bk = fields["tile"]
    stages = fields["stages"]
    # K and N are row lengths of TMA-read tensors (16-byte rows: multiples of 8); M is free.
    # linear_relu_residual with direct stores reads res / writes out element by element: odd N.
    odd_n = kernel["fusion"]["name"] == "linear_relu_residual" and fields["epilogue"] == "direct"
    n_of = (lambda lo, hi: rng.randint(lo, hi)) if odd_n else (lambda lo, hi: _mult(rng.randint(lo, hi), 8))
    long_k = _mult(rng.randint((2 * stages + 1) * bk, 4096), 8)       # every stage reused twice
    if regime == "few_tiles":
        return {"M": rng.randint(1, 3 * bm), "N": n_of(8, 3 * bn), "K": long_k}
    if regime == "many_tiles":
        return {"M": rng.randint(1200, 4000), "N": n_of(1200, 4000), "K": long_k}
    if regime == "short_k":
        return {"M": rng.randint(1, 2000), "N": n_of(8, 2000), "K": _mult(rng.randint(8, 2 * bk), 8)}
    # "skinny": one tile row or column across many
    if rng.random() < 0.5:
        return {"M": rng.randint(1, 64), "N": n_of(2000, 6000), "K": long_k}
    return {"M": rng.randint(2000, 8000), "N": n_of(8, 64), "K": long_k}


def _attention_tile(kernel: dict) -> tuple[int, int, int]:
    """(rows, keys, stages) of a kernel's tiles; the default's for the per-call choice."""
    schedule = schedule_of(kernel["schedule"])
    if schedule is None:
        import wsched as ws

        schedule = ws.schedule_for(fusion_of(kernel["fusion"]))
    return schedule.tile[0], schedule.tile[1], schedule.stages


def attention_shape(kernel: dict, regime: str, rng: random.Random) -> dict:
    bm, bn, stages = _attention_tile(kernel)
    gqa = kernel["fusion"].get("gqa")
    long_t = rng.randint((2 * stages + 1) * bn, 4096)
    if regime == "few_tiles":
        B, H, S, T = 1, rng.randint(1, 4), rng.randint(1, 3 * bm), long_t
    elif regime == "many_tiles":
        B, H, S, T = rng.randint(1, 3), rng.randint(4, 16), rng.randint(600, 2500), long_t
    elif regime == "short_k":
        B, H, S, T = rng.randint(1, 4), rng.randint(1, 8), rng.randint(1, 1500), rng.randint(1, 2 * bn)
    else:  # "skinny": decode-like (few queries, many keys) or more queries than keys
        if rng.random() < 0.5:
            B, H, S, T = rng.randint(1, 8), rng.randint(1, 16), rng.randint(1, 16), rng.randint(2000, 8000)
        else:
            B, H, S, T = rng.randint(1, 2), rng.randint(1, 8), rng.randint(1000, 3000), rng.randint(1, 700)
    G = None
    if gqa:
        G = rng.choice((2, 4, 8))
        H = max(1, H // G) * G
    while B * H * S * T > MAX_SCORES:
        if H > (G or 1):
            H -= G or 1
        elif T > 2 * bn:
            T //= 2
        else:
            S = max(1, S // 2)
    return {"B": B, "H": H, "S": S, "T": T, "G": G}


def paged_shape(kernel: dict, regime: str, rng: random.Random) -> dict:
    """B sequences of ragged lengths (some empty or of one key where the fusion takes lengths),
    HK KV heads of G query heads, S new queries each (decode: 1; chunked prefill: up to 200)."""
    _, bn, stages = _attention_tile(kernel)
    lengths = kernel["fusion"]["lengths"]
    if regime == "few_tiles":
        B, HK, S, top = rng.randint(1, 2), rng.randint(1, 2), rng.randint(1, 8), 8192
    elif regime == "many_tiles":
        B, HK, S, top = rng.randint(8, 40), rng.randint(2, 8), rng.randint(1, 4), 3000
    elif regime == "short_k":
        B, HK, S, top = rng.randint(1, 16), rng.randint(1, 4), rng.randint(1, 64), 2 * bn
    else:   # "skinny": a chunk of new tokens against a long cache
        B, HK, S, top = rng.randint(1, 4), rng.randint(1, 4), rng.randint(16, 200), 6000
    G = rng.choice((1, 2, 4, 8))
    lens = [rng.randint(1, top) for _ in range(B)]
    if lengths:   # the edge cases: an empty sequence, one key, a length at a page / block boundary
        for b in range(B):
            pick = rng.random()
            lens[b] = (0 if pick < 0.08 else 1 if pick < 0.16 else
                       rng.randint(1, max(1, top // bn)) * bn if pick < 0.3 else lens[b])
    else:         # every sequence holds all the table's keys: one length, long enough to reuse stages
        lens = [max(lens[0], (2 * stages + 1) * bn if regime != "short_k" else 1)] * B
    while B * HK * G * S * max(max(lens), 1) > MAX_SCORES:
        if B > 1:
            B, lens = B - 1, lens[:-1]
        else:
            S = max(1, S // 2)
    return {"B": B, "HK": HK, "G": G, "S": S, "lens": lens}


def varlen_shape(kernel: dict, regime: str, rng: random.Random) -> dict:
    """B packed sequences, each with its own query and key counts (some empty, of one token, or at
    a block boundary), H query heads (G a KV head with GQA)."""
    bm, bn, stages = _attention_tile(kernel)
    if regime == "few_tiles":
        B, H, q_top, k_top = rng.randint(1, 2), rng.randint(1, 4), 3 * bm, 4096
    elif regime == "many_tiles":
        B, H, q_top, k_top = rng.randint(8, 40), rng.randint(2, 8), 1500, 1500
    elif regime == "short_k":
        B, H, q_top, k_top = rng.randint(1, 16), rng.randint(1, 8), 600, 2 * bn
    else:   # "skinny": a few queries against many keys, or many queries against few keys
        B, H = rng.randint(1, 16), rng.randint(1, 8)
        q_top, k_top = (16, 6000) if rng.random() < 0.5 else (2000, 300)

    def length(top: int, block: int) -> int:
        pick = rng.random()
        return (0 if pick < 0.08 else 1 if pick < 0.16 else
                rng.randint(1, max(1, top // block)) * block if pick < 0.3 else rng.randint(1, top))

    q_lens = [length(q_top, bm) for _ in range(B)]
    k_lens = ([q if rng.random() < 0.5 else length(k_top, bn) for q in q_lens] if q_top > 16
              else [length(k_top, bn) for _ in range(B)])
    # a batch holds a query and a key (no rows at all is refused: "S_packed is 0")
    q_lens[0], k_lens[0] = (max(x[0], 1 if sum(x) == 0 else 0) for x in (q_lens, k_lens))
    G = rng.choice((2, 4, 8)) if kernel["fusion"]["gqa"] else None
    if G:
        H = max(1, H // G) * G
    while B * H * max(sum(q_lens), 1) * max(sum(k_lens), 1) > MAX_SCORES:   # the reference pads each
        if B > 1:
            B, q_lens, k_lens = B - 1, q_lens[:-1], k_lens[:-1]
        else:
            q_lens, k_lens = [max(1, q_lens[0] // 2)], [max(1, k_lens[0] // 2)]
    return {"H": H, "G": G, "q_lens": q_lens, "k_lens": k_lens}


def mixed_shape(kernel: dict, regime: str, rng: random.Random) -> dict:
    """B sequences, each a chunk of new tokens (some empty or of one token) at the end of its
    cache of keys (some without keys), HK KV heads of G query heads."""
    _, bn, _ = _attention_tile(kernel)
    B = {"few_tiles": rng.randint(1, 2), "many_tiles": rng.randint(8, 40)}.get(regime, rng.randint(1, 16))
    chunk_top, cache_top = {"few_tiles": (300, 6000), "many_tiles": (64, 3000), "short_k": (600, 2 * bn)}.get(
        regime, (16, 8000))
    HK, G = rng.randint(1, 4), rng.choice((1, 2, 4, 8))
    q_lens, k_lens = [], []
    for _ in range(B):
        pick = rng.random()
        q = 0 if pick < 0.08 else 1 if pick < 0.3 else rng.randint(1, chunk_top)
        k = 0 if rng.random() < 0.08 else q + rng.randint(0, cache_top)
        q_lens.append(q)
        k_lens.append(k)
    q_lens[0] = max(q_lens[0], 1 if sum(q_lens) == 0 else 0)
    while B * HK * G * max(sum(q_lens), 1) * max(max(k_lens), 1) > MAX_SCORES:   # the reference pads each
        if B > 1:
            B, q_lens, k_lens = B - 1, q_lens[:-1], k_lens[:-1]
        else:
            q_lens, k_lens = [max(1, q_lens[0] // 2)], [k_lens[0] // 2]
    return {"HK": HK, "G": G, "q_lens": q_lens, "k_lens": k_lens}


REGIMES = ("few_tiles", "many_tiles", "short_k", "skinny")


def plan_cases(kernels: list[dict], count: int, rng: random.Random, seed: int) -> list[dict]:
    """`count` cases spread evenly over `kernels`, interleaved (a cut budget still leaves every
    kernel covered), every kernel seeing each regime in turn."""
    per_kernel = max(1, math.ceil(count / max(1, len(kernels))))
    cases = []
    for round_ in range(per_kernel):
        for kernel in kernels:
            if len(cases) == count:
                break
            regime = REGIMES[(round_ + kernel["kernel"]) % len(REGIMES)]
            shape_of = {"matmul": matmul_shape, "paged": paged_shape, "varlen": varlen_shape,
                        "mixed": mixed_shape}.get(kernel["fusion"]["family"], attention_shape)
            cases.append({"id": len(cases), "kernel": kernel["kernel"], "fusion": kernel["fusion"],
                          "schedule": kernel["schedule"], "regime": regime,
                          "shape": shape_of(kernel, regime, rng), "seed": seed * 1_000_000 + len(cases)})
    return cases


def tiles_of(case: dict) -> int:
    s = case["shape"]
    if case["fusion"]["family"] == "matmul":
        bm, bn, _ = case["schedule"]["fields"]["tile"]
        return math.ceil(s["M"] / bm) * math.ceil(s["N"] / bn)
    bm, _, _ = _attention_tile(case)
    if case["fusion"]["family"] == "paged":
        return s["B"] * s["HK"] * math.ceil(s["G"] * s["S"] / bm)
    if case["fusion"]["family"] == "varlen":   # virtual blocks: rows / bm + sequences, per head
        return s["H"] * (sum(s["q_lens"]) // bm + len(s["q_lens"]))
    if case["fusion"]["family"] == "mixed":
        return s["HK"] * s["G"] * (sum(s["q_lens"]) // bm + len(s["q_lens"]))
    return s["B"] * s["H"] * math.ceil(s["S"] / bm)


def repro(case: dict) -> str:
    keep = {k: case[k] for k in ("fusion", "schedule", "shape", "seed")}
    return f"python scripts/gpu_fuzz.py --repro '{json.dumps(keep, separators=(',', ':'))}'"


# --------------------------------------------------------------------------------------------
# building


def build_one(kernel: dict) -> dict:
    import wsched as ws

    if kernel.get("unused"):
        return {"ok": True, "seconds": 0.0, "registers": 0, "unused": True}
    t0 = time.monotonic()
    try:
        fusion, schedule = fusion_of(kernel["fusion"]), schedule_of(kernel["schedule"])
        ck = ws.compile(fusion, schedule, build=True)
        if schedule is None and hasattr(ck, "variants"):   # the per-call choice: every kernel it may pick,
            for index in range(len(ck.variants)):           # built as it builds them (a lighter one on a spill)
                ck._variant_kernel(index)
            ck = ck.primary
        r = ck.resources
        return {"ok": True, "seconds": time.monotonic() - t0, "registers": r.registers}
    except Exception as error:  # noqa: BLE001 - every failure is a finding; keep building the rest
        return {"ok": False, "seconds": time.monotonic() - t0,
                "error": f"{type(error).__name__}: {error}"[:2000]}


def build_all(kernels: list[dict], workers: int) -> list[dict]:
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(build_one, kernels))


def build_spin() -> str:
    from wsched.codegen.build import compile_cuda

    return str(compile_cuda(SPIN_SOURCE, name="wsched_fuzz_spin").cubin_path)


# --------------------------------------------------------------------------------------------
# the worker: one process, one CUDA context, cases in order


def make_inputs(case: dict, fusion, device):
    import torch

    gen = torch.Generator(device=device).manual_seed(case["seed"])
    shape = case["shape"]
    if case["fusion"]["family"] == "matmul":
        sizes = {"M": shape["M"], "N": shape["N"], "K": shape["K"]}
        inputs = []
        for node in fusion.inputs:
            dims = [sizes[d] if isinstance(d, str) else d for d in node.shape]
            t = torch.randn(dims, generator=gen, device=device)
            if node.id in ("a", "x"):
                t = t / shape["K"] ** 0.5   # keeps the sums O(1)
            inputs.append(t.to(node.dtype.torch_dtype))
        return inputs
    if case["fusion"]["family"] == "paged":
        from attention_fusions import paged_inputs

        inputs = paged_inputs(shape["lens"], case["fusion"]["page_size"], case["fusion"]["head_dim"], hk=shape["HK"],
                              g=shape["G"], s=shape["S"], seed=case["seed"], device=device)
        return inputs if case["fusion"]["lengths"] else inputs[:4]
    if case["fusion"]["family"] == "varlen":
        from attention_fusions import varlen_inputs

        kv_heads = shape["H"] // shape["G"] if shape["G"] else None
        return varlen_inputs(shape["q_lens"], shape["k_lens"], shape["H"], case["fusion"]["head_dim"],
                             kv_heads=kv_heads, seed=case["seed"] % 2**31, device=device)
    if case["fusion"]["family"] == "mixed":
        from attention_fusions import varlen_paged_inputs

        return varlen_paged_inputs(shape["q_lens"], shape["k_lens"], case["fusion"]["page_size"],
                                   case["fusion"]["head_dim"], hk=shape["HK"], g=shape["G"], seed=case["seed"] % 2**31,
                                   device=device)
    if case["fusion"]["family"] == "variant":
        from attention_fusions import variant_inputs

        return variant_inputs(fusion, shape["B"], shape["H"], shape["S"], shape["T"], case["fusion"]["head_dim"],
                              device=device, seed=case["seed"], gqa_groups=shape["G"])
    B, H, S, T, G = (shape[k] for k in ("B", "H", "S", "T", "G"))
    D = case["fusion"]["head_dim"]
    dims = ([(B, H // G, G, S, D), (B, H // G, 1, T, D), (B, H // G, 1, T, D)] if G
            else [(B, H, S, D), (B, H, T, D), (B, H, T, D)])
    return [torch.randn(d, generator=gen, device=device).to(torch.bfloat16) for d in dims]


def compare(name: str, got, ref) -> str | None:
    """None when `got` matches `ref` (the reference in the output's dtype), else what is wrong."""
    import torch

    rel_tol, max_tol = TOLERANCE[str(got.dtype).removeprefix("torch.")]
    got, ref = got.float(), ref.float()
    unwritten = torch.isnan(got)
    if unwritten.any():
        return f"{name}: {int(unwritten.sum())} of {got.numel()} elements never written (NaN poison)"
    # rows no key sees (bottom-right causal, S > T): the reference is NaN, the kernel's O is 0
    hidden = torch.isnan(ref)
    if hidden.any() and (got[hidden] != 0).any():
        return f"{name}: {int((got[hidden] != 0).sum())} elements of rows no key sees are not 0"
    infinite = (torch.isinf(ref) | torch.isinf(got)) & ~hidden
    if (got[infinite] != ref[infinite]).any():
        return f"{name}: {int((got[infinite] != ref[infinite]).sum())} infinities differ from the reference"
    finite = torch.isfinite(ref) & torch.isfinite(got)
    g, r = got[finite], ref[finite]
    if r.numel() == 0:
        return None
    scale = float(r.abs().max())
    err = float((g - r).norm() / max(float(r.norm()), 1e-30))
    worst = float((g - r).abs().max()) / max(scale, 1e-30)
    if scale == 0.0:
        err = worst = float((g - r).abs().max())
    if err >= rel_tol or worst >= max_tol:
        return f"{name}: relative L2 error {err:.2e} (tol {rel_tol:g}), max error {worst:.2e} of max |ref| (tol {max_tol:g})"
    return None


def worker_main(conn, cache_dir: str | None, device_name: str = "cuda:0") -> None:
    """Child process: answer ("ready", info), then per case ("started", id) and ("done", result).
    The tensors live on `device_name`; torch's current device is left alone (cuda:0), so another
    device exercises the multi-GPU launch path on every case."""
    if cache_dir:
        os.environ["WSCHED_CACHE_DIR"] = cache_dir
    import torch

    import wsched as ws

    torch.backends.cuda.matmul.allow_tf32 = False   # an fp32 reference
    torch.backends.cudnn.allow_tf32 = False
    device = torch.device(device_name)
    torch.empty(1, device=device)
    props = torch.cuda.get_device_properties(device)
    conn.send(("ready", {"gpu": props.name, "sms": props.multi_processor_count, "pid": os.getpid(),
                         "device": str(device), "current_device": torch.cuda.current_device()}))
    compiled: dict[str, object] = {}
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message is None:
            return
        kind, case = message
        try:
            if kind == "spin":
                from wsched.codegen.launch import LoadedKernel

                flag = torch.zeros(1, dtype=torch.int32, device=device)
                spin = LoadedKernel(Path(case["cubin"]), "wsched_fuzz_spin", smem_bytes=0, threads=32)
                conn.send(("started", case["id"]))
                spin.launch(1, [("ptr", flag.data_ptr())], device=device)
                torch.cuda.synchronize(device)
                conn.send(("done", {"status": "pass", "detail": "the spin kernel returned?!"}))
                continue
            fusion = fusion_of(case["fusion"])
            key = json.dumps([case["fusion"], case["schedule"]], sort_keys=True)
            if key not in compiled:
                compiled[key] = ws.compile(fusion, schedule_of(case["schedule"]), build=True)
            k = compiled[key]
            inputs = make_inputs(case, fusion, device)
            if hasattr(k, "kernel_for"):   # the per-call choice: the kernel it picks for this call
                chooser, k = k, k.kernel_for(*inputs)
                if chooser.dropped:   # a variant that did not build: the call ran another kernel
                    raise ValueError(f"per-call variants dropped: {chooser.dropped}")   # not a CUDA fault
            outs = k._outputs(fusion.bind(*inputs), device)
            for t in outs.values():
                t.fill_(float("nan"))
            torch.cuda.synchronize(device)
            conn.send(("started", case["id"]))
            t0 = time.perf_counter()
            k(*inputs, out=outs)
            torch.cuda.synchronize(device)
            seconds = time.perf_counter() - t0
            refs = fusion.reference(*inputs)
            refs = refs if isinstance(refs, tuple) else (refs,)
            problems = [p for p in (compare(n, outs[n], r) for n, r in zip(outs, refs)) if p]
            conn.send(("done", {"status": "wrong" if problems else "pass", "detail": "; ".join(problems),
                                "kernel_seconds": seconds}))
        except Exception as error:  # noqa: BLE001 - reported per case; the parent decides on a restart
            fatal = not isinstance(error, (ValueError, TypeError))   # a CUDA fault poisons the context
            conn.send(("done", {"status": "error", "fatal": fatal,
                                "detail": f"{type(error).__name__}: {error}"[:2000],
                                "traceback": traceback.format_exc()[-3000:]}))
            if fatal:
                return


class Watchdog:
    """Runs cases in a worker process; kills and replaces it on a hang, a crash or a CUDA fault."""

    def __init__(self, cache_dir: str | None, case_timeout: float, start_timeout: float = 180.0,
                 target=None, device: str = "cuda:0"):
        self.ctx = multiprocessing.get_context("spawn")
        self.target = target or worker_main   # a module-level function (spawn imports it)
        self.device_name = device
        self.cache_dir = cache_dir
        self.case_timeout = case_timeout
        self.start_timeout = start_timeout
        self.process = None
        self.conn = None
        self.ready = False
        self.device: dict = {}      # what the last worker reported: gpu, sms
        self.restarts = 0

    def start(self) -> None:
        parent, child = self.ctx.Pipe()
        self.process = self.ctx.Process(target=self.target, args=(child, self.cache_dir, self.device_name),
                                        daemon=True)
        self.process.start()
        child.close()
        self.conn, self.ready = parent, False

    def _ensure_ready(self) -> None:
        if self.process is None:
            self.start()
        if not self.ready:
            _, self.device = self._receive(self.start_timeout, "start")
            self.ready = True

    def _receive(self, timeout: float, what: str):
        if not self.conn.poll(timeout):
            raise TimeoutError(f"no answer to {what} in {timeout:.0f} s")
        return self.conn.recv()  # EOFError when the worker died

    def stop(self, kill: bool = False) -> None:
        if self.process is None:
            return
        if not kill:
            try:
                self.conn.send(None)
                self.process.join(10)
            except OSError:
                pass
        if self.process.is_alive():
            self.process.kill()   # the driver tears its context down, a hung kernel with it
            self.process.join(30)
        self.conn.close()
        self.process, self.conn, self.ready = None, None, False

    def _restart(self) -> None:
        self.stop(kill=True)
        self.restarts += 1
        self.start()
        self._ensure_ready()

    def run(self, kind: str, case: dict, timeout: float | None = None) -> dict:
        """One case: the worker's result, or {"status": "hang"} when the launch did not answer in
        time, or {"status": "error", "fatal": True} when the worker was lost."""
        timeout = self.case_timeout if timeout is None else timeout
        t0 = time.monotonic()
        try:
            self._ensure_ready()
            self.conn.send((kind, case))
            tag, payload = self._receive(self.start_timeout, "the case's preparation")
            if tag == "started":
                launched = time.monotonic()
                if not self.conn.poll(timeout):
                    self._restart()
                    return {"status": "hang", "detail": f"no answer {timeout:.0f} s after the launch",
                            "recovery_seconds": round(time.monotonic() - launched - timeout, 1),
                            "seconds": round(time.monotonic() - t0, 3)}
                tag, payload = self.conn.recv()
            result = payload
        except (EOFError, OSError, TimeoutError) as error:
            code = self.process.exitcode if self.process else None
            result = {"status": "error", "fatal": True,
                      "detail": f"worker lost ({type(error).__name__}: {error}; exit code {code})"}
        if result.get("fatal"):
            self._restart()
        result["seconds"] = round(time.monotonic() - t0, 3)
        return result


# --------------------------------------------------------------------------------------------
# the run


def summarise(args, kernels, builds, cases, runs, info, timings, restarts, selftest) -> dict:
    """The summary of `runs` ((case, result) pairs, a case once per repeat) over planned `cases`."""
    failures = []
    counts = {"cases": 0, "passed": 0, "hangs": 0, "wrong": 0, "errors": 0, "skipped": 0,
              "not_run": len({c["id"] for c in cases} - {c["id"] for c, _ in runs})}
    by_fusion: dict[str, dict] = {}
    sms = info.get("sms", NOMINAL_SMS)
    tiles = {"fewer_than_sms": 0, "more_than_sms": 0}
    kernel_of = {k["kernel"]: k for k in kernels}
    for case, result in runs:
        label = kernel_of[case["kernel"]]["label"]
        row = by_fusion.setdefault(label, {"cases": 0, "passed": 0, "hangs": 0, "wrong": 0, "errors": 0})
        if result["status"] == "skipped":
            counts["skipped"] += 1
            continue
        counts["cases"] += 1
        row["cases"] += 1
        tiles["fewer_than_sms" if tiles_of(case) < sms else "more_than_sms"] += 1
        status = result["status"]
        key = {"pass": "passed", "hang": "hangs", "wrong": "wrong", "error": "errors"}[status]
        counts[key] += 1
        row[key] += 1
        if status != "pass":
            failures.append({"status": status, "case": case["id"], "fusion": label,
                             "schedule": kernel_of[case["kernel"]]["short"], "shape": case["shape"],
                             "seed": case["seed"], "detail": result.get("detail", ""),
                             "repro": repro(case)})
    build_failures = [{"fusion": k["label"], "schedule": k["short"], "error": b["error"],
                       "schedule_fields": k["schedule"]}
                      for k, b in zip(kernels, builds) if not b["ok"]]
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": info.get("gpu", "?"), "sms": sms, "seed": args.seed,
        "device": info.get("device", args.device), "current_device": info.get("current_device"),
        **counts,
        "kernels": len(kernels), "kernels_built": sum(b["ok"] for b in builds),
        "build_errors": len(build_failures),
        "fusions": len(by_fusion), "tiles": tiles,
        "worker_restarts": restarts,
        "seconds": timings,
        "by_fusion": by_fusion,
        "failures": failures,
        "build_failures": build_failures,
        "watchdog_selftest": selftest,
    }


def print_summary(summary: dict) -> None:
    s = summary
    print(f"\n== gpu_fuzz {s['date']} on {s['gpu']} ({s['sms']} SMs), tensors on {s['device']} "
          f"(current device {s['current_device']}), seed {s['seed']}")
    print(f"kernels {s['kernels_built']}/{s['kernels']} built ({s['build_errors']} build errors), "
          f"{s['fusions']} fusions")
    print(f"cases {s['cases']}: passed {s['passed']}, hangs {s['hangs']}, wrong {s['wrong']}, "
          f"errors {s['errors']}; skipped {s['skipped']}, not run {s['not_run']} "
          f"(tiles < SMs: {s['tiles']['fewer_than_sms']}, > SMs: {s['tiles']['more_than_sms']})")
    print("seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in s["seconds"].items())
          + f"; worker restarts {s['worker_restarts']}")
    if s["watchdog_selftest"]:
        print(f"watchdog self-test: {s['watchdog_selftest']}")
    for label, row in sorted(s["by_fusion"].items()):
        print(f"  {label:32s} cases {row['cases']:4d}  passed {row['passed']:4d}  hangs {row['hangs']}  "
              f"wrong {row['wrong']}  errors {row['errors']}")
    for f in s["build_failures"]:
        print(f"BUILD ERROR {f['fusion']} [{f['schedule']}]: {f['error'][:600]}")
    for f in s["failures"]:
        print(f"{f['status'].upper()} {f['fusion']} [{f['schedule']}] shape {f['shape']} seed {f['seed']}: "
              f"{f['detail'][:600]}\n  repro: {f['repro']}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernels", type=int, default=128, help="distinct (fusion, schedule) kernels")
    parser.add_argument("--cases", type=int, default=2560, help="cases in all, spread over the kernels")
    parser.add_argument("--device", default="cuda:0", help="where the tensors live (the current device stays 0)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--families", default=",".join(FAMILIES), help="kernel families, taken in turn")
    parser.add_argument("--budget", type=float, default=420.0, help="seconds; no case starts after")
    parser.add_argument("--case-timeout", type=float, default=30.0, help="seconds before a launch is a hang")
    parser.add_argument("--build-workers", type=int, default=os.cpu_count() or 4)
    parser.add_argument("--inject-hang", action="store_true", help="first run a kernel that never ends")
    parser.add_argument("--dry-run", action="store_true", help="plan and build only; no GPU")
    parser.add_argument("--repro", help="one case's JSON (from a failure's repro line)")
    parser.add_argument("--only", help="comma-separated case ids of the plan (same --seed/--kernels/--cases)")
    parser.add_argument("--repeat", type=int, default=1, help="run each case this many times")
    parser.add_argument("--json", help="where to write the summary (default $OUT/gpu_fuzz.json)")
    args = parser.parse_args(argv)
    start = time.monotonic()
    cache_dir = os.environ.get("WSCHED_CACHE_DIR") or None

    if args.repro:
        case = {"id": 0, "kernel": 0, "regime": "repro", **json.loads(args.repro)}
        watchdog = Watchdog(cache_dir, args.case_timeout, device=args.device)
        statuses = []
        for _ in range(args.repeat):
            result = watchdog.run("case", case)
            statuses.append(result["status"])
            print(json.dumps(result, indent=1), flush=True)
        watchdog.stop()
        return 0 if set(statuses) == {"pass"} else 1

    rng = random.Random(args.seed)
    families = tuple(args.families.split(","))
    unknown = set(families) - set(FAMILIES)
    if unknown:
        parser.error(f"unknown families {sorted(unknown)}; choose from {', '.join(FAMILIES)}")
    kernels = plan_kernels(args.kernels, rng, families)
    cases = plan_cases(kernels, args.cases, rng, args.seed)
    if args.only:   # the same plan, a few of its cases (and only their kernels built)
        wanted = {int(i) for i in args.only.split(",")}
        cases = [c for c in cases if c["id"] in wanted]
        used = {c["kernel"] for c in cases}
        kernels = [k if k["kernel"] in used else {**k, "unused": True} for k in kernels]
    watchdog = None
    if not args.dry_run:
        watchdog = Watchdog(cache_dir, args.case_timeout, device=args.device)
        watchdog.start()          # its torch import and CUDA start overlap the builds
    print(f"building {len(kernels)} kernels with {args.build_workers} workers ...", flush=True)
    builds = build_all(kernels, args.build_workers)
    kernels_used = [k for k in kernels if not k.get("unused")]
    spin_cubin = build_spin() if args.inject_hang else None
    timings = {"build": time.monotonic() - start}
    for kernel, build in zip(kernels, builds):
        if build.get("unused"):
            continue
        state = f"{build['seconds']:.1f}s regs {build['registers']}" if build["ok"] else build["error"][:300]
        print(f"  [{kernel['kernel']:3d}] {kernel['label']:32s} {kernel['short']}: {state}", flush=True)
    runs: list[tuple[dict, dict]] = []
    selftest = None
    if not args.dry_run:
        selftest = {}
        if spin_cubin:
            print("watchdog self-test: launching a kernel that never ends ...", flush=True)
            result = watchdog.run("spin", {"id": -1, "cubin": spin_cubin}, timeout=10)
            selftest = {"status": result["status"], "recovery_seconds": result.get("recovery_seconds"),
                        "seconds": result.get("seconds")}
        run_start = time.monotonic()
        dead_kernels = {k["kernel"] for k, b in zip(kernels, builds) if not b["ok"]}
        for case in (c for c in cases for _ in range(args.repeat)):
            if time.monotonic() - start > args.budget:
                print(f"budget of {args.budget:.0f} s reached after {len(runs)} runs")
                break
            if case["kernel"] in dead_kernels:
                runs.append((case, {"status": "skipped"}))
                continue
            try:
                result = watchdog.run("case", case)
            except (EOFError, OSError, TimeoutError) as error:   # no worker could be started again
                print(f"stopping: the worker could not be restarted ({error})", flush=True)
                break
            runs.append((case, result))
            if result["status"] == "hang" and args.repeat == 1:
                dead_kernels.add(case["kernel"])     # one hang per kernel is reported, then it rests
            if result["status"] != "pass":
                print(f"case {case['id']} {kernels[case['kernel']]['label']} "
                      f"[{kernels[case['kernel']]['short']}] {case['shape']}: {result['status'].upper()} "
                      f"{result.get('detail', '')[:400]}", flush=True)
            elif case["id"] % 50 == 0:
                print(f"case {case['id']}: pass ({time.monotonic() - start:.0f} s)", flush=True)
        if spin_cubin and selftest["status"] == "hang":
            selftest["recovered"] = any(r["status"] == "pass" for _, r in runs)
        timings["run"] = time.monotonic() - run_start
        watchdog.stop()
    timings["total"] = time.monotonic() - start
    summary = summarise(args, kernels_used, [b for b in builds if not b.get("unused")], cases, runs,
                        watchdog.device if watchdog else {}, timings,
                        watchdog.restarts if watchdog else 0, selftest)
    print_summary(summary)
    target = args.json or (os.path.join(os.environ["OUT"], "gpu_fuzz.json") if os.environ.get("OUT") else None)
    if target:
        Path(target).write_text(json.dumps(summary, indent=1))
        print(f"summary written to {target}")
    bad = summary["hangs"] + summary["wrong"] + summary["errors"] + summary["build_errors"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
