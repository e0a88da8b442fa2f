"""The command line: `wsched <command> path/to/file.py:fusion [NAME=SIZE ...] [options]`.

    wsched ir examples/persistent_matmul.py:mlp --pass insert_barriers
    wsched cuda examples/persistent_matmul.py:mlp --set stages=4 -o mlp.cu --build
    wsched simulate examples/fmha.py:attention B=1 H=2 S=200 T=200
    wsched run examples/persistent_matmul.py:mlp M=4096 N=4096 K=4096 --set tile=128x128x64
    wsched bench examples/persistent_matmul.py:mlp M=4096 N=4096 K=4096
    wsched tune examples/persistent_matmul.py:mlp M=4096 N=4096 K=4096
    wsched trace examples/persistent_matmul.py:mlp M=256 N=256 K=128 -o mlp.json   # and mlp.png

The target file is imported as a module (not as __main__, so its own `main()` does not run);
`:name` picks a fusion in it and may be left out when it defines one. Sizes bind every symbolic
dim of the fusion's inputs; `--set field=value` overrides a field of the default schedule
(`tile=128x128x64` is a tuple). Inputs are random normal, made on the device the command runs
on. A mistake (a bad path, a fusion or schedule error, no GPU) is one line on stderr and exit
code 2; `--traceback` shows the traceback instead. `simulate` and `run` exit 1 when an output is
further from `fusion.reference` than `--tol`.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import math
import re
import sys
import time
from pathlib import Path

from .inputs import random_inputs
from .timing import rel_error

COMMANDS = ("ir", "cuda", "simulate", "run", "tune", "bench", "trace")
EXIT_MISMATCH = 1   # an output is further from the reference than --tol
EXIT_ERROR = 2      # a user error, reported in one line (argparse uses 2 as well)



class CLIError(Exception):
    """A mistake on the command line, reported as one line on stderr (exit code 2)."""


# ---------------------------------------------------------------------------------------------
# Reading the command line: the target, the sizes, the schedule overrides
# ---------------------------------------------------------------------------------------------

def load_fusion(target: str):
    """The fusion `path/to/file.py:name` names (`path/to/file.py` alone: the only one it defines)."""
    import wsched as ws

    path_text, _, name = target.rpartition(":") if ":" in target else (target, "", "")
    path = Path(path_text)
    if not path.is_file():
        hint = "" if path.suffix == ".py" else " (expected path/to/file.py:fusion_name)"
        raise CLIError(f"no such file: {path_text}{hint}")
    module_name = "_wsched_cli_" + re.sub(r"\W", "_", path.stem)
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise CLIError(f"cannot import {path_text}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module   # what dataclasses and pickle look a module up by
    sys.path.insert(0, str(path.resolve().parent))   # for imports of the file's neighbours
    try:
        spec.loader.exec_module(module)
    except ws.FusionError:
        raise
    except Exception as error:   # noqa: BLE001 (any failure of the user's file is reported as such)
        raise CLIError(f"importing {path_text} failed: {type(error).__name__}: {_one_line(error)}") from error
    finally:
        sys.path.remove(str(path.resolve().parent))
    fusions = {key: value for key, value in vars(module).items() if isinstance(value, ws.Fusion)}
    if not name:
        if len(fusions) != 1:
            found = ", ".join(fusions) or "none"
            raise CLIError(f"{path_text} defines {len(fusions)} fusions ({found}); name one as {path_text}:NAME")
        return next(iter(fusions.values()))
    if name not in vars(module):
        raise CLIError(f"{path_text} has no fusion named {name!r}; it defines: {', '.join(fusions) or 'none'}")
    value = getattr(module, name)
    if not isinstance(value, ws.Fusion):
        raise CLIError(f"{name} in {path_text} is a {type(value).__name__}, not a fusion (decorate it with @ws.fusion)")
    return value


def parse_sizes(fusion, items: list[str]) -> dict[str, int]:
    """`["M=256", "N=128", ...]` -> {"M": 256, ...}: one positive int per symbolic dim of the fusion."""
    dims = fusion.symbols
    sizes: dict[str, int] = {}
    for item in items:
        name, eq, value = item.partition("=")
        if not eq or not re.fullmatch(r"[0-9][0-9_]*", value.strip()):
            raise CLIError(f"bad size {item!r}: expected NAME=INTEGER, e.g. {dims[0] if dims else 'M'}=256")
        name = name.strip()
        if name not in dims:
            raise CLIError(f"{fusion.name} has no dim {name!r}; its dims are {', '.join(dims) or 'none'}")
        if name in sizes:
            raise CLIError(f"size {name} is given twice")
        sizes[name] = int(value)
        if sizes[name] < 1:
            raise CLIError(f"size {name}={sizes[name]} must be at least 1")
    missing = [d for d in dims if d not in sizes]
    if missing:
        example = " ".join(f"{d}={sizes.get(d, 256)}" for d in dims)
        raise CLIError(f"{fusion.name} needs a size for {', '.join(missing)} (its dims: {', '.join(dims)}); "
                       f"e.g. {example}")
    return sizes


def parse_overrides(items: list[str]) -> dict[str, object]:
    """`--set` values: `stages=4` -> 4, `tile=128x128x64` -> (128, 128, 64), `epilogue=direct` -> "direct".
    Field names and values are checked by the schedule (ScheduleError)."""
    overrides: dict[str, object] = {}
    for item in items:
        name, eq, value = item.partition("=")
        name, value = name.strip(), value.strip()
        if not eq or not name.isidentifier() or not value:
            raise CLIError(f"bad --set {item!r}: expected FIELD=VALUE, e.g. stages=4 or tile=128x128x64")
        if re.fullmatch(r"-?\d+", value):
            overrides[name] = int(value)
        elif re.fullmatch(r"\d+(x\d+)+", value):
            overrides[name] = tuple(int(v) for v in value.split("x"))
        else:
            overrides[name] = value
    return overrides


# ---------------------------------------------------------------------------------------------
# Inputs, checks against the reference, FLOPs
# ---------------------------------------------------------------------------------------------

def _resolve(shape, sizes: dict[str, int]) -> list[int]:
    from .inputs import _resolve as resolve

    return resolve(shape, sizes)


def report_errors(kernel, outputs, reference, tol: float) -> bool:
    """Print each output's relative error against the reference; True when all are within tol."""
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    reference = reference if isinstance(reference, tuple) else (reference,)
    ok = True
    for name, node, out, ref in zip(kernel.partition.output_names, kernel.partition.outputs, outputs, reference):
        err = rel_error(out, ref)
        good = err <= tol   # NaN fails
        ok &= good
        print(f"  {name} {node.dtype.name}{list(out.shape)}: relative error vs reference {err:.2e}"
              f"  {'ok' if good else f'MISMATCH (tol {tol:.0e})'}")
    return ok


