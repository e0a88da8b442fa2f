"""The command line (`wsched` / `python -m wsched`): each command's output, and every mistake
reported as one line on stderr with exit code 2, never a traceback."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import wsched as ws
from wsched import cli, inputs

from fusions import mlp

TESTS = Path(__file__).parent
MLP = f"{TESTS / 'fusions.py'}:mlp"
ATTENTION = f"{TESTS.parent / 'examples' / 'fmha.py'}:attention"
COMMANDS = ("ir", "cuda", "simulate", "run", "tune", "bench", "trace")


def run_cli(capsys, *argv):
    """(exit code, stdout, stderr) of `wsched argv...`, run in this process."""
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_python_m_wsched_help_lists_every_command():
    done = subprocess.run([sys.executable, "-m", "wsched", "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for command in COMMANDS:
        assert f"    {command} " in done.stdout


@pytest.mark.parametrize("command", COMMANDS)
def test_each_command_has_help(capsys, command):
    code, out, _ = run_cli(capsys, command, "--help")
    assert code == 0
    assert out.startswith(f"usage: wsched {command} ")
    assert "--traceback" in out


def test_ir_prints_the_final_ir_and_the_ir_after_a_pass(capsys):
    kernel = ws.lower(mlp)
    code, out, err = run_cli(capsys, "ir", MLP)
    assert (code, err) == (0, "")
    assert out == f"{kernel}\n"
    code, out, _ = run_cli(capsys, "ir", MLP, "--pass", "insert_barriers")
    assert code == 0 and out == f"{kernel.ir_after['insert_barriers']}\n"


def test_ir_takes_schedule_overrides(capsys):
    code, out, _ = run_cli(capsys, "ir", MLP, "--set", "stages=2", "--set", "tile=128x128x64",
                           "--set", "epilogue=direct")
    assert code == 0
    assert out == f"{ws.lower(mlp, stages=2, tile=(128, 128, 64), epilogue='direct')}\n"


def test_ir_partition(capsys):
    code, out, _ = run_cli(capsys, "ir", MLP, "--partition")
    assert code == 0 and out == f"{ws.partition(mlp, ws.schedule_for(mlp))}\n"


def test_cuda_prints_or_writes_the_source(capsys, tmp_path):
    source = ws.compile(mlp, build=False).cuda_source
    code, out, _ = run_cli(capsys, "cuda", MLP)
    assert code == 0 and out == source
    code, out, err = run_cli(capsys, "cuda", MLP, "-o", tmp_path / "mlp.cu")
    assert code == 0 and out == "" and "wrote" in err
    assert (tmp_path / "mlp.cu").read_text() == source


def test_simulate_matmul_compares_with_the_reference(capsys):
    code, out, err = run_cli(capsys, "simulate", MLP, "M=96", "N=80", "K=72")
    assert (code, err) == (0, "")
    assert out.startswith("mlp M=96 N=80 K=72  schedule 128x256x64")
    assert "out bf16[96, 80]: relative error vs reference" in out and out.rstrip().endswith("ok")


def test_simulate_attention_reports_every_output(capsys):
    code, out, _ = run_cli(capsys, "simulate", ATTENTION, "B=1", "H=1", "S=64", "T=64")
    assert code == 0
    assert "o bf16[1, 1, 64, 128]: relative error" in out and "lse f32[1, 1, 64]: relative error" in out


def test_simulate_exits_1_on_a_mismatch(capsys, monkeypatch):
    monkeypatch.setattr(cli, "rel_error", lambda out, ref: 0.5)
    code, out, _ = run_cli(capsys, "simulate", MLP, "M=64", "N=64", "K=64")
    assert code == cli.EXIT_MISMATCH and "MISMATCH" in out


def test_inputs_are_scaled_like_the_tests():
    sizes = {"M": 64, "N": 32, "K": 256}
    assert inputs.input_scales(mlp, sizes) == {"a": 1 / math.sqrt(256)}
    attention = cli.load_fusion(ATTENTION)
    assert inputs.input_scales(attention, {"B": 1, "H": 1, "S": 8, "T": 8}) == {}   # it scales itself
    a, b, bias = inputs.random_inputs(mlp, sizes, "cpu")
    assert (a.shape, b.shape, bias.shape, a.dtype) == ((64, 256), (256, 32), (32,), torch.bfloat16)


BAD_FUSION = """
import wsched as ws

