"""The autotuner: search a workload's schedule space for the fastest kernel of a shape, and
remember the winner on disk.

    result = ws.autotune.tune(mlp, {"M": 4096, "N": 4096, "K": 4096})   # or tensors, or shapes
    result.schedule                  # the winner; result.times[schedule] in ms, result.rejected
    ws.autotune.tuned_schedule(mlp, {"M": 4000, "N": 4096, "K": 4096})   # cached winner or None

A search runs each candidate of `workload_for(fusion).schedule_space(fusion)`, led by what
`ws.compile(fusion)` runs at that shape (`default_choice`: its per-shape pick, so a winner is never
slower than the default but by timing noise) and the default schedule, through four stages, each
with a progress bar:

1. check: lower (the final IR is verified) and run the kernel in the CPU simulator on a small
   shape against `fusion.reference`. A candidate that fails is rejected with the reason; a
   schedule that hangs or races there never reaches the GPU.
2. build: nvcc, in parallel (a thread pool; each nvcc is its own process), started as soon as a
   candidate passes its check, through the on-disk build cache.
3. time: on the GPU with CUDA events (warm-up, then the median of `iters` launches) on random
   normal inputs of the given shape; each candidate's outputs are poisoned with NaN and checked
   against `fusion.reference` once before it is timed.
4. the winner is written to the tune cache.

The tune cache is one JSON file per key under `<WSCHED_CACHE_DIR>/tune/`, written atomically
(a temporary file renamed into place), so that concurrent processes never read half an entry.
The key (`CacheKey`) holds everything a winner depends on:

- the fusion's text (`str(fusion)` without the `# file.py:LINE` comments: moving a definition
  does not retune, changing an op, a dtype or a constant does);
- the shape bucket (`bucket`): a size up to SMALL_SIZE (128) is kept exact, a larger one is
  rounded up to a power of two (129..256 -> 256, 2049..4096 -> 4096). Small sizes are where the
  tile count and the skinny-shape paths change the winner most, and there a bucket of 8..128
  would lump a decode step with a prefill; above, a winner holds across a factor of two;
- the GPU name and driver version, the nvcc version, the wsched version (the package version
  plus a digest of its sources, since an editable install changes code without a new version);
- the identity of the space searched: a digest of every candidate schedule in order, so a
  changed space (a new field, a new tile, a different `max_candidates`) misses. Two shapes of one
  bucket whose per-shape default differs lead with different candidates, so they are tuned apart.

A lookup compares the whole stored key, not only the file name, and rebuilds the winner through
its schedule type's validation: an unreadable, corrupt or stale entry is ignored (the reason is
in `TuneResult.cache_note`) and the search runs again and rewrites it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import os
import re
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import torch

from . import knobs
from .codegen.launch import TmaLayoutError
from .fusion import check_fusion
from .inputs import random_inputs
from .schedule import Schedule, ScheduleError
from .target import HOPPER_SMS
from .timing import median_ms
from .workloads import workload_for

__all__ = ["AutotunedKernel", "CacheKey", "Environment", "TuneResult", "bucket", "cache_key", "candidates_for",
           "default_choice", "environment", "tune", "tuned_schedule"]

# Sizes up to this are their own bucket; larger ones round up to a power of two (see bucket()).
SMALL_SIZE = 128
# Entries of another layout are stale; bump when the JSON changes.
CACHE_FORMAT = 1
# The check shape: symbols only in leading (batch) dims shrink to this many, the others to
# CHECK_SIZE (two 128-row tiles and a ragged edge, five 64-wide k steps: every stage count of
# the space wraps its ring at least once; 264 elements keep rows 16-byte aligned).
CHECK_BATCH = 2
CHECK_SIZE = 264
# ||out - ref|| / ||ref|| a candidate may reach (bf16 outputs of bf16 operands land near 4e-3).
TOLERANCE = 2e-2

Timer = Callable[["object", list], float]   # (CompiledKernel, input tensors) -> milliseconds


# --------------------------------------------------------------------------------------------
# The cache key
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Environment:
    """What a timing depends on besides the kernel: the GPU, its driver, nvcc, wsched."""

    gpu: str
    driver: str
    nvcc: str
    wsched: str


@dataclass(frozen=True)
class CacheKey:
    """Everything a tuned winner depends on (see the module docstring); `digest` names its file."""

    fusion: str
    shapes: str
    gpu: str
    driver: str
    nvcc: str
    wsched: str
    space: str

    @property
    def digest(self) -> str:
        text = json.dumps(dataclasses.asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:32]


def bucket(size: int) -> int:
    """The size a tuned winner is stored under: `size` itself up to SMALL_SIZE, else the next
    power of two at or above it."""
    return size if size <= SMALL_SIZE else 1 << (size - 1).bit_length()


def fusion_text(fusion) -> str:
    """`str(fusion)` without the source-line comments (`   # file.py:12`)."""
    return re.sub(r"[ \t]+# [^\n]*:\d+$", "", str(fusion), flags=re.MULTILINE)


def space_identity(workload_name: str, candidates: Sequence[Schedule]) -> str:
    text = "\n".join([workload_name, *(repr(s) for s in candidates)])
    return f"{workload_name}:{len(candidates)}:{hashlib.sha256(text.encode()).hexdigest()[:16]}"


def cache_key(fusion, sizes: Mapping[str, int], candidates: Sequence[Schedule], env: Environment) -> CacheKey:
    """The key of the winner among `candidates` for `fusion` at `sizes` (exact sizes; bucketed
    here) on `env`."""
    shapes = ",".join(f"{symbol}={bucket(sizes[symbol])}" for symbol in fusion.symbols)
    return CacheKey(fusion=fusion_text(fusion), shapes=shapes, gpu=env.gpu, driver=env.driver, nvcc=env.nvcc,
                    wsched=env.wsched, space=space_identity(workload_for(fusion).name, candidates))


def environment(device: torch.device | int | None = None) -> Environment:
    """The environment of `device` (default: the current CUDA device). Needs a CUDA GPU: a
    timing means nothing without one (RuntimeError otherwise)."""
    if not torch.cuda.is_available():
        raise RuntimeError("autotuning times kernels on a CUDA GPU, and torch sees none here")
    index = device if isinstance(device, int) else getattr(device, "index", None)
    if index is None:
        index = torch.cuda.current_device()
    return Environment(gpu=torch.cuda.get_device_name(index), driver=_driver_version(), nvcc=_nvcc_version(),
                       wsched=wsched_version())


@lru_cache(maxsize=None)
def _driver_version() -> str:
    """The kernel module's version where Linux shows it (580.95.05), and the CUDA version the
    driver implements (cuDriverGetVersion: 13000)."""
    parts = []
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
        found = re.search(r"Kernel Module\s+(\S+)", text)
        if found:
            parts.append(found.group(1))
    except OSError:
        pass
    try:
        from cuda.bindings import driver

        error, version = driver.cuDriverGetVersion()
        if error == driver.CUresult.CUDA_SUCCESS:
            parts.append(f"cuda {version}")
    except Exception:  # noqa: BLE001 - a missing binding leaves the module version alone
        pass
    return " ".join(parts) or "unknown"


@lru_cache(maxsize=None)
def _nvcc_version() -> str:
    from .codegen import nvcc

    try:
        return nvcc.nvcc_version()
    except nvcc.BuildError:
        return "none"


@lru_cache(maxsize=None)
def wsched_version() -> str:
    """The installed version and a digest of the sources of wsched, wsched.lowering and
    wsched.codegen (Python, device headers, grammar)."""
    from importlib import metadata

    from . import codegen, lowering

    try:
        version = metadata.version("wsched")
    except metadata.PackageNotFoundError:
        version = "unknown"
    digest = hashlib.sha256()
    for package in (Path(__file__).parent, Path(lowering.__file__).parent, Path(codegen.__file__).parent):
        for path in sorted(package.rglob("*")):
            if path.suffix in (".py", ".cuh", ".lark") and "__pycache__" not in path.parts:
                digest.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes() + b"\0")
    return f"{version}+src.{digest.hexdigest()[:12]}"


# --------------------------------------------------------------------------------------------
# The cache
# --------------------------------------------------------------------------------------------

def tune_dir() -> Path:
    return knobs.cache_dir() / "tune"


def _entry_path(key: CacheKey) -> Path:
    return tune_dir() / f"{key.digest}.json"


def _stored(schedule: Schedule) -> dict:
    return {"type": type(schedule).__name__,
            "fields": {f.name: getattr(schedule, f.name) for f in dataclasses.fields(schedule)}}


def _schedule_types() -> dict[str, type[Schedule]]:
    from .workloads import WORKLOADS

    return {w.schedule_type.__name__: w.schedule_type for w in WORKLOADS}


def _restored(stored: object) -> Schedule:
    """The schedule `_stored` wrote, validated again (ScheduleError if it no longer is valid)."""
    if not isinstance(stored, dict) or not isinstance(stored.get("fields"), dict):
        raise ValueError(f"a schedule is stored as {{type, fields}}, not {type(stored).__name__}")
    schedule_type = _schedule_types().get(stored.get("type"))
    if schedule_type is None:
        raise ValueError(f"unknown schedule type {stored.get('type')!r}")
    return schedule_type(**{name: tuple(v) if isinstance(v, list) else v for name, v in stored["fields"].items()})


def _read_entry(key: CacheKey, candidates: Sequence[Schedule]):
    """(winner, times, rejected, note): the winner is None when the entry is missing, corrupt
    or stale, and `note` says which."""
    path = _entry_path(key)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None, {}, {}, "no entry"
    except OSError as error:
        return None, {}, {}, f"unreadable entry {path} ({error})"
    try:
        entry = json.loads(text)
        if not isinstance(entry, dict):
            raise ValueError("not a JSON object")
    except ValueError as error:
        return None, {}, {}, f"corrupt entry {path} ({error})"
    if entry.get("format") != CACHE_FORMAT:
        return None, {}, {}, f"stale entry {path} (format {entry.get('format')!r}, expected {CACHE_FORMAT})"
    if entry.get("key") != dataclasses.asdict(key):
        return None, {}, {}, f"stale entry {path} (its key differs)"
    try:
        winner = _restored(entry["winner"])
        times = {_restored(stored): float(ms) for stored, ms in entry["times_ms"]}
        rejected = {_restored(stored): str(why) for stored, why in entry["rejected"]}
    except (KeyError, TypeError, ValueError) as error:   # ScheduleError is a ValueError
        return None, {}, {}, f"stale entry {path} ({str(error).splitlines()[0]})"
    if winner not in candidates:
        return None, {}, {}, f"stale entry {path} (its winner is not in the space searched)"
    return winner, times, rejected, "hit"


def _write_entry(key: CacheKey, result: "TuneResult", sizes: Mapping[str, int]) -> None:
    """Publish atomically: a temporary file in the same folder, renamed over the entry."""
    path = _entry_path(key)
    entry = {
        "format": CACHE_FORMAT,
        "key": dataclasses.asdict(key),
        "sizes": dict(sizes),
        "winner": _stored(result.schedule),
        "times_ms": [[_stored(s), ms] for s, ms in result.times.items()],
        "rejected": [[_stored(s), why] for s, why in result.rejected.items()],
        "tune_seconds": round(result.seconds, 3),
        "created": time.time(),
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=".tmp-", suffix=".json",
                                         delete=False) as f:
            json.dump(entry, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(f.name, path)
    except OSError as error:
        try:
            os.unlink(f.name)
        except (OSError, UnboundLocalError):
            pass
        warnings.warn(f"wsched: could not store the tuned schedule in {path} ({error}); "
                      f"the next process tunes again", stacklevel=3)


# --------------------------------------------------------------------------------------------
# The search
# --------------------------------------------------------------------------------------------

@dataclass
class TuneResult:
    """The outcome of `tune`: the winner, what each candidate took, and where it came from."""

    schedule: Schedule                                            # the fastest candidate
    times: dict[Schedule, float] = field(default_factory=dict)    # ms of every timed candidate
    rejected: dict[Schedule, str] = field(default_factory=dict)   # why each other one was dropped
    from_cache: bool = False
    key: CacheKey | None = None
    path: Path | None = None                                      # the cache entry
    seconds: float = 0.0                                          # wall time of this call
    cache_note: str = ""                                          # why the cache was (not) used
    default: Schedule | None = None                               # what ws.compile(fusion) runs here

    @property
    def default_ms(self) -> float | None:
        """Time of the schedule ws.compile(fusion) runs at this shape (None where not timed)."""
        return self.times.get(self.default) if self.default is not None else None


def tune(fusion, sizes_or_tensors, *, candidates: Iterable[Schedule] | None = None,
         max_candidates: int | None = None, iters: int = 50, warmup: int = 10, progress: bool = True,
         timer: Timer | None = None, build: bool = True, workers: int | None = None,
         force: bool = False) -> TuneResult:
    """The fastest schedule for `fusion` at one shape, from the tune cache or by a search.

    sizes_or_tensors: the size of every symbol ({"M": 4096, ...}), or one tensor or shape per
    input (CUDA tensors also pick the device). candidates: the schedules to try (default: the
    workload's default schedule, then its `schedule_space(fusion)`); max_candidates keeps the
    default and that many in all, spread evenly over the rest. iters / warmup: timed and
    untimed launches per candidate. progress: tqdm bars on stderr. timer: (CompiledKernel,
    inputs) -> ms instead of the CUDA-event timing and reference check on the GPU (the inputs
    are then CPU tensors); build=False skips nvcc (with a timer that needs no cubin). workers:
    parallel nvcc builds (default: the CPU count). force: search even if the cache has a winner.
    """
    from .errors import check_argument

    t0 = time.perf_counter()
    check_fusion(fusion, "ws.autotune.tune")
    for name, value in (("iters", iters), ("warmup", warmup)):
        check_argument(name, value, int, "a positive int")
    if iters < 1 or warmup < 0:
        raise ValueError(f"iters={iters} must be at least 1 and warmup={warmup} at least 0")
    sizes, device = resolve_sizes(fusion, sizes_or_tensors)
    num_sms = _sm_count(device)   # as tuned_schedule reads it (the Hopper count without a GPU)
    searched = candidates_for(fusion, candidates, max_candidates, sizes=sizes, num_sms=num_sms)
    default = default_choice(fusion, sizes, num_sms)
    env = _environment_for(device, timer)
    key = cache_key(fusion, sizes, searched, env)
    if not force:
        winner, times, rejected, note = _read_entry(key, searched)
        if winner is not None:
            return TuneResult(winner, times, rejected, from_cache=True, key=key, path=_entry_path(key),
                              seconds=time.perf_counter() - t0, cache_note=note, default=default)
    else:
        note = "force=True"
    times, rejected = _search(fusion, sizes, device, searched, iters=iters, warmup=warmup, progress=progress,
                              timer=timer, build=build, workers=workers)
    if not times:
        reasons = "\n  - ".join(f"{s.short()}: {why}" for s, why in list(rejected.items())[:8])
        raise ScheduleError(f"autotuning {fusion.name}: none of the {len(searched)} candidates passed; the first "
                            f"reasons:\n  - {reasons}")
    winner = min(times, key=times.get)
    result = TuneResult(winner, times, rejected, from_cache=False, key=key, path=_entry_path(key),
                        seconds=time.perf_counter() - t0, cache_note=note, default=default)
    _write_entry(key, result, sizes)
    return result


def tuned_schedule(fusion, sizes_or_tensors, *, candidates: Iterable[Schedule] | None = None,
                   max_candidates: int | None = None) -> Schedule | None:
    """The cached winner for `fusion` at this shape's bucket on this GPU (the same space as a
    `tune` with these arguments), or None: no entry, a stale or corrupt one, or no GPU."""
    check_fusion(fusion, "ws.autotune.tuned_schedule")
    sizes, device = resolve_sizes(fusion, sizes_or_tensors)
    try:
        env = environment(device)
    except RuntimeError:
        return None
    searched = candidates_for(fusion, candidates, max_candidates, sizes=sizes, num_sms=_sm_count(device))
    winner, *_ = _read_entry(cache_key(fusion, sizes, searched, env), searched)
    return winner


def resolve_sizes(fusion, sizes_or_tensors) -> tuple[dict[str, int], torch.device | None]:
    """({symbol: size}, the CUDA device of the tensors or None) from sizes, tensors or shapes."""
    from .errors import FusionError

    if isinstance(sizes_or_tensors, Mapping):
        symbols = set(fusion.symbols)
        given = set(sizes_or_tensors)
        if given != symbols:
            missing, unknown = sorted(symbols - given), sorted(given - symbols)
            raise FusionError("ws.autotune.tune", f"{fusion.name} has the symbols {list(fusion.symbols)}; "
                              + (f"missing {missing}" if missing else "") + ("; " if missing and unknown else "")
                              + (f"unknown {unknown}" if unknown else ""), location="")
        bad = {s: v for s, v in sizes_or_tensors.items()
               if not isinstance(v, int) or isinstance(v, bool) or v < 1}
        if bad:
            raise FusionError("ws.autotune.tune", f"sizes must be positive ints, got {bad}", location="")
        return {s: sizes_or_tensors[s] for s in fusion.symbols}, None
    if not isinstance(sizes_or_tensors, (list, tuple)):
        raise FusionError("ws.autotune.tune", "expects {symbol: size}, or one tensor or shape per input of "
                          f"{fusion.name}, got {type(sizes_or_tensors).__name__}", location="")
    sizes = fusion.bind(*sizes_or_tensors)
    device = next((t.device for t in sizes_or_tensors if isinstance(t, torch.Tensor) and t.is_cuda), None)
    return sizes, device


def default_choice(fusion, sizes: Mapping[str, int] | None = None, num_sms: int = HOPPER_SMS) -> Schedule:
    """The schedule `ws.compile(fusion)` runs at `sizes` on a GPU of `num_sms` SMs: the first of
    the workload's variants whose rule holds there (wsched/dispatch.py), else the default."""
    from .dispatch import ROW_ALIGN, row_align
    from .inputs import input_shapes
    from .partition import param_name
    from .target import DTYPE_BYTES
    from .workloads import partition

    workload = workload_for(fusion)
    default = workload.default_schedule(fusion)
    variants = workload.variants(fusion, default) if sizes is not None else ()
    if variants:
        # the rules read the kernel's size scalars (M, N, S, batch0, ...), as a call binds them
        shapes = input_shapes(fusion, sizes)
        part = partition(fusion, default)
        values = {dim: shapes[name][axis] for dim, (name, axis) in part.dims.items()}
        values["num_sms"] = num_sms
        # contiguous inputs of these shapes
        layouts = {param_name(n.id): (shapes[n.id], torch.empty(shapes[n.id], device="meta").stride(),
                                      DTYPE_BYTES[n.dtype.name]) for n in fusion.inputs}
        values[ROW_ALIGN] = row_align(part, layouts)
        for variant in variants:
            if variant.applies(values):
                return variant.schedule
    return default


