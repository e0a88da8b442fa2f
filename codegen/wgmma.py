"""Generate one `wgmma.mma_async` wrapper per (shape, dtype, A source, B major-ness).

Each wrapper is a `__device__ __forceinline__` C++ function at namespace scope (it uses
`uint32_t`/`uint64_t` from `<cstdint>`, which `wsched.cuh` includes) that issues exactly one

    wgmma.mma_async.sync.aligned.m64n{N}k16.f32.{ab}.{ab}

with fp32 accumulators.  Signatures of the generated functions::

    // A and B from shared memory (descriptors from wsp::make_smem_desc)
    void wgmma_m64n{N}k16_{ab}_ss[_tb](float (&d)[N/2], uint64_t desc_a, uint64_t desc_b, int scale_d);
    // A from registers (4 x 32-bit, each two packed 16-bit values), B from shared memory
    void wgmma_m64n{N}k16_{ab}_rs[_tb](float (&d)[N/2], uint32_t a0, uint32_t a1, uint32_t a2,
                                       uint32_t a3, uint64_t desc_b, int scale_d);

`scale_d` is a run-time value: 0 overwrites the accumulators (d = A*B), non-zero accumulates
(d += A*B); it becomes the predicate operand through `setp.ne.b32` inside the asm block.
imm-scale-a = imm-scale-b = 1.  `trans_b=False` gives tnspB = 0 (B K-major), `trans_b=True`
gives tnspB = 1 (B MN-major).  tnspA exists only for shared-memory A (keyword `trans_a`,
default K-major); register A is always K-major.

The asm has no "memory" clobber (as in CUTLASS): order wgmma against shared-memory writes with
wsp::fence_proxy_async / barriers, and against accumulator reads with wsp::wgmma_fence,
wsp::wgmma_commit, wsp::wgmma_wait<N> and wsp::warpgroup_fence_operand.
"""

from __future__ import annotations

from functools import lru_cache

from wsched.target import WGMMA_N, WGMMA_OPERAND_DTYPES

__all__ = ["wgmma_function", "wgmma_name"]

_A_FROM = ("smem", "regs")


def _check(n: int, ab_dtype: str, a_from: str, trans_a: bool) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n not in WGMMA_N:
        raise ValueError(
            f"wgmma m64nNk16: N={n!r} is invalid; N must be a multiple of 8 in [8, 256] "
            f"(dense wgmma with 16-bit A/B and f32 accumulators)"
        )
    if ab_dtype not in WGMMA_OPERAND_DTYPES:
        raise ValueError(f"wgmma: ab_dtype={ab_dtype!r} is not supported; expected one of "
                         f"{WGMMA_OPERAND_DTYPES}")
    if a_from not in _A_FROM:
        raise ValueError(f"wgmma: a_from={a_from!r} is invalid; expected one of {_A_FROM}")
    if trans_a and a_from != "smem":
        raise ValueError("wgmma: trans_a (tnspA) exists only for A in shared memory; register A is K-major")


def wgmma_name(n: int, ab_dtype: str, a_from: str, trans_b: bool, *, trans_a: bool = False) -> str:
    """The function name `wgmma_function` would give, e.g. ``wgmma_m64n256k16_bf16_ss_tb``."""
    _check(n, ab_dtype, a_from, trans_a)
    name = f"wgmma_m64n{n}k16_{ab_dtype}_{'ss' if a_from == 'smem' else 'rs'}"
    if trans_a:
        name += "_ta"
    if trans_b:
        name += "_tb"
    return name


@lru_cache(maxsize=None)
def wgmma_function(
    n: int, ab_dtype: str, a_from: str, trans_b: bool, *, trans_a: bool = False
) -> tuple[str, str]:
    """Return ``(name, cpp_text)`` of one wgmma wrapper; see the module docstring."""
    name = wgmma_name(n, ab_dtype, a_from, trans_b, trans_a=trans_a)
    n_acc = n // 2
    ptx_op = f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ab_dtype}.{ab_dtype}"

    # Operand numbering: accumulators %0 .. %(n_acc-1), then A, then B, then scale_d.
    i = n_acc
    if a_from == "smem":
        a_ops = f"%{i}"
        a_inputs = ['"l"(desc_a)']
        a_params = "uint64_t desc_a"
        i += 1
    else:
        a_ops = "{" + ", ".join(f"%{i + j}" for j in range(4)) + "}"
        a_inputs = [f'"r"(a{j})' for j in range(4)]
        a_params = "uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3"
        i += 4
    b_op = f"%{i}"
    scale_op = f"%{i + 1}"
    imms = "1, 1" + (f", {int(trans_a)}" if a_from == "smem" else "") + f", {int(trans_b)}"

    # One C string literal per 8 accumulators keeps the PTX and the C++ readable.
    chunks = [range(s, min(s + 8, n_acc)) for s in range(0, n_acc, 8)]
    acc_ptx = []
    for ci, chunk in enumerate(chunks):
        body = ", ".join(f"%{k}" for k in chunk)
        head = "{" if ci == 0 else " "
        tail = "}," if ci == len(chunks) - 1 else ","
        acc_ptx.append(f'"    {head}{body}{tail}\\n"')
    acc_ptx_txt = "\n      ".join(acc_ptx)
    outputs_txt = ",\n        ".join(
        ", ".join(f'"+f"(d[{k}])' for k in chunk) for chunk in chunks
    )
    inputs_txt = ", ".join(a_inputs + ['"l"(desc_b)', '"r"(scale_d)'])

    a_desc = "A smem descriptor" if a_from == "smem" else "A in 4 registers (packed 16-bit pairs)"
    b_major = "MN-major" if trans_b else "K-major"
    text = f"""\
// {ptx_op}
// ({a_desc}, B smem descriptor {b_major}; scale_d: 0 overwrite, 1 accumulate)
__device__ __forceinline__ void {name}(float (&d)[{n_acc}], {a_params}, uint64_t desc_b, int scale_d) {{
  asm volatile(
      "{{\\n"
      ".reg .pred p;\\n"
      "setp.ne.b32 p, {scale_op}, 0;\\n"
      "{ptx_op}\\n"
      {acc_ptx_txt}
      "     {a_ops}, {b_op}, p, {imms};\\n"
      "}}\\n"
      : {outputs_txt}
      : {inputs_txt});
}}
"""
    return name, text