def matmul_flops(fusion, sizes: dict[str, int]) -> tuple[float, bool]:
    """2 x M x N x K summed over the matmuls, halved under a causal mask (the usual attention
    convention); and whether it was halved."""
    flops = 0.0
    for node in fusion.nodes():
        if node.op == "matmul":
            flops += 2 * math.prod(_resolve(node.shape, sizes)) * _resolve(fusion.node(node.inputs[0]).shape, sizes)[-1]
    causal = any(node.op == "causal_mask" for node in fusion.nodes())
    return (flops / 2 if causal else flops), causal


def resources_text(resources) -> str:
    return (f"{resources.registers} registers, {resources.spill_stores + resources.spill_loads} spill bytes, "
            f"{resources.barriers} barriers")


def describe_call(fusion, sizes: dict[str, int], kernel) -> str:
    shape = " ".join(f"{d}={v}" for d, v in sizes.items())
    return f"{fusion.name} {shape}  schedule {kernel.schedule.short()}"


def require_gpu(command: str, on_cpu: str = "`wsched simulate` runs the kernel on the CPU") -> None:
    """CLIError unless torch sees a Hopper GPU; `on_cpu` says what to do without one."""
    import torch

    if not torch.cuda.is_available():
        raise CLIError(f"`wsched {command}` needs an NVIDIA Hopper GPU (sm_90a) and torch sees no CUDA device; "
                       f"{on_cpu}")
    major, minor = torch.cuda.get_device_capability()
    if major != 9:
        raise CLIError(f"`wsched {command}` needs a Hopper GPU (sm_90a); this one is "
                       f"{torch.cuda.get_device_name()} (sm_{major}{minor})")


