"""Bad inputs to every public entry point raise the project's own errors, never a raw Python
exception: each row is a call, the error class it raises and a regex of its message (which says
what is wrong, where, and what would be right).

Entry points: the schedule (`MatmulSchedule`, `AttentionSchedule`, overrides through
`ws.schedule_for` / `ws.compile` / `ws.lower`), the rest of the API (`ws.compile`, `ws.lower`,
`ws.schedule_for`, `ws.partition`, `ws.workload_for`, `CompiledKernel.simulate`), the DSL
(`@ws.fusion`, `ws.Tensor[...]`, `ws.Fusion`), the IR parser, the verifier and printer given
IR objects built in Python with fields of the wrong type, and the simulator.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

import wsched as ws
from wsched.api import NoGPUError
from attention_fusions import attention_inputs, make_attention
from fusions import matmul, mlp, scaled_silu_f32
from wsched.errors import ArgumentError, FusionError
from wsched.lowering import ir
from wsched.lowering.parser import IRParseError, parse_expr, parse_kernel
from wsched.lowering.printer import IRPrintError, print_kernel
from wsched.lowering.simulate import SimulationError, simulate
from wsched.lowering.verify import VerifyError, verify
from wsched.schedule import ScheduleError
from wsched.workloads.attention.schedule import AttentionSchedule
from wsched.workloads.matmul.schedule import MatmulSchedule

PROJECT_ERRORS = (FusionError, ScheduleError, IRParseError, VerifyError, SimulationError, ArgumentError,
                  IRPrintError, NoGPUError)
GOLDEN = Path(__file__).parent / "golden"
MATMUL_IR = (GOLDEN / "matmul_default.ir").read_text()
ATTENTION = make_attention(64)
CASES: list = []


def case(id: str, call, error: type, message: str):
    """One row: `call()` raises `error` with a message that `message` (a regex) matches."""
    CASES.append(pytest.param(call, error, message, id=id))


def field(name: str, value, allowed: str = "") -> str:
    """The regex of a problem line naming a schedule field."""
    return re.escape(f"{name}={value!r}") + ".*" + re.escape(allowed)


# --- schedule fields: wrong types ----------------------------------------------------------------

WRONG_TYPES = {
    "tile": [None, (128, 256), (128, 256, 64, 1), (128.0, 256, 64), (True, 256, 64), "128x256x64"],
    "stages": [2.5, 3.0, "3", None, True],
    "consumer_warpgroups": [None, 1.5, "2", True],
    "producer_registers": ["24", None, 24.0],
    "consumer_registers": [None, 240.0, "240"],
    "swizzle_group": [None, 1.5, "8", True],
    "mma_inflight": [None, True, 1.0, "1"],
    "cluster": [None, (1, 1), "111", (1.0, 1, 1)],
    "operand_bytes": [None, 2.0, "2"],
    "output_bytes": [None, 2.0],
}
for name, values in WRONG_TYPES.items():
    for value in values:
        shape = "must be a tuple of three ints" if name in ("tile", "cluster") else "must be an int, not"
        case(f"MatmulSchedule-{name}={value!r}", lambda n=name, v=value: MatmulSchedule(**{n: v}),
             ScheduleError, field(name, value, shape))
for name, value in [("stages", 2.5), ("swizzle_group", None), ("tile", (128, 128)), ("mma_inflight", True)]:
    case(f"compile-{name}={value!r}", lambda n=name, v=value: ws.compile(matmul, build=False, **{n: v}),
         ScheduleError, field(name, value))
    case(f"lower-attention-{name}={value!r}", lambda n=name, v=value: ws.lower(ATTENTION, **{n: v}),
         ScheduleError, field(name, value))
for name, value in [("mode", None), ("mode", 1), ("raster", None), ("raster", "diagonal"), ("epilogue", None),
                    ("epilogue", "TMA")]:
    case(f"MatmulSchedule-{name}={value!r}", lambda n=name, v=value: MatmulSchedule(**{n: v}), ScheduleError,
         re.escape(f"{name} {value!r} is not one of"))

# --- schedule fields: values the lowering does not implement --------------------------------------

VALUES = [
    (dict(tile=(128, bn, 64)), f"BN={bn} is not supported for matmul: use 64, 128, 192, 256") for bn in (8, 16, 40, 48, 56)
] + [
    (dict(tile=(128, 260, 64)), "BN=260 must be a multiple of 8 in [8, 256]"),
    (dict(tile=(0, 256, 64)), "tile (0, 256, 64) must be three positive integers"),
    (dict(tile=(128, 256, 40)), "BK=40 is not a multiple of 16"),
    (dict(tile=(96, 256, 64)), "BM=96 must be a multiple of 64 x consumer_warpgroups=128"),
    (dict(stages=0), "stages is 0; at least 1 is needed"),
    (dict(stages=2**40), "shared memory"),
    (dict(consumer_warpgroups=0), "consumer_warpgroups is 0; at least 1 is needed"),
    (dict(consumer_warpgroups=3, tile=(192, 128, 64)), "consumer_warpgroups=3 is not supported: use 1 or 2"),
    (dict(consumer_warpgroups=2**31), "consumer_warpgroups=2147483648 is not supported"),
    (dict(producer_registers=23), "producer_registers=23 must be a multiple of 8 in [24, 256]"),
    (dict(producer_registers=176, consumer_registers=176), "producer_registers=176 is above the 168 registers"),
    (dict(consumer_registers=160), "consumer_registers=160 is below the 168 registers"),
    (dict(consumer_registers=1000), "consumer_registers=1000 must be a multiple of 8 in [24, 256]"),
    (dict(consumer_warpgroups=1, tile=(64, 256, 64), consumer_registers=240), "consumer_registers=240 is below the 248"),
    (dict(swizzle_group=0), "swizzle_group is 0; it must be in [1, 32]"),
    (dict(swizzle_group=2**31), "swizzle_group is 2147483648; it must be in [1, 32]"),
    (dict(mma_inflight=2), "mma_inflight is 2; it must be 0 or 1"),
    (dict(stages=1, mma_inflight=1), "mma_inflight=1 keeps one stage in use"),
    (dict(mode="pingpong"), "a consumer warpgroup's accumulators [128, 256] hold 256 fp32 registers per thread, more "
                            "than the 128 that leave room for the epilogue: use BN <= 128 with 128 rows per warpgroup"),
    (dict(mode="pingpong", tile=(128, 128, 64), consumer_warpgroups=1, consumer_registers=256),
     "mode 'pingpong' alternates two consumer warpgroups on tiles of their own: it needs consumer_warpgroups=2 (not 1)"),
    (dict(mode="pingpong", tile=(128, 128, 64), split_k=4),
     "split_k=4 with mode 'pingpong': a split unit's ticket is per tile, not per warpgroup's tile; use mode "
     "'cooperative' for split-K"),
    (dict(tile=(256, 128, 64), split_k=2), "split_k=2 with 128 rows per consumer warpgroup: split-K takes 64 rows per "
                                          "warpgroup (BM = 64 x consumer_warpgroups)"),
    (dict(tile=(384, 128, 64), stages=2), "each consumer warpgroup must own 64 or 128 rows (BM / consumer_warpgroups = "
                                          "192); use BM = 128 or 256"),
    (dict(mode="pingpong", tile=(192, 128, 64), stages=2),
     "each consumer warpgroup must own 64 or 128 rows (BM = 192: in mode 'pingpong' each consumer warpgroup takes "
     "whole tiles of its own); use BM = 64 or 128"),
    (dict(cluster=(2, 2, 1)), "cluster (2, 2, 1): use (n, 1, 1) (CTAs on tiles along M, sharing B) or (1, n, 1) "
                              "(along N, sharing A) with n in (1, 2, 4)"),
    (dict(cluster=(2, 1, 1), split_k=2), "a cluster's CTAs walk whole tiles together"),
    (dict(operand_bytes=4, tile=(128, 256, 32)), "operand_bytes=4 is not supported"),
    (dict(operand_bytes=1, tile=(128, 256, 128)), "operand_bytes=1 is not supported"),
    (dict(output_bytes=3), "output_bytes=3 must be one of 2, 4, 6, 8"),
    (dict(output_bytes=1), "output_bytes=1 must be one of 2, 4, 6, 8"),
]
for kwargs, message in VALUES:
    case("MatmulSchedule-" + "-".join(f"{k}={v!r}" for k, v in kwargs.items()),
         lambda kw=kwargs: MatmulSchedule(**kw), ScheduleError, re.escape(message))
ATTENTION_VALUES = [
    (dict(tile=(128, 256, 128)), "BN=256 keys per block with head dim 128, mma_inflight=1 and 2 consumer"),
    (dict(tile=(128, 128, 256)), "BN=128 keys per block with head dim 256, mma_inflight=1"),
    (dict(tile=(128, 40, 128)), "BN=40 (keys per block) must be a multiple of 16"),
    (dict(tile=(128, 128, 80)), "head dim (BK) 80 is not one of 64, 96, 128, 192, 256 (of Q and K; V: 64, 96, 128, "
                                "256 (V the same) or 192 with V 128)"),
    (dict(epilogue="tma_store"), "attention stores O and LSE with epilogue='direct'"),
    (dict(mode="pingpong", mma_inflight=0), "it needs consumer_warpgroups=2 and mma_inflight=1"),
    (dict(tile=(128, 192, 256), mma_inflight=0), "not even one stage fits"),
]
for kwargs, message in ATTENTION_VALUES:
    case("AttentionSchedule-" + "-".join(f"{k}={v!r}" for k, v in kwargs.items()),
         lambda kw=kwargs: AttentionSchedule(**{"tile": (128, 128, 128), "stages": 1, **kw}), ScheduleError,
         re.escape(message))
case("base-Schedule", lambda: ws.Schedule(), ScheduleError, "Schedule is the shared base of the workloads' schedules")

# --- the rest of the API -------------------------------------------------------------------------

NOT_FUSIONS = [42, None, "mlp", lambda a: a, MatmulSchedule()]
for value in NOT_FUSIONS:
    name = type(value).__name__
    case(f"compile({name})", lambda v=value: ws.compile(v, build=False), FusionError,
         r"^ws\.compile: expects a fusion \(a function decorated with @ws\.fusion\), got ")
    case(f"lower({name})", lambda v=value: ws.lower(v), FusionError, r"^ws\.lower: expects a fusion")
    case(f"schedule_for({name})", lambda v=value: ws.schedule_for(v), FusionError, r"^ws\.schedule_for: expects a fusion")
case("partition(42, schedule)", lambda: ws.partition(42, MatmulSchedule()), FusionError, r"^partition: expects a fusion")
case("workload_for(42)", lambda: ws.workload_for(42), FusionError, r"^workload_for: expects a fusion")
for value in [42, "fast", {"stages": 3}, (128, 256, 64)]:
    name = type(value).__name__
    case(f"compile(schedule={name})", lambda v=value: ws.compile(matmul, schedule=v, build=False), ScheduleError,
         r"schedule=.* \(" + name + r"\) is not a Schedule; build one with ws\.schedule_for\(fusion, \*\*fields\)")
    case(f"partition(fusion, {name})", lambda v=value: ws.partition(matmul, v), ScheduleError, r"is not a Schedule")
case("schedule_for(f, 42)", lambda: ws.schedule_for(matmul, 42), ScheduleError, r"schedule=42 \(int\) is not a Schedule")
case("schedule-and-overrides", lambda: ws.schedule_for(matmul, MatmulSchedule(), stages=3), ScheduleError,
     "pass either a Schedule or keyword overrides, not both")
case("unknown-override", lambda: ws.compile(matmul, stage=3, build=False), ScheduleError,
     re.escape("unknown schedule field(s) ['stage']"))
case("attention-schedule-for-matmul", lambda: ws.compile(matmul, AttentionSchedule(tile=(128, 128, 64)), build=False),
     ScheduleError, r"matmul is taken by the matmul workload; its schedule must be a MatmulSchedule, not "
                    r"AttentionSchedule \(ws\.schedule_for\(matmul, \*\*fields\) builds one\)")
case("matmul-schedule-for-attention", lambda: ws.compile(ATTENTION, MatmulSchedule(), build=False), ScheduleError,
     "its schedule must be a AttentionSchedule, not MatmulSchedule")
case("head_dim-str", lambda: ws.schedule_for(ATTENTION, head_dim="x"), ScheduleError, r"head_dim='x' is not one of 64, 96, 128, 192, 256")
case("head_dim-mismatch", lambda: ws.compile(ATTENTION, head_dim=128, build=False), ScheduleError,
     r"the schedule's head dim \(tile\[2\] = 128\) differs from Q's head dim 64")
case("output_bytes-mismatch", lambda: ws.compile(scaled_silu_f32, MatmulSchedule(stages=4), build=False), ScheduleError,
     r"counts 2 bytes per staged output element \(output_bytes\) but the outputs of scaled_silu_f32 \(f32\) take 4")
for value in ["no", 1, 0]:
    case(f"compile(build={value!r})", lambda v=value: ws.compile(matmul, build=v), ArgumentError,
         r"build=.*: expected True \(build now\), False \(do not\) or None")

# --- fusions the DSL takes and a kernel cannot --------------------------------------------------


def fusion_with_unused_input():
    @ws.fusion
    def unused(a: ws.Tensor[ws.bf16, "M", "K"], b: ws.Tensor[ws.bf16, "K", "N"], c: ws.Tensor[ws.bf16, "N"]):
        return ws.matmul(a, b).to(ws.bf16)
    return unused


def fusion_returning_twice():
    @ws.fusion
    def twice(a: ws.Tensor[ws.bf16, "M", "K"], b: ws.Tensor[ws.bf16, "K", "N"]):
        c = ws.matmul(a, b).to(ws.bf16)
        return c, c
    return twice


case("unused-input-compile", lambda: ws.compile(fusion_with_unused_input(), build=False), ScheduleError,
     r"unused: input c \(.*\) is not used by any output; .*remove the parameter")
case("unused-input-lower", lambda: ws.lower(fusion_with_unused_input()), ScheduleError, r"input c .* is not used")
case("return-c-c-compile", lambda: ws.compile(fusion_returning_twice(), build=False), ScheduleError,
     r"twice returns n1 twice \(outputs 0 and 1\); a kernel stores each output once: return it once")
case("return-c-c-partition", lambda: ws.partition(fusion_returning_twice(), MatmulSchedule()), ScheduleError,
     r"returns n1 twice")


def two_matmuls():
    @ws.fusion
    def two(a: ws.Tensor[ws.bf16, "M", "K"], b: ws.Tensor[ws.bf16, "K", "N"], c: ws.Tensor[ws.bf16, "N", "P"]):
        return ws.matmul(ws.matmul(a, b).to(ws.bf16), c)
    return two


def no_matmul():
    @ws.fusion
    def relu_only(a: ws.Tensor[ws.bf16, "M", "K"]):
        return ws.relu(a)
    return relu_only


def attention_symbolic_head_dim():
    @ws.fusion
    def sym(q: ws.Tensor[ws.bf16, "B", "H", "S", "D"], k: ws.Tensor[ws.bf16, "B", "H", "T", "D"],
            v: ws.Tensor[ws.bf16, "B", "H", "T", "D"]):
        return ws.matmul(ws.softmax(ws.matmul(q, k.transpose(-1, -2)), dim=-1), v).to(ws.bf16)
    return sym


def f32_operands():
    @ws.fusion
    def f32mm(a: ws.Tensor[ws.f32, "M", "K"], b: ws.Tensor[ws.f32, "K", "N"]):
        return ws.matmul(a, b)
    return f32mm


case("two-matmuls", lambda: ws.compile(two_matmuls(), build=False), ScheduleError, r"no workload takes two")
case("no-matmul", lambda: ws.compile(no_matmul(), build=False), ScheduleError, r"matmul needs exactly one matmul \(found 0\)")
case("attention-symbolic-head-dim", lambda: ws.compile(attention_symbolic_head_dim(), build=False), ScheduleError,
     r"the head dim of Q is the symbol 'D'; declare it as a number")
case("f32-operands", lambda: ws.compile(f32_operands(), build=False), ScheduleError, r"wgmma takes bf16 or f16")

# --- the DSL ---------------------------------------------------------------------------------------


def keyword_only():
    @ws.fusion
    def kw(a: ws.Tensor[ws.bf16, "M", "K"], *, b: ws.Tensor[ws.bf16, "K", "N"]):
        return ws.matmul(a, b)


def variadic():
    @ws.fusion
    def var(*tensors):
        return tensors[0]


def missing_annotation():
    @ws.fusion
    def bare(a, b):
        return ws.matmul(a, b)


def returns_a_number():
    @ws.fusion
    def number(a: ws.Tensor[ws.bf16, "M"]):
        return 1.0


for value in [42, None, print, "fusion"]:
    case(f"ws.fusion({type(value).__name__})", lambda v=value: ws.fusion(v), FusionError,
         r"^ws\.fusion: decorates a Python function whose parameters are annotated with ws\.Tensor")
case("keyword-only-parameter", keyword_only, FusionError, r"kw: keyword-only parameter b is not supported; declare it before")
case("variadic-parameter", variadic, FusionError, r"var: variadic parameter tensors is not supported")
case("missing-annotation", missing_annotation, FusionError, r"bare: parameter a needs a ws\.Tensor\[dtype, dims\.\.\.\] annotation")
case("returns-a-number", returns_a_number, FusionError, r"number: must return a ws tensor or a tuple of them")
for params, message in [((), r"needs a ws dtype \(ws\.bf16, ws\.f16, ws\.f32, ws\.i32\) and the dims"),
                        (("bf16", "M"), r"the first argument must be a ws dtype"),
                        ((ws.bf16, 0), r"dims must be symbol names \(str\), a symbol plus one \(\"B\+1\", offsets of B sequences\) or positive ints, got 0"),
                        ((ws.bf16, 1.5), r"got 1\.5"), ((ws.bf16, None), r"got None"), ((ws.bf16, "1M"), r"got '1M'")]:
    case(f"Tensor[{params!r}]", lambda p=params: ws.Tensor[p], FusionError, r"^Tensor\[\.\.\.\]: .*" + message)
case("Fusion(nodes=42)", lambda: ws.Fusion("x", 42, ["n0"]), FusionError, r"x: nodes must be a list, got int")
case("Fusion(nodes=[1])", lambda: ws.Fusion("x", [1], ["n0"]), FusionError, r"x: nodes must be ws Nodes, got int")
case("Fusion(outputs=[])", lambda: ws.Fusion("x", [], []), FusionError, r"x: has no outputs")
case("Fusion(outputs=[missing])", lambda: ws.Fusion("x", [], ["n0"]), FusionError, r"output 'n0' is not a node")
case("Fusion(name=1)", lambda: ws.Fusion(1, [], ["n0"]), FusionError, r"the name must be a str, got int")

# --- CompiledKernel.simulate ------------------------------------------------------------------------

A, B = torch.randn(128, 64).bfloat16(), torch.randn(64, 128).bfloat16()


def simulate_matmul(*tensors, **options):
    return ws.compile(matmul, build=False).simulate(*tensors, **options)


SIMULATE = [
    ("no-inputs", (), {}, FusionError, r"matmul: expected 2 inputs \(a, b\), got 0"),
    ("one-input", (A,), {}, FusionError, r"expected 2 inputs \(a, b\), got 1"),
    ("three-inputs", (A, B, B), {}, FusionError, r"expected 2 inputs \(a, b\), got 3"),
    ("None-input", (A, None), {}, FusionError, r"input 1 has type NoneType; expected a torch tensor"),
    ("shape-tuples", ((128, 64), (64, 128)), {}, FusionError, r"input 0 has type tuple; expected a torch tensor"),
    ("numpy-input", (A.float().numpy(), B), {}, FusionError, r"input 0 has type numpy\.ndarray"),
    ("f32-tensor", (A, B.float()), {}, FusionError, r"b is declared bf16\[K, N\] but got a torch\.float32 tensor"),
    ("f16-tensor", (A.half(), B), {}, FusionError, r"a is declared bf16\[M, K\] but got a torch\.float16 tensor"),
    ("rank-3", (A[None], B), {}, FusionError, r"a is declared bf16\[M, K\] but got shape \(1, 128, 64\)"),
    ("inner-mismatch", (A, B.t()), {}, FusionError, r"symbol K is bound to two sizes: 64 \(a dim 1\) and 128"),
    ("K-zero", (A[:, :0], B[:0]), {}, FusionError, r"K is 0 \(a dim 1\); the kernel needs at least one element there"),
    ("num_sms-0", (A, B), dict(num_sms=0), SimulationError, r"num_sms must be >= 1, got 0"),
    ("num_sms-float", (A, B), dict(num_sms=1.5), ArgumentError, r"num_sms=1\.5 \(float\): expected a positive int"),
    ("num_sms-str", (A, B), dict(num_sms="4"), ArgumentError, r"num_sms='4' \(str\)"),
    ("num_sms-bool", (A, B), dict(num_sms=True), ArgumentError, r"num_sms=True \(bool\)"),
    ("seed-str", (A, B), dict(seed="x"), ArgumentError, r"seed='x' \(str\): expected an int"),
    ("seed-None", (A, B), dict(seed=None), ArgumentError, r"seed=None \(NoneType\)"),
]
for id, tensors, options, error, message in SIMULATE:
    case(f"simulate-{id}", lambda t=tensors, o=options: simulate_matmul(*t, **o), error, message)
case("simulate-cluster-on-one-sm",
     lambda: ws.compile(matmul, cluster=(2, 1, 1), build=False).simulate(A, B, num_sms=1), SimulationError,
     r"num_sms = 1 is less than the cluster cluster\(2, 1, 1\): a cluster's 2 CTAs are resident at once, one per SM")
q, k, v = attention_inputs(1, 1, 64, 64, 64)
case("simulate-attention-head-dim", lambda: ws.compile(ATTENTION, build=False).simulate(q, k[..., :32], v),
     FusionError, r"k is declared bf16\[B, H, T, 64\] but dim 3 has size 32|k dim 3 has size 32")
case("simulate-mlp-bias-shape", lambda: ws.compile(mlp, build=False).simulate(A, B, torch.zeros(64).bfloat16()),
     FusionError, r"symbol N is bound to two sizes: 128 \(b dim 1\) and 64 \(bias dim 0\)")

case("call-out-not-a-dict", lambda: ws.compile(matmul, build=False)(A, B, out=42), ArgumentError,
     r"matmul: out= takes a dict of output name -> torch\.Tensor \(names: out\), got 42")
case("call-out-of-arrays", lambda: ws.compile(matmul, build=False)(A, B, out={"out": [0.0]}), ArgumentError,
     r"out= takes a dict of output name -> torch\.Tensor")
if not torch.cuda.is_available():
    case("call-without-a-gpu", lambda: ws.compile(matmul, build=False)(A, B), NoGPUError,
         r"matmul: no CUDA device is available here; .* with \.simulate\(\.\.\.\) instead")

# --- the IR parser -----------------------------------------------------------------------------------

HEADER = "kernel k() grid(1) cluster(1, 1, 1) {"
PARSE = [
    ("stray-brace-after-kernel", MATMUL_IR + "}", r"line 94, column 1: unexpected `}`; expected end of input"),
    ("stray-brace-first", "}", r"line 1, column 1: unexpected `}`; expected `kernel`"),
    ("stray-brace-inside", MATMUL_IR.replace("tma.commit", "}", 1), r"unexpected `}`; expected end of input"),
    ("unclosed", HEADER, r"unexpected end of input; expected a statement, `barrier`, `smem` or `}`"),
    ("empty", "", r"line 1, column 1: unexpected end of input; expected `kernel`"),
    ("blank", " \n\t", r"unexpected end of input; expected `kernel`"),
    ("deep-blocks", HEADER + "if 1 {" * 40 + "}" * 41, r"blocks nested more than 32 deep; the IR allows at most 32"),
    ("deep-grid", "kernel k() grid(" + "1 + " * 100 + "1) cluster(1, 1, 1) {}",
     r"expression nested more than 64 operators deep; bind parts of it to names with `let`"),
    ("deep-right-nesting", "kernel k() grid(" + "1 + (" * 100 + "1" + ")" * 100 + ") cluster(1, 1, 1) {}",
     r"expression nested more than 64 operators deep"),
    ("deep-calls", "kernel k() grid(" + "min(1, " * 80 + "1" + ")" * 80 + ") cluster(1, 1, 1) {}",
     r"expression nested more than 64 operators deep"),
    ("huge-int", "kernel k() grid(" + "9" * 5000 + ") cluster(1, 1, 1) {}",
     r"integer literal 9999999999\.\.\.9999999999 \(5000 digits\) does not fit in 64 bits"),
    ("int-over-64-bits", "kernel k() grid(9223372036854775808) cluster(1, 1, 1) {}",
     r"integer literal 9223372036854775808 does not fit in 64 bits"),
    ("negative-int-over-64-bits", HEADER + "let x = -9223372036854775809 }", r"integer literal -9223372036854775809 does not fit"),
    ("huge-cluster", "kernel k() grid(1) cluster(" + "1" * 30 + ", 1, 1) {}", r"does not fit in 64 bits"),
    ("unknown-statement", HEADER + "frobnicate }", r"unexpected `frobnicate`; expected a statement"),
    ("glued-keyword", HEADER + "letx = 1 }", r"unknown word `letx`; did you mean `let`\?"),
    ("bad-character", HEADER + "@ }", r"unexpected character `@`"),
    ("nul-character", HEADER + "\x00 }", r"unexpected character"),
    ("unknown-loop-kind", HEADER + "for i in bogus(0, 1, 1) { } }", r"unknown loop kind `bogus`; expected `serial`, `persistent`, `unroll` or `dynamic`"),
    ("unknown-tile-op", HEADER + "tile.frob a, b }", r"unknown tile op `tile\.frob`"),
    ("unknown-setmaxnreg", HEADER + "setmaxnreg.up 40 }", r"unknown instruction `setmaxnreg\.up`"),
    ("let-without-value", HEADER + "let x = }", r"unexpected `}`; expected an expression"),
    ("declaration-after-statement", HEADER + "let x = 1 smem A: bf16[1] swizzle(0) }",
     r"`smem` and then `barrier` declarations come first"),
]
for id, text, message in PARSE:
    case(f"parse_kernel-{id}", lambda t=text: parse_kernel(t), IRParseError, message)
EXPRS = [
    ("stray-paren", "1)", r"unexpected `\)`; expected end of input"),
    ("lone-minus", "-", r"unexpected end of input; expected `inf`, a float or an integer"),
    ("call-arity", "min(1)", r"`min` takes 2 arguments, not 1"),
    ("unknown-call", "pow(1, 2)", r"unknown function `pow`; expected `min`, `max`, `ceil_div`, `bit_length` or `select`"),
    ("deep-sum", "1" + " + 1" * 20000, r"expression nested more than 64 operators deep"),
    ("power-operator", "a ** b", r"unexpected `\*`"),
    ("brace", "{", r"unexpected `{`; expected an expression"),
]
for id, text, message in EXPRS:
    case(f"parse_expr-{id}", lambda t=text: parse_expr(t), IRParseError, message)
for value in [None, b"kernel", 42, ["kernel"]]:
    case(f"parse_kernel({type(value).__name__})", lambda v=value: parse_kernel(v), ArgumentError,
         r"text=.* \(" + type(value).__name__ + r"\): expected the IR text \(a str\)")
case("parse_expr(None)", lambda: parse_expr(None), ArgumentError, r"text=None \(NoneType\)")
case("parse_kernel-source_name", lambda: parse_kernel(MATMUL_IR, source_name=3), ArgumentError, r"source_name=3 \(int\)")

# --- the verifier, the printer and the simulator, given IR built in Python ---------------------------

KERNEL = parse_kernel(MATMUL_IR)


def replace_at(kernel: ir.Kernel, path: tuple[int, ...], **fields) -> ir.Kernel:
    """`kernel` with the statement at `path` (traversal path, as in verify's messages) changed."""
    def edit(stmts, path):
        i, rest = path[0], path[1:]
        s = stmts[i]
        if not rest:
            new = dataclasses.replace(s, **fields)
        elif isinstance(s, ir.If):
            children = edit(s.then + s.orelse, rest)
            new = dataclasses.replace(s, then=children[:len(s.then)], orelse=children[len(s.then):])
        else:
            new = dataclasses.replace(s, body=edit(s.body, rest))
        return stmts[:i] + (new,) + stmts[i + 1:]
    return dataclasses.replace(kernel, body=edit(kernel.body, path))


EXPR = r"an expression \(ir\.IntConst, ir\.FloatConst, ir\.Var, ir\.BinOp or ir\.Call\)"
FIELDS = [   # (path, field, value, what is expected)
    ((0,), "value", None, EXPR), ((0,), "value", "x", EXPR), ((0,), "value", 1.5, EXPR), ((0,), "value", 3, EXPR),
    ((0,), "name", None, "a str"), ((0,), "name", 3, "a str"),
    ((4,), "arrivals", 1.5, "an int"), ((4,), "arrivals", "1", "an int"), ((4,), "arrivals", True, "an int"),
    ((4,), "arrivals", 2**70, None), ((4,), "barrier", None, "a str"),
    ((8,), "warpgroups", "1", "an int"), ((8,), "warpgroups", 2**70, None), ((8,), "registers", None, "an int"),
    ((8,), "name", 1, "a str"),
    ((9, 0), "registers", 232.0, "an int"),
    ((9, 1), "shape", [64, 256], "a tuple of ints"),
    ((9, 1), "dtype", None, "a str"),
    ((9, 3), "start", 0, EXPR), ((9, 3), "stop", None, EXPR), ((9, 3), "var", None, "a str"),
    ((9, 3), "iteration", None, "a str"),
    ((9, 4, 0), "pending", "0", "an int"), ((9, 4, 0), "read", None, "a bool"),
    ((9, 3, 9), "pending", 0.0, "an int"),
    ((9, 3, 11), "bar", None, "a BarRef"), ((9, 3, 11), "bar", "empty[s]", "a BarRef"),
    ((9, 3, 12, 1), "id", 1, EXPR), ((9, 3, 12, 1), "threads", "128", "an int"),
    ((9, 3, 12, 4), "dst", "C_bf16", "a SmemRef"), ((9, 3, 12, 4), "src", None, "a str"),
    ((9, 3, 12, 7, 0), "coords", None, r"a tuple of expressions"),
    ((9, 3, 8, 3), "phase", None, EXPR), ((9, 3, 8, 3), "phase", "ph", EXPR),
    ((9, 3, 8, 5), "b", None, "a SmemRef"), ((9, 3, 8, 5), "a", 3, r"a SmemRef or a str"),
    ((9, 3, 8, 5), "accumulate", True, EXPR),
    ((8, 1, 0, 8, 4), "bytes", 49152, EXPR), ((8, 1, 0, 8, 5), "tensor", None, "a str"),
    ((8, 1, 0, 8, 5), "dst", None, "a SmemRef"),
]
for path, name, value, expected in FIELDS:
    message = (rf"IR line \d+ \(.*\): `{name}` is {re.escape(repr(value))} \({type(value).__name__}\); expected {expected}"
               if expected else rf"`{name}` is {value}, which does not fit in 64 bits")
    case(f"verify-{'.'.join(map(str, path))}-{name}={value!r}",
         lambda p=path, n=name, v=value: verify(replace_at(KERNEL, p, **{n: v})), VerifyError, message)
NESTED = [   # a field of a node inside a statement, an item of a tuple
    ((9, 1), dict(shape=(64.0, 256)), r"`shape\[0\]` is 64\.0 \(float\); expected an int"),
    ((9, 3, 12, 7, 0), dict(coords=(ir.Var("m0"), 0)), r"`coords\[1\]` is 0 \(int\); expected " + EXPR),
    ((9, 3, 8, 3), dict(bar=ir.BarRef("full", None)), r"`bar\.index` is None \(NoneType\); expected " + EXPR),
    ((9, 3, 8, 3), dict(bar=ir.BarRef(None, ir.Var("s"))), r"`bar\.barrier` is None"),
    ((9, 3, 8, 3), dict(phase=ir.BinOp("&", ir.Var("ph"), None)), r"`phase\.rhs` is None"),
    ((9, 3, 8, 3), dict(phase=ir.BinOp(1, ir.Var("ph"), ir.IntConst(1))), r"`phase\.op` is 1 \(int\); expected a str"),
    ((9, 3, 8, 3), dict(phase=ir.IntConst(1.5)), r"`phase\.value` is 1\.5 \(float\); expected an int"),
    ((9, 3, 8, 3), dict(phase=ir.FloatConst(1)), r"`phase\.value` is 1 \(int\); expected a float"),
    ((9, 3, 8, 3), dict(phase=ir.Call("min", [ir.Var("ph"), ir.IntConst(1)])), r"`phase\.args` is \[.*\] \(list\)"),
    ((9, 3, 8, 5), dict(b=ir.SmemRef("B", None)), r"`b\.index` is None \(NoneType\); expected a tuple of expressions"),
    ((9, 3, 8, 3), dict(phase=ir.Var(None)), r"`phase\.name` is None"),
]
for path, fields, message in NESTED:
    case(f"verify-nested-{'.'.join(map(str, path))}-{message[:24]}",
         lambda p=path, f=fields: verify(replace_at(KERNEL, p, **f)), VerifyError, message)
DEEP = ir.IntConst(1)
for _ in range(100):
    DEEP = ir.BinOp("+", DEEP, ir.IntConst(1))
DEEP_BLOCK: tuple = (ir.Return(),)
for _ in range(40):
    DEEP_BLOCK = (ir.If(ir.IntConst(1), DEEP_BLOCK),)
KERNEL_FIELDS = [
    (dict(grid=DEEP), r"`grid` is nested more than 64 operators deep"),
    (dict(body=DEEP_BLOCK), r"statements nested more than 32 blocks deep"),
    (dict(grid=None), r"IR line 1 \(kernel matmul\): `grid` is None \(NoneType\); expected " + EXPR),
    (dict(name=None), r"`name` is None \(NoneType\); expected a str"),
    (dict(cluster=(1, 1)), r"`cluster` is \(1, 1\) \(tuple\); expected a tuple of 3 ints"),
    (dict(cluster=[1, 1, 1]), r"`cluster` is \[1, 1, 1\] \(list\)"),
    (dict(params=None), r"`params` is None \(NoneType\); expected a tuple of parameters"),
    (dict(params=(None,)), r"`params\[0\]` is None \(NoneType\); expected a HostParam or a ScalarParam or a TensorMapParam or a WorkspaceParam or a SpanParam or a GlobalParam"),
    (dict(smem=None), r"`smem` is None \(NoneType\); expected a tuple of ir\.SmemDecl"),
    (dict(barriers=[ir.BarrierDecl("full", 3)]), r"`barriers` is .* \(list\); expected a tuple of ir\.BarrierDecl"),
    (dict(body=None), r"`body` is None \(NoneType\); expected a tuple of statements"),
    (dict(body=(None,)), r"statement 1 of its block is None \(NoneType\); expected an IR statement"),
    (dict(body=("return",)), r"statement 1 of its block is 'return' \(str\)"),
    (dict(body=(ir.Setmaxnreg(None, 40),)), r"`action` of Setmaxnreg \(statement 1 of its block\) is None"),
    (dict(body=(ir.For("i", ir.IntConst(0), ir.IntConst(1), ir.IntConst(1), "serial", None),)),
     r"IR \(for i\): `body` is None \(NoneType\); expected a tuple of statements"),
]
for fields, message in KERNEL_FIELDS:
    case(f"verify-kernel-{'-'.join(fields)}-{message[:20]}", lambda f=fields: verify(dataclasses.replace(KERNEL, **f)),
         VerifyError, message)
case("verify(None)", lambda: verify(None), VerifyError, r"verify takes an ir\.Kernel, got NoneType")
case("verify(text)", lambda: verify(MATMUL_IR), VerifyError, r"verify takes an ir\.Kernel, got str")
case("print-malformed-kernel", lambda: print_kernel(replace_at(KERNEL, (9, 3, 8, 3), phase=None)), IRPrintError,
     r"cannot print this kernel:\nIR line \d+ \(.*mbarrier\.wait\): `phase` is None")
case("str-of-malformed-kernel", lambda: str(dataclasses.replace(KERNEL, grid="1")), IRPrintError, r"`grid` is '1' \(str\)")
SIM_ARGS = {"M": 128, "N": 256, "K": 64, "a": torch.zeros(128, 64), "b": torch.zeros(64, 256), "out": torch.zeros(128, 256)}
case("simulate-malformed-kernel", lambda: simulate(replace_at(KERNEL, (9, 3, 8, 3), phase="ph"), dict(SIM_ARGS)),
     VerifyError, r"`phase` is 'ph' \(str\)")
case("simulate-float-registers", lambda: simulate(replace_at(KERNEL, (8,), registers=24.0), dict(SIM_ARGS)),
     VerifyError, r"`registers` is 24\.0 \(float\); expected an int")
case("simulate-deep-grid", lambda: simulate(dataclasses.replace(KERNEL, grid=DEEP), dict(SIM_ARGS)), VerifyError,
     r"nested more than 64 operators deep")
case("simulate-missing-argument", lambda: simulate(KERNEL, {k: v for k, v in SIM_ARGS.items() if k != "b"}),
     SimulationError, r"b")
case("simulate-num_sms-0", lambda: simulate(KERNEL, dict(SIM_ARGS), num_sms=0), SimulationError, r"num_sms must be >= 1, got 0")


case("verify-grid-power", lambda: verify(dataclasses.replace(KERNEL, grid=ir.BinOp("**", ir.IntConst(1), ir.IntConst(2)))),
     VerifyError, r"the grid: `\*\*` is not an operator of the IR")
case("verify-grid-min-arity", lambda: verify(dataclasses.replace(KERNEL, grid=ir.Call("min", (ir.IntConst(1),)))),
     VerifyError, r"the grid: min\(\) takes 2 arguments, not 1")
case("verify-unknown-call", lambda: verify(dataclasses.replace(KERNEL, grid=ir.Call("foo", (ir.IntConst(1),)))),
     VerifyError, r"the grid: `foo` is not a function of the IR")
case("verify-huge-role", lambda: verify(replace_at(KERNEL, (8,), warpgroups=2**40)), VerifyError,
     r"the roles add up to \d+ threads")


def test_the_table_is_large():
    assert len(CASES) >= 150, len(CASES)


@pytest.mark.parametrize("call, error, message", CASES)
def test_bad_input_raises_a_project_error_naming_the_problem(call, error, message):
    assert issubclass(error, PROJECT_ERRORS)
    try:
        call()
    except PROJECT_ERRORS as e:
        assert isinstance(e, error), f"{type(e).__name__}: {e}"
        assert re.search(message, str(e)), f"{message!r} not in:\n{e}"
    except Exception as e:   # noqa: BLE001 -- a raw Python exception is the failure this test looks for
        pytest.fail(f"raw {type(e).__name__}: {e}")
    else:
        pytest.fail(f"accepted; expected {error.__name__} matching {message!r}")
