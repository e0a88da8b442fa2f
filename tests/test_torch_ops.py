"""Each compiled kernel is a torch custom op (wsched/torch_ops.py): its name and schema, the fake
implementation's output shapes and dtypes, torch.library.opcheck, and torch.compile /
torch.export tracing through `k(...)` — all on the CPU, where the op runs the simulator."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses import FakeTensorMode

import wsched as ws
from wsched import torch_ops
from wsched.kernel import NoGPUError

from attention_fusions import attention_inputs, make_attention, make_varlen_attention, varlen_inputs
from fusions import inputs_for, matmul, mlp


@ws.fusion
def two_outputs(a: ws.Tensor[ws.bf16, "M", "K"], b: ws.Tensor[ws.bf16, "K", "N"], bias: ws.Tensor[ws.bf16, "N"]):
    y = ws.matmul(a, b) + bias
    return y.to(ws.bf16), ws.gelu(y)


@ws.fusion
def linear_residual(h: ws.Tensor[ws.bf16, "M", "F"], w: ws.Tensor[ws.bf16, "F", "N"],
                    bias: ws.Tensor[ws.bf16, "N"], res: ws.Tensor[ws.bf16, "M", "N"]):
    return (ws.matmul(h, w) + bias + res).to(ws.bf16)


attention_lse = make_attention(128, causal=True, lse=True)
varlen = make_varlen_attention(64, causal="bottom_right")
_kernels: dict = {}


def kernel(fusion, **overrides):
    key = (fusion.name, tuple(sorted(overrides.items())))
    if key not in _kernels:
        _kernels[key] = ws.compile(fusion, build=False, **overrides)
    return _kernels[key]


class Block(torch.nn.Module):
    """x + (gelu(x W1 + b1) W2 + b2): two wsched kernels, the second adding the residual."""

    def __init__(self, d: int = 64, f: int = 128):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w1 = torch.nn.Parameter((torch.randn(d, f, generator=g) / d ** 0.5).bfloat16(), requires_grad=False)
        self.b1 = torch.nn.Parameter(torch.randn(f, generator=g).bfloat16(), requires_grad=False)
        self.w2 = torch.nn.Parameter((torch.randn(f, d, generator=g) / f ** 0.5).bfloat16(), requires_grad=False)
        self.b2 = torch.nn.Parameter(torch.randn(d, generator=g).bfloat16(), requires_grad=False)
        self.up, self.down = kernel(mlp), kernel(linear_residual)

    def forward(self, x):
        return self.down(self.up(x, self.w1, self.b1), self.w2, self.b2, x)

    def reference(self, x):
        return linear_residual.reference(mlp.reference(x, self.w1, self.b1), self.w2, self.b2, x)


# -- registration -------------------------------------------------------------------------------

def test_each_kernel_is_an_op_in_the_wsched_namespace_with_the_fusions_signature():
    k = kernel(mlp)
    assert isinstance(k.op, torch._ops.OpOverload)
    assert k.op.name().startswith("wsched::mlp_")
    assert k.op is getattr(torch.ops.wsched, torch_ops.op_name(k)).default
    assert str(k.op._schema) == f"wsched::{torch_ops.op_name(k)}(Tensor a, Tensor b, Tensor bias) -> Tensor"
    assert str(kernel(two_outputs).op._schema).endswith("(Tensor a, Tensor b, Tensor bias) -> (Tensor, Tensor)")
    assert str(kernel(attention_lse).op._schema).endswith("(Tensor q, Tensor k, Tensor v) -> (Tensor, Tensor)")


def test_two_schedules_of_one_fusion_are_two_ops_and_registering_again_reuses_the_op():
    default, two_stages = kernel(mlp), kernel(mlp, stages=2)
    assert default.op != two_stages.op
    assert ws.compile(mlp, build=False).op is default.op
    assert torch_ops.register(default) is default.op


# -- the fake implementation --------------------------------------------------------------------

@pytest.mark.parametrize("fusion, shapes, expected", [
    (matmul, [(200, 72), (72, 136)], [((200, 136), torch.bfloat16)]),
    (two_outputs, [(200, 72), (72, 136), (136,)], [((200, 136), torch.bfloat16), ((200, 136), torch.float32)]),
    (attention_lse, [(2, 3, 130, 128), (2, 3, 70, 128), (2, 3, 70, 128)],
     [((2, 3, 130, 128), torch.bfloat16), ((2, 3, 130), torch.float32)]),
    (varlen, [(300, 2, 64), (250, 2, 64), (250, 2, 64), (4,), (4,)],   # packed rows of 3 sequences
     [((300, 2, 64), torch.bfloat16), ((300, 2), torch.float32)]),
], ids=["matmul", "two_outputs", "attention_lse", "varlen"])
def test_fake_implementation_gives_the_outputs_shapes_and_dtypes(fusion, shapes, expected):
    k = kernel(fusion)
    with FakeTensorMode():
        tensors = [torch.empty(s, dtype=node.dtype.torch_dtype) for s, node in zip(shapes, fusion.inputs)]
        for call in (k.op, k):   # k(...) on fake tensors dispatches to the op
            outs = call(*tensors)
            outs = outs if isinstance(outs, tuple) else (outs,)
            assert [(tuple(o.shape), o.dtype) for o in outs] == expected
            assert all(isinstance(o, torch._subclasses.FakeTensor) for o in outs)


def test_fake_implementation_rejects_inputs_that_do_not_bind_naming_the_symbol():
    k = kernel(matmul)
    with FakeTensorMode(), pytest.raises(ws.FusionError, match="symbol K is bound to two sizes"):
        k.op(torch.empty(64, 32, dtype=torch.bfloat16), torch.empty(48, 64, dtype=torch.bfloat16))


def test_out_is_refused_while_torch_traces_the_call():
    k = kernel(matmul)
    with FakeTensorMode(), pytest.raises(ws.ArgumentError, match="out= is not supported while torch traces"):
        a, b = torch.empty(64, 64, dtype=torch.bfloat16), torch.empty(64, 64, dtype=torch.bfloat16)
        k(a, b, out={"out": torch.empty(64, 64, dtype=torch.bfloat16)})


def test_an_eager_call_on_cpu_tensors_still_says_there_is_no_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    with pytest.raises(NoGPUError, match="simulate"):
        kernel(matmul)(*inputs_for(matmul, 64, 64, 64))


# -- torch.library.opcheck (schema, fake tensors, autograd registration, dynamic shapes) ----------

@pytest.mark.parametrize("fusion, args", [
    (matmul, lambda: inputs_for(matmul, 200, 136, 72)),
    (two_outputs, lambda: inputs_for(two_outputs, 200, 136, 72)),
    (attention_lse, lambda: attention_inputs(1, 2, 130, 130, 128)),
    (varlen, lambda: varlen_inputs([130, 0, 70], [100, 5, 70], 2, 64)),
], ids=["matmul", "two_outputs", "attention_lse", "varlen"])
def test_opcheck(fusion, args):
    result = torch.library.opcheck(kernel(fusion).op, tuple(args()))
    assert set(result.values()) == {"SUCCESS"}, result


def test_the_op_on_cpu_tensors_runs_the_simulator():
    k = kernel(two_outputs)
    tensors = inputs_for(two_outputs, 200, 136, 72)
    for got, want in zip(k.op(*tensors), k.simulate(*tensors)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


# -- tracing: torch.compile(fullgraph=True), torch.export -----------------------------------------

def test_torch_compile_fullgraph_traces_a_block_of_two_kernels_without_graph_breaks():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    block = Block()
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    for rows in (100, 136):   # a second shape: recompiled with a dynamic M
        x = torch.randn(rows, 64).bfloat16()
        got = compiled(x)
        torch.testing.assert_close(got, block.reference(x), rtol=2e-2, atol=2e-2)
    assert not counters["graph_break"]


def test_torch_export_records_one_call_of_each_op():
    block = Block()
    x = torch.randn(100, 64).bfloat16()
    exported = torch.export.export(block, (x,))
    targets = [node.target for node in exported.graph.nodes if node.op == "call_function"]
    assert targets == [block.up.op, block.down.op]
    torch.testing.assert_close(exported.module()(x), block.reference(x), rtol=2e-2, atol=2e-2)