def optional_module(name: str, command: str):
    """Import `wsched.<name>` for a command, or a CLIError saying it (or what it needs) is missing."""
    try:
        return importlib.import_module(f"wsched.{name}")
    except ModuleNotFoundError as error:
        if error.name in (f"wsched.{name}", "wsched"):
            raise CLIError(f"`wsched {command}` needs wsched.{name}, which this install does not have") from error
        raise CLIError(f"`wsched {command}` needs the package {error.name!r}: pip install {error.name}") from error


# ---------------------------------------------------------------------------------------------
# The commands
# ---------------------------------------------------------------------------------------------

def cmd_ir(args) -> int:
    import wsched as ws

    fusion = load_fusion(args.target)
    schedule = ws.schedule_for(fusion, **parse_overrides(args.set))
    if args.partition:
        print(ws.partition(fusion, schedule))
        return 0
    kernel = ws.lower(fusion, schedule)
    if args.pass_name is None:
        print(kernel)
        return 0
    if args.pass_name not in kernel.ir_after:
        raise CLIError(f"no pass {args.pass_name!r} on the route of {fusion.name}; its passes: "
                       f"{', '.join(kernel.ir_after)}")
    print(kernel.ir_after[args.pass_name])
    return 0


def cmd_cuda(args) -> int:
    import wsched as ws

    kernel = ws.compile(load_fusion(args.target), build=False, **parse_overrides(args.set))
    if args.output:
        Path(args.output).write_text(kernel.cuda_source)
        print(f"wrote {args.output} ({len(kernel.cuda_source.splitlines())} lines)", file=sys.stderr)
    else:
        sys.stdout.write(kernel.cuda_source)
    if args.build:
        build = kernel.compile_cuda()
        print(f"nvcc: {build.cu_path}  {resources_text(kernel.resources)}  (cache {'hit' if build.cache_hit else 'miss'}, "
              f"{kernel.timings['build']:.1f} s)", file=sys.stderr)
    return 0


def cmd_simulate(args) -> int:
    import wsched as ws

    fusion = load_fusion(args.target)
    sizes = parse_sizes(fusion, args.sizes)
    kernel = ws.compile(fusion, build=False, **parse_overrides(args.set))
    inputs = random_inputs(fusion, sizes, "cpu", args.seed)
    print(describe_call(fusion, sizes, kernel))
    t0 = time.perf_counter()
    outputs = kernel.simulate(*inputs, seed=args.seed, num_sms=args.num_sms)
    print(f"simulated in {time.perf_counter() - t0:.2f} s (seed {args.seed}, {args.num_sms} SMs)")
    return 0 if report_errors(kernel, outputs, fusion.reference(*inputs), args.tol) else EXIT_MISMATCH


def _compile_for_gpu(args, command: str):
    """(fusion, sizes, built kernel, inputs on the GPU) for run and bench."""
    import wsched as ws

    fusion = load_fusion(args.target)
    sizes = parse_sizes(fusion, args.sizes)
    overrides = parse_overrides(args.set)
    require_gpu(command)
    kernel = ws.compile(fusion, build=True, **overrides)
    return fusion, sizes, kernel, random_inputs(fusion, sizes, "cuda", args.seed)