@ws.fusion
def bad(a: ws.Tensor[ws.bf16, "M", "K"], b: ws.Tensor[ws.bf16, "N", "K"]):
    return ws.matmul(a, b)
"""


@pytest.mark.parametrize("argv, expected", [
    (["ir", "no/such/file.py:mlp"], "no such file: no/such/file.py"),
    (["ir", f"{TESTS / 'fusions.py'}:nope"], "has no fusion named 'nope'; it defines: matmul, mlp"),
    (["ir", f"{TESTS / 'fusions.py'}:inputs_for"], "inputs_for in "),
    (["ir", TESTS / "fusions.py"], "defines 6 fusions"),
    (["ir", "{bad_file}:bad"], "matmul: "),
    (["ir", "{broken_file}:x"], "failed: SyntaxError"),
    (["ir", MLP, "--pass", "nope"], "no pass 'nope' on the route of mlp; its passes: build_loops"),
    (["ir", MLP, "--set", "stages"], "bad --set 'stages'"),
    (["ir", MLP, "--set", "bogus=1"], "unknown schedule field(s) ['bogus']"),
    (["ir", MLP, "--set", "stages=9"], "exceeds the 232448-byte limit"),
    (["ir", MLP, "--set", "tile=128x100x64"], "BN=100"),
    (["ir", MLP, "--bogus"], "unrecognized arguments: --bogus (see wsched ir --help)"),
    (["tune", MLP, "M=1", "N=1", "K=1", "--set", "stages=2"], "unrecognized arguments: --set stages=2"),
    (["tune", MLP, "--max-candidates", "0"], "argument --max-candidates: invalid positive int value: '0'"),
    (["ir"], "the following arguments are required: FILE.py:FUSION"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    (["simulate", MLP, "M=x"], "bad size 'M=x': expected NAME=INTEGER"),
    (["simulate", MLP, "M=1", "N=1", "K=1", "Q=4"], "mlp has no dim 'Q'; its dims are M, K, N"),
    (["simulate", MLP, "M=64"], "mlp needs a size for K, N"),
    (["simulate", MLP, "M=0", "N=1", "K=1"], "size M=0 must be at least 1"),
    (["simulate", MLP, "M=1", "M=2"], "size M is given twice"),
])
def test_mistakes_are_one_line_with_exit_code_2(capsys, tmp_path, argv, expected):
    (tmp_path / "bad.py").write_text(BAD_FUSION)
    (tmp_path / "broken.py").write_text("def x(:\n")
    argv = [str(a).format(bad_file=tmp_path / "bad.py", broken_file=tmp_path / "broken.py") for a in argv]
    code, out, err = run_cli(capsys, *argv)
    assert code == cli.EXIT_ERROR
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("wsched") and ": error: " in err, err
    assert expected in err
    assert "Traceback" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
@pytest.mark.parametrize("command", ["run", "bench", "tune"])
def test_gpu_commands_without_a_gpu(capsys, command):
    code, out, err = run_cli(capsys, command, MLP, "M=64", "N=64", "K=64")
    assert code == cli.EXIT_ERROR and out == ""
    assert err == (f"wsched {command}: error: `wsched {command}` needs an NVIDIA Hopper GPU (sm_90a) and torch "
                   f"sees no CUDA device; `wsched simulate` runs the kernel on the CPU\n")


@pytest.mark.parametrize("command, module", [("tune", "autotune"), ("trace", "timeline")])
def test_missing_optional_module_is_one_line(capsys, monkeypatch, command, module):
    monkeypatch.setitem(sys.modules, f"wsched.{module}", None)   # import fails as if it were absent
    code, _, err = run_cli(capsys, command, MLP, "M=64", "N=64", "K=64")
    assert code == cli.EXIT_ERROR
    assert err == f"wsched {command}: error: `wsched {command}` needs wsched.{module}, which this install does not have\n"


def test_ir_and_verifier_errors_are_one_line(capsys, monkeypatch):
    from wsched.lowering.parser import IRParseError, parse_kernel

    with pytest.raises(IRParseError) as parse_error:
        parse_kernel("kernel k( {\n}\n")
    assert "\n" not in cli._one_line(parse_error.value)

    def broken_lower(*args, **kwargs):
        raise parse_error.value

    monkeypatch.setattr(ws, "lower", broken_lower)
    code, _, err = run_cli(capsys, "ir", MLP)
    assert code == cli.EXIT_ERROR and err.count("\n") == 1 and "line 1, column" in err


def test_traceback_flag_shows_the_exception(capsys):
    with pytest.raises(cli.CLIError, match="no such file"):
        cli.main(["ir", "no/such/file.py:mlp", "--traceback"])


def test_tune_calls_the_autotuner_and_prints_the_winner(capsys, monkeypatch):
    from wsched import autotune

    default = ws.schedule_for(mlp)
    best = ws.schedule_for(mlp, stages=2, tile=(128, 128, 64))
    calls = []

    def fake_tune(fusion, sizes, **options):
        calls.append((fusion.name, sizes, options))
        return autotune.TuneResult(best, {best: 0.5, default: 0.75}, from_cache=False, path=Path("entry.json"),
                                   seconds=3.0, default=default)

    monkeypatch.setattr(cli, "require_gpu", lambda command, on_cpu="": None)
    monkeypatch.setattr(autotune, "tune", fake_tune)
    code, out, _ = run_cli(capsys, "tune", MLP, "M=4096", "N=4096", "K=4096", "--max-candidates", "20",
                           "--no-progress")
    assert code == 0
    assert calls == [("mlp", {"M": 4096, "N": 4096, "K": 4096},
                      dict(max_candidates=20, iters=50, warmup=10, progress=False, workers=None, force=False))]
    lines = out.splitlines()
    assert lines[0] == "mlp M=4096 N=4096 K=4096: searched 2 candidates in 3 s, 0 rejected; cached in entry.json"
    assert lines[1].split() == ["500.0", "us", *best.short().split()]
    assert lines[2].endswith("(default)")
    assert lines[3] == "best is 1.50x the default schedule"
    assert lines[4] == f"use it: wsched run {MLP} M=4096 N=4096 K=4096 --set tile=128x128x64 --set stages=2"


@pytest.mark.parametrize("fields", [dict(stages=2, tile=(128, 128, 64)), dict(tile=(128, 128, 64)),
                                    dict(stages=3, tile=(128, 128, 64), mma_inflight=0, raster="column"),
                                    dict(epilogue="direct")])
def test_schedule_flags_rebuild_the_schedule(fields):
    schedule = ws.schedule_for(mlp, **fields)
    flags = cli.schedule_flags(mlp, schedule).split()
    assert ws.schedule_for(mlp, **cli.parse_overrides(flags[1::2])) == schedule
    assert cli.schedule_flags(mlp, ws.schedule_for(mlp)) == ""


def test_trace_writes_the_simulated_timeline(capsys, tmp_path):
    import json

    code, out, err = run_cli(capsys, "trace", MLP, "M=128", "N=256", "K=128", "-o", tmp_path / "mlp.json", "--no-png")
    assert (code, err) == (0, "")
    assert out.startswith("mlp: ") and "from the CPU simulator" in out and f"wrote {tmp_path / 'mlp.json'};" in out
    assert json.loads((tmp_path / "mlp.json").read_text())["traceEvents"]
    assert not (tmp_path / "mlp.png").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_trace_on_the_gpu_without_a_gpu(capsys, tmp_path):
    code, _, err = run_cli(capsys, "trace", MLP, "M=64", "N=64", "K=64", "--gpu", "-o", tmp_path / "t.json")
    assert code == cli.EXIT_ERROR and err.count("\n") == 1
    assert "without --gpu, `wsched trace` draws the timeline from the CPU simulator" in err
