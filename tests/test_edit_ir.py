"""Edited IR back to a runnable kernel (`CompiledKernel.with_ir`), dumps that parse back, and the
simulator holding CPU tensors to the GPU's TMA layout rules."""

import re

import pytest
import torch

import wsched as ws
from wsched.lowering.parser import IRParseError
from wsched.lowering.verify import VerifyError

from fusions import inputs_for, mlp


def rel(out, ref):
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def test_an_edited_kernel_runs_and_the_original_is_untouched():
    k = ws.compile(mlp, build=False)
    original = k.ir
    edited = k.with_ir(k.ir.replace("tile.gelu", "tile.relu"), build=False)
    assert k.ir == original and "tile.relu" in edited.ir and "tile.gelu" not in edited.ir
    assert "relu" in edited.cuda_source and edited.cuda_source != k.cuda_source
    a, b, bias = inputs_for(mlp, 150, 200, 136, seed=3)
    got = edited.simulate(a, b, bias, num_sms=3)
    assert not torch.isnan(got.float()).any()
    assert rel(got, torch.relu(a.float() @ b.float() + bias.float())) < 1e-2


def test_a_cache_or_print_dump_is_accepted_as_is():
    k = ws.compile(mlp, build=False)
    dump = "# ----- IR after reg_realloc -----\n" + k.ir
    assert k.with_ir(dump, build=False).kernel == k.kernel


def test_a_parse_error_names_line_and_column():
    k = ws.compile(mlp, build=False)
    text = k.ir.replace("wgmma.commit", "wgmma.comit", 1)
    line = text[:text.index("wgmma.comit")].count("\n") + 1
    with pytest.raises(IRParseError, match=rf"line {line}, column \d+"):
        k.with_ir(text, build=False)


def test_a_protocol_edit_is_rejected_by_the_verifier_with_its_ir_line():
    k = ws.compile(mlp, build=False)
    text = re.sub(r"\n\s*mbarrier\.wait full\[s\] phase\(ph\)", "", k.ir, count=1)
    with pytest.raises(VerifyError, match=r"IR line \d+"):
        k.with_ir(text, build=False)


def test_the_parameters_must_stay():
    k = ws.compile(mlp, build=False)
    with pytest.raises(ws.ScheduleError, match=r"the edited kernel's parameters .* differ from .*keep the parameter list"):
        k.with_ir(k.ir.replace("global bias:", "global bias2:").replace("bias[", "bias2["), build=False)


def test_the_simulator_stages_rows_the_gpu_cannot_load_as_the_gpu_call_does():
    """a's rows are 120 bytes (not a multiple of 16): the simulator reads an aligned copy, as a
    GPU call does (CompiledKernel._run_staged), so what simulates runs on the GPU as it is."""
    k = ws.compile(mlp, build=False)
    a, b, bias = inputs_for(mlp, 64, 64, 60)
    out = k.simulate(a, b, bias)
    assert float((out.float() - mlp.reference(a, b, bias).float()).norm() / out.float().norm()) < 1e-2


@pytest.mark.gpu
def test_an_edited_kernel_runs_on_the_gpu():
    k = ws.compile(mlp)
    edited = k.with_ir(k.ir.replace("tile.gelu", "tile.relu"))
    a, b, bias = (t.cuda() for t in inputs_for(mlp, 300, 264, 200, seed=4))
    out = torch.full((300, 264), float("nan"), device="cuda", dtype=torch.bfloat16)
    got = edited(a, b, bias, out={"out": out})
    torch.cuda.synchronize()
    assert not torch.isnan(got.float()).any()
    assert rel(got, torch.relu(a.float() @ b.float() + bias.float())) < 1e-2
    assert rel(k(a, b, bias), torch.nn.functional.gelu(a.float() @ b.float() + bias.float())) < 1e-2