def cmd_run(args) -> int:
    import torch

    fusion, sizes, kernel, inputs = _compile_for_gpu(args, "run")
    print(describe_call(fusion, sizes, kernel))
    print(f"ptxas: {resources_text(kernel.resources)}")
    outputs = kernel(*inputs)
    torch.cuda.synchronize()
    return 0 if report_errors(kernel, outputs, fusion.reference(*inputs), args.tol) else EXIT_MISMATCH


def cmd_bench(args) -> int:
    fusion, sizes, kernel, inputs = _compile_for_gpu(args, "bench")
    print(describe_call(fusion, sizes, kernel))
    from .timing import median_ms

    ms = median_ms(lambda: kernel(*inputs), warmup=args.warmup, iters=args.iters)
    flops, causal = matmul_flops(fusion, sizes)
    rate = f"  {flops / ms / 1e9:.0f} TFLOP/s{' (causal: half the dense FLOPs)' if causal else ''}" if flops else ""
    print(f"median {ms * 1e3:.1f} us over {args.iters} runs{rate}")
    return 0


def cmd_tune(args) -> int:
    fusion = load_fusion(args.target)
    sizes = parse_sizes(fusion, args.sizes)
    autotune = optional_module("autotune", "tune")
    require_gpu("tune")
    result = autotune.tune(fusion, sizes, max_candidates=args.max_candidates, iters=args.iters,
                           warmup=args.warmup, progress=not args.no_progress, workers=args.workers,
                           force=args.force)
    shape = " ".join(f"{d}={v}" for d, v in sizes.items())
    where = (f"from the tune cache {result.path}" if result.from_cache else
             f"searched {len(result.times) + len(result.rejected)} candidates in {result.seconds:.0f} s, "
             f"{len(result.rejected)} rejected; cached in {result.path}")
    print(f"{fusion.name} {shape}: {where}")
    ranked = sorted(result.times.items(), key=lambda item: item[1])
    for schedule, ms in ranked[:args.top]:
        mark = "  (default)" if schedule == result.default else ""
        print(f"  {ms * 1e3:9.1f} us  {schedule.short()}{mark}")
    best = result.times.get(result.schedule)
    if best and result.default_ms:
        print(f"best is {result.default_ms / best:.2f}x the default schedule")
    flags = schedule_flags(fusion, result.schedule)
    print(f"use it: wsched run {args.target} {shape}{' ' + flags if flags else ''}")
    return 0


def schedule_flags(fusion, schedule) -> str:
    """The `--set` flags, added field by field in field order, with which `ws.schedule_for(fusion, ...)` gives
    `schedule`: the default derives some fields from others (stages from the tile), so a field
    joins the flags until the rebuilt schedule is the same."""
    from dataclasses import fields

    import wsched as ws

    names = [f.name for f in fields(schedule)]
    overrides: dict[str, object] = {}
    for _ in range(len(names) + 1):
        try:
            rebuilt = ws.schedule_for(fusion, **overrides)
        except ws.ScheduleError:
            rebuilt = None
        if rebuilt == schedule:
            break
        differing = [name for name in names if name not in overrides
                     and (rebuilt is None or getattr(rebuilt, name) != getattr(schedule, name))]
        if not differing:
            break
        overrides[differing[0]] = getattr(schedule, differing[0])

    def spelt(value):
        return "x".join(map(str, value)) if isinstance(value, tuple) else str(value)

    return " ".join(f"--set {name}={spelt(overrides[name])}" for name in names if name in overrides)