def candidates_for(fusion, candidates: Iterable[Schedule] | None = None,
                   max_candidates: int | None = None, *, sizes: Mapping[str, int] | None = None,
                   num_sms: int = HOPPER_SMS) -> list[Schedule]:
    """The schedules a search tries, in order: `candidates` (duplicates dropped), else what
    `ws.compile(fusion)` runs at `sizes` (its per-shape choice, `default_choice`), the
    workload's default schedule, then its schedule space — so a search never ends below the
    default; with `max_candidates`, those leading ones and the rest spread evenly over the others."""
    workload = workload_for(fusion)
    if candidates is not None:
        found = list(dict.fromkeys(candidates))
        lead = 1
    else:
        default = workload.default_schedule(fusion)
        found = list(dict.fromkeys([default_choice(fusion, sizes, num_sms), default,
                                    *workload.schedule_space(fusion)]))
        lead = 2 if found[0] != default else 1
    if not found:
        raise ScheduleError(f"autotuning {fusion.name}: no candidate schedules to search")
    if max_candidates is not None:
        if not isinstance(max_candidates, int) or isinstance(max_candidates, bool) or max_candidates < 1:
            raise ValueError(f"max_candidates={max_candidates!r} must be a positive int")
        if max_candidates < len(found):
            lead = min(lead, max_candidates)
            head, rest = found[:lead], found[lead:]
            picks = max_candidates - lead
            found = [*head, *(rest[i * len(rest) // picks] for i in range(picks))]
    return found


def _sm_count(device) -> int:
    """SMs of `device` (default: the current CUDA device); the Hopper count without a GPU."""
    from .codegen.launch import sm_count

    return sm_count(device) if torch.cuda.is_available() else HOPPER_SMS


def _environment_for(device, timer) -> Environment:
    if timer is None:
        return environment(device)
    try:
        return environment(device)
    except RuntimeError:   # an injected timer: no GPU, so the key names none
        return Environment(gpu="none (injected timer)", driver="none", nvcc=_nvcc_version(),
                           wsched=wsched_version())


def check_sizes(fusion, sizes: Mapping[str, int]) -> dict[str, int]:
    """The small shape every candidate is simulated at (see CHECK_SIZE, CHECK_BATCH): no larger
    than the shape tuned for, so a shape the kernel rejects is not invented here."""
    inner = {d for node in fusion.inputs for d in node.shape[-2:] if isinstance(d, str)}
    return {s: min(size, CHECK_SIZE if s in inner else CHECK_BATCH) for s, size in sizes.items()}


def output_error(got, expected) -> str | None:
    """None if every output is written and within TOLERANCE of the reference, else why not."""
    got = got if isinstance(got, tuple) else (got,)
    expected = expected if isinstance(expected, tuple) else (expected,)
    for index, (out, ref) in enumerate(zip(got, expected)):
        out, ref = out.float(), ref.float().to(out.device)
        unwritten = int(torch.isnan(out).sum()) - int(torch.isnan(ref).sum())
        if unwritten > 0:
            return f"output {index}: {unwritten} elements never written (NaN)"
        error = float((out - ref).nan_to_num().norm() / ref.nan_to_num().norm().clamp_min(1e-30))
        if not error <= TOLERANCE:
            return f"output {index}: relative error {error:.2e} > {TOLERANCE:.0e}"
    return None


def _bar(progress: bool, total: int, stage: str, position: int = 0):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=f"wsched tune: {stage}", unit="cand", disable=not progress,
                position=position, leave=progress, dynamic_ncols=True)


def _search(fusion, sizes, device, candidates, *, iters, warmup, progress, timer, build, workers):
    """(ms by schedule, reason by rejected schedule): check, build and time every candidate."""
    from .kernel import build_kernel as compile_fusion

    rejected: dict[Schedule, str] = {}
    small = check_sizes(fusion, sizes)
    small_inputs = random_inputs(fusion, small, seed=1)
    small_expected = fusion.reference(*small_inputs)
    built: dict[Schedule, object] = {}
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 1,
                                                 thread_name_prefix="wsched-nvcc")
    futures: dict[concurrent.futures.Future, tuple[Schedule, object]] = {}
    shape_text = "x".join(str(v) for v in small.values())
    label = _labeller(candidates)
    with pool, _bar(progress, len(candidates), f"check ({shape_text}, simulator)") as check_bar, \
            _bar(progress, len(candidates), "build (nvcc)", position=1) as build_bar:
        for schedule in candidates:
            check_bar.set_postfix_str(label(schedule), refresh=False)
            kernel, why = _check(compile_fusion, fusion, schedule, small_inputs, small_expected)
            check_bar.update()
            if why:
                rejected[schedule] = why
                build_bar.total -= 1
                build_bar.refresh()
            elif build:
                futures[pool.submit(kernel.compile_cuda)] = (schedule, kernel)
            else:
                built[schedule] = kernel
                build_bar.update()
        for future in concurrent.futures.as_completed(futures):
            schedule, kernel = futures[future]
            error = future.exception()
            if error is not None:
                rejected[schedule] = f"build: {_reason(error)}"
            else:
                built[schedule] = kernel
            build_bar.update()
    # time in the order of the candidates, whatever order the builds finished in
    order = [s for s in candidates if s in built]
    measure = timer or _GpuTimer(fusion, sizes, device, iters=iters, warmup=warmup)
    inputs = random_inputs(fusion, sizes, seed=2) if timer is not None else None
    times: dict[Schedule, float] = {}
    with _bar(progress, len(order), "time (GPU)") as time_bar:
        for schedule in order:
            time_bar.set_postfix_str(label(schedule), refresh=False)
            try:
                ms = measure(built[schedule], inputs) if timer is not None else measure(built[schedule])
            except _Rejected as error:
                rejected[schedule] = str(error)
            except Exception as error:  # noqa: BLE001 - a candidate that fails is dropped, with why
                rejected[schedule] = f"run: {_reason(error)}"
            else:
                times[schedule] = float(ms)
            time_bar.update()
    return times, rejected


def _labeller(candidates: Sequence[Schedule]) -> Callable[[Schedule], str]:
    """Names a candidate by the fields that vary across the search (for the progress bars)."""
    names = [f.name for f in dataclasses.fields(candidates[0])
             if len({repr(getattr(s, f.name, None)) for s in candidates}) > 1]

    def label(schedule: Schedule) -> str:
        return " ".join(f"{name}={getattr(schedule, name, None)}" for name in names)   # types may differ
    return label


def _check(compile_fusion, fusion, schedule, inputs, expected):
    """(CompiledKernel, None) if `schedule` lowers, verifies and simulates right; else (None, why)."""
    try:
        kernel = compile_fusion(fusion, schedule, build=False)
    except Exception as error:  # noqa: BLE001 - ScheduleError, a verifier error, an internal one
        return None, f"lower: {_reason(error)}"
    try:
        got = kernel.simulate(*inputs)
    except Exception as error:  # noqa: BLE001 - a deadlock, a race, an expect_tx mismatch...
        return None, f"simulate: {_reason(error)}"
    why = output_error(got, expected)
    return (None, f"simulate: {why}") if why else (kernel, None)


def _reason(error: BaseException, limit: int = 400) -> str:
    """An exception as one line for TuneResult.rejected (a ScheduleError lists its problems on
    the lines after the first)."""
    text = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
    text = f"{type(error).__name__}: {text}"
    return text if len(text) <= limit else text[:limit - 3] + "..."


class _Rejected(Exception):
    """A candidate that ran but gave wrong outputs."""


class _GpuTimer:
    """Times a built kernel with CUDA events on fixed random inputs at the tuned shape, after
    checking its outputs against the reference (computed once)."""

    def __init__(self, fusion, sizes, device, *, iters: int, warmup: int):
        self.device = device or torch.device("cuda", torch.cuda.current_device())
        self.inputs = random_inputs(fusion, sizes, device=self.device, seed=2)
        self.expected = fusion.reference(*self.inputs)
        self.iters, self.warmup = iters, warmup

    def __call__(self, kernel) -> float:
        try:
            launch = kernel.bind(*self.inputs)   # bound once: time the kernel, not the binding
        except TmaLayoutError:   # rows TMA cannot read as they are (N = 50257): time the call the
            return self._time_staged_call(kernel)   # user gets, which stages them through copies
        for t in launch.outputs.values():
            t.fill_(float("nan"))
        launch()
        launch.synchronize()
        values = tuple(launch.outputs.values())
        why = output_error(values if len(values) > 1 else values[0], self.expected)
        if why:
            raise _Rejected(f"wrong output on the GPU: {why}")
        with torch.cuda.device(self.device):
            ms = median_ms(launch, warmup=self.warmup, iters=self.iters, device=self.device)
        launch.synchronize()
        return ms


    def _time_staged_call(self, kernel) -> float:
        """The whole eager call of a kernel whose tensors are staged (CompiledKernel._run_staged),
        checked first, then timed as the bound launch is."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # the staging warning: the call is timed with its copies
            outputs = kernel._outputs(kernel.fusion.bind(*self.inputs), self.device)
            for t in outputs.values():
                t.fill_(float("nan"))
            kernel(*self.inputs, out=outputs)
            kernel.synchronize(self.device)
            values = tuple(outputs.values())
            why = output_error(values if len(values) > 1 else values[0], self.expected)
            if why:
                raise _Rejected(f"wrong output on the GPU: {why}")
            with torch.cuda.device(self.device):
                ms = median_ms(lambda: kernel(*self.inputs, out=outputs), warmup=self.warmup, iters=self.iters,
                               device=self.device)
        kernel.synchronize(self.device)
        return ms


# --------------------------------------------------------------------------------------------
# Tuning at the first call
# --------------------------------------------------------------------------------------------

class AutotunedKernel:
    """What `ws.compile(fusion, autotune=True)` returns when no shape is given: at the first call
    of each shape bucket it tunes (or reads the cache), compiles the winner and runs it."""

    def __init__(self, fusion, *, progress: bool = True, **tune_options):
        self.fusion = fusion
        self.progress = progress
        self.tune_options = tune_options
        self.kernels: dict[tuple[int, ...], object] = {}    # by shape bucket

    def kernel_for(self, *tensors):
        """The CompiledKernel of the winner for these tensors' shape bucket."""
        from .kernel import build_kernel as compile_fusion

        sizes, _ = resolve_sizes(self.fusion, list(tensors))
        bucket_key = tuple(bucket(sizes[s]) for s in self.fusion.symbols)
        kernel = self.kernels.get(bucket_key)
        if kernel is None:
            result = tune(self.fusion, list(tensors), progress=self.progress, **self.tune_options)
            kernel = self.kernels[bucket_key] = compile_fusion(self.fusion, result.schedule, build=True)
        return kernel

    def __call__(self, *tensors, **kwargs):
        return self.kernel_for(*tensors)(*tensors, **kwargs)