def cmd_trace(args) -> int:
    fusion = load_fusion(args.target)
    sizes = parse_sizes(fusion, args.sizes)
    overrides = parse_overrides(args.set)
    timeline = optional_module("timeline", "trace")
    path = Path(args.output or f"{fusion.name}.trace.json")
    png = False if args.no_png else (Path(args.png) if args.png else path.with_suffix(".png"))
    try:
        if args.gpu:
            require_gpu("trace --gpu", "without --gpu, `wsched trace` draws the timeline from the CPU simulator")
            trace = timeline.trace_gpu(fusion, sizes, path, inputs=random_inputs(fusion, sizes, "cuda", args.seed),
                                       png=png, ctas=args.ctas, **overrides)
        else:
            trace = timeline.trace_simulated(fusion, sizes, path, inputs=random_inputs(fusion, sizes, "cpu", args.seed),
                                             num_sms=args.num_sms, seed=args.seed, png=png, ctas=args.ctas,
                                             **overrides)
    except ModuleNotFoundError as error:   # matplotlib, for the PNG
        raise CLIError(f"{error} (--no-png writes the JSON alone)") from error
    source = "the GPU" if args.gpu else f"the CPU simulator (clock: scheduler steps, {args.num_sms} SMs)"
    print(f"{fusion.name}: {len(trace.events)} events of {len(trace.ctas)} CTAs from {source}")
    print(f"wrote {path}{f' and {png}' if png else ''}; open the JSON in https://ui.perfetto.dev")
    return 0


# ---------------------------------------------------------------------------------------------
# The parser, error reporting, main
# ---------------------------------------------------------------------------------------------

def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


positive_int.__name__ = "positive int"   # how argparse names the type in its error


class _Parser(argparse.ArgumentParser):
    """argparse, with its usage errors reported as one line (exit code 2) like every other error."""

    def error(self, message):
        raise CLIError(f"{message} (see {self.prog} --help)")


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--traceback", action="store_true", help="show the traceback of an error")
    target = argparse.ArgumentParser(add_help=False)
    target.add_argument("target", metavar="FILE.py:FUSION",
                        help="the fusion: a Python file and the name of a @ws.fusion in it")
    scheduled = argparse.ArgumentParser(add_help=False)
    scheduled.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                           help="override a field of the default schedule (stages=4, tile=128x128x64, "
                                "epilogue=direct); repeatable")
    sized = argparse.ArgumentParser(add_help=False)
    sized.add_argument("sizes", nargs="*", metavar="DIM=SIZE", help="a size for every symbolic dim (M=4096 ...)")
    seeded = argparse.ArgumentParser(add_help=False)
    seeded.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    checked = argparse.ArgumentParser(add_help=False)
    checked.add_argument("--tol", type=float, default=1e-2,
                         help="largest relative error vs fusion.reference that passes (default 1e-2)")

    parser = _Parser(prog="wsched", parents=[common], description=__doc__,
                     epilog="`wsched COMMAND --help` for each command's options",
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    def command(name, handler, help_text, parents):
        sub = commands.add_parser(name, help=help_text, description=help_text, parents=[common, *parents])
        sub.set_defaults(handler=handler)
        return sub

    ir = command("ir", cmd_ir, "print the final loop IR (or the IR after one pass)", [target, scheduled])
    ir.add_argument("--pass", dest="pass_name", metavar="PASS", help="print the IR after this pass (e.g. insert_barriers)")
    ir.add_argument("--partition", action="store_true", help="print the load/compute partition instead")
    cuda = command("cuda", cmd_cuda, "print the generated CUDA source", [target, scheduled])
    cuda.add_argument("-o", "--output", metavar="FILE.cu", help="write the source to FILE.cu instead of stdout")
    cuda.add_argument("--build", action="store_true", help="also build it with nvcc and report ptxas resources")
    sim = command("simulate", cmd_simulate, "run the kernel in the CPU simulator and compare it with the reference",
                  [target, scheduled, sized, seeded, checked])
    sim.add_argument("--num-sms", type=positive_int, default=4, help="CTAs resident at a time (default 4)")
    command("run", cmd_run, "build, run on the GPU and compare with the reference (needs a Hopper GPU)",
            [target, scheduled, sized, seeded, checked])
    bench = command("bench", cmd_bench, "time the kernel on the GPU with CUDA events (needs a Hopper GPU)",
                    [target, scheduled, sized, seeded])
    bench.add_argument("--warmup", type=int, default=10, help="untimed runs first (default 10)")
    bench.add_argument("--iters", type=positive_int, default=50, help="timed runs; the median is printed (default 50)")
    tune = command("tune", cmd_tune, "search the workload's schedule space for these sizes and cache the "
                   "winner (wsched.autotune; needs a Hopper GPU)", [target, sized])
    tune.add_argument("--max-candidates", type=positive_int, metavar="N", help="search the default and N-1 others")
    tune.add_argument("--iters", type=positive_int, default=50, help="timed runs per candidate (default 50)")
    tune.add_argument("--warmup", type=int, default=10, help="untimed runs per candidate first (default 10)")
    tune.add_argument("--workers", type=positive_int, metavar="N", help="parallel nvcc builds (default: the CPU count)")
    tune.add_argument("--force", action="store_true", help="search again even if the tune cache has a winner")
    tune.add_argument("--no-progress", action="store_true", help="no progress bars")
    tune.add_argument("--top", type=int, default=5, help="how many of the fastest candidates to list (default 5)")
    trace = command("trace", cmd_trace, "export a timeline of the producer and consumer warpgroups (wsched.timeline)",
                    [target, scheduled, sized, seeded])
    trace.add_argument("-o", "--output", metavar="FILE.json",
                       help="the Chrome/Perfetto trace JSON to write (default FUSION.trace.json)")
    trace.add_argument("--png", metavar="FILE.png", help="where the picture goes (default: beside the JSON)")
    trace.add_argument("--no-png", action="store_true", help="write the JSON alone (no matplotlib needed)")
    trace.add_argument("--gpu", action="store_true",
                       help="trace an instrumented build on the GPU instead of the simulator (needs a Hopper GPU)")
    trace.add_argument("--ctas", type=positive_int, metavar="N", help="export the first N CTAs only")
    trace.add_argument("--num-sms", type=positive_int, default=4, help="simulator: CTAs resident at a time (default 4)")
    return parser


def _one_line(error: BaseException) -> str:
    """An error's message on one line: a parse error's position without the excerpt under it, a
    list of problems (a schedule's, the verifier's) joined with '; '."""
    from .lowering.parser import IRParseError

    text = str(error)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    if isinstance(error, IRParseError):
        return lines[0]
    cu_path = getattr(error, "cu_path", None)
    head, rest = lines[0], [line.removeprefix("- ") for line in lines[1:]]
    message = head + (" " + "; ".join(rest) if rest else "")
    return message + (f" (source: {cu_path})" if cu_path else "")


def user_errors() -> tuple[type[BaseException], ...]:
    """The exceptions that report a mistake to the user (not a bug of wsched)."""
    from . import api
    from .codegen.nvcc import BuildError
    from .codegen.tma import TensorMapError
    from .errors import ArgumentError, FusionError
    from .lowering.parser import IRParseError
    from .lowering.simulate.errors import SimulationError
    from .lowering.verify.errors import VerifyError
    from .schedule import ScheduleError

    found = [CLIError, FusionError, ScheduleError, ArgumentError, IRParseError, VerifyError, SimulationError,
             BuildError, TensorMapError]
    found += [cls for cls in (getattr(api, "NoGPUError", None),) if cls is not None]
    return tuple(found)


def main(argv: list[str] | None = None) -> int:
    """Run one command; the exit code: 0 ok, 1 an output mismatched the reference, 2 an error."""
    argv = sys.argv[1:] if argv is None else list(argv)
    show_traceback = "--traceback" in argv
    command = next((a for a in argv if not a.startswith("-")), None)
    prog = f"wsched {command}" if command in COMMANDS else "wsched"
    try:
        parser = build_parser()
        try:
            args, extra = parser.parse_known_args(argv)
        except SystemExit as done:   # --help
            return int(done.code or 0)
        if args.command is None:
            parser.print_help(sys.stderr)
            return EXIT_ERROR
        if extra:
            raise CLIError(f"unrecognized arguments: {' '.join(extra)} (see {prog} --help)")
        return args.handler(args)
    except user_errors() as error:
        if show_traceback:
            raise
        print(f"{prog}: error: {_one_line(error)}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:   # `wsched cuda ... | head`
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
