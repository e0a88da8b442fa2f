"""The native launch path (codegen/native_launch.c) on CPU tensors, with stand-ins for the
driver's cuLaunchKernel, cuCtxGetCurrent and cuTensorMapEncodeTiled that record what they get.

What a plan must do per call: match the call's layouts exactly (else None: the Python path
runs), allocate the outputs, write every data pointer into its parameter slot, take each TMA map
from its cache by address (encoding a new address once), leave the other parameters as packed,
and launch with the plan's grid, block, shared memory and torch's stream of the device."""

from __future__ import annotations

import ctypes
import shutil
import struct

import pytest
import torch

from wsched.codegen import native

if native._native_launch is None:
    # the extension is built by `pip install` wherever a C compiler is found: on such a machine
    # a missing module is a failed build, not a reason to skip
    if shutil.which("cc") or shutil.which("gcc"):
        pytest.fail(f"a C compiler is present but {native.available.reason or native._IMPORT_ERROR}",
                    pytrace=False)
    pytest.skip("the native launch extension is not built (no C compiler)", allow_module_level=True)

Plan = native._native_launch.Plan

LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, *[ctypes.c_uint] * 7, ctypes.c_void_p,
                          ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)
CONTEXT = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_void_p))
ENCODE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p,
                          ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64),
                          ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32),
                          ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int)

CONTEXT_HANDLE = 0xC0FFEE0
FUNCTION_HANDLE = 0xF00D0


class FakeDriver:
    """Stand-ins for the three driver calls; `params` says how many bytes each parameter has."""

    def __init__(self, params: list[int], helpers: dict[int, list[int]] | None = None):
        self.sizes = params
        self.helper_sizes = helpers or {}   # a helper kernel's function handle -> its params' bytes
        self.launches: list[dict] = []
        self.encodes: list[dict] = []
        self.context = CONTEXT_HANDLE
        self.launch_result = 0
        self.failing = None                 # a function handle whose launches fail
        self.encode_result = 0
        self.streams: list[int] = []

        def launch(function, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
            self.launches.append({
                "function": function, "grid": (gx, gy, gz), "block": (bx, by, bz), "smem": smem,
                "stream": stream or 0, "extra": extra,
                "params": [ctypes.string_at(params[i], size)
                           for i, size in enumerate(self.helper_sizes.get(function, self.sizes))]})
            return 1 if function == self.failing else self.launch_result

        def current(out):
            out[0] = self.context
            return 0

        def encode(tensor_map, dtype, rank, address, dims, strides, box, element_strides, interleave,
                   swizzle, l2, oob):
            record = {"dtype": dtype, "rank": rank, "address": address or 0,
                      "dims": [dims[i] for i in range(rank)], "strides": [strides[i] for i in range(rank - 1)],
                      "box": [box[i] for i in range(rank)], "element_strides": [element_strides[i] for i in range(rank)],
                      "modes": (interleave, swizzle, l2, oob)}
            self.encodes.append(record)
            # the "map": the address, then a counter, so a test can tell which encode it came from
            ctypes.memmove(tensor_map, struct.pack("<QQ", address or 0, len(self.encodes)), 16)
            return self.encode_result

        self._callbacks = (LAUNCH(launch), CONTEXT(current), ENCODE(encode))   # kept alive

    def entry_points(self) -> tuple[int, int, int]:
        return tuple(ctypes.cast(c, ctypes.c_void_p).value for c in self._callbacks)

    def stream(self, device_index):
        self.streams.append(device_index)
        return 0x5000 + device_index


def make_launcher(driver: FakeDriver):
    return native.launcher(driver.entry_points(), stream=driver.stream)


def layouts(*tensors):
    return (tuple(tuple(t.shape) for t in tensors), tuple(t.stride() for t in tensors),
            tuple(t.dtype for t in tensors), tuple(t.device for t in tensors))


def matmul_plan(a, b, out_shape=(4, 8), maps=(), n_alloc=1, n_return=1, pointers=((0, 0), (1, 1), (2, 2)),
                params=None):
    """A plan of a kernel(a_ptr, b_ptr, out_ptr, M: i32, scale: f32): pointers set per call, the
    scalars as packed."""
    params = params or (bytes(8), bytes(8), bytes(8), struct.pack("<i", 4), struct.pack("<f", 0.5))
    alloc = tuple(out_shape for _ in range(n_alloc))   # torch.empty(*out_shape, ...)
    kwargs = tuple({"dtype": torch.bfloat16, "device": torch.device("cpu")} for _ in range(n_alloc))
    return Plan(*layouts(a, b), alloc, kwargs, n_return, FUNCTION_HANDLE, CONTEXT_HANDLE, 132, 384, 1024, 0,
                params, tuple(pointers), tuple(maps))


def pointer(raw: bytes) -> int:
    return struct.unpack("<Q", raw[:8])[0]


@pytest.fixture
def driver():
    return FakeDriver([8, 8, 8, 4, 4])


def test_a_matching_call_allocates_sets_pointers_and_launches(driver):
    launcher = make_launcher(driver)
    a, b = torch.randn(4, 16), torch.randn(16, 8)
    launcher.add(matmul_plan(a, b))
    out = launcher((a, b))
    assert isinstance(out, torch.Tensor) and out.shape == (4, 8) and out.dtype == torch.bfloat16
    (launch,) = driver.launches
    assert launch["function"] == FUNCTION_HANDLE and launch["grid"] == (132, 1, 1)
    assert launch["block"] == (384, 1, 1) and launch["smem"] == 1024 and launch["extra"] is None
    assert launch["stream"] == 0x5000 and driver.streams == [0]
    assert [pointer(p) for p in launch["params"][:3]] == [a.data_ptr(), b.data_ptr(), out.data_ptr()]
    assert launch["params"][3:] == [struct.pack("<i", 4), struct.pack("<f", 0.5)]
    assert launcher.stats() == {"hits": 1, "misses": 0, "plans": 1}


def test_new_tensors_of_the_same_layout_get_their_own_pointers(driver):
    launcher = make_launcher(driver)
    a, b = torch.randn(4, 16), torch.randn(16, 8)
    launcher.add(matmul_plan(a, b))
    a2, b2 = torch.randn(4, 16), torch.randn(16, 8)
    out1, out2 = launcher((a, b)), launcher((a2, b2))
    assert [pointer(p) for p in driver.launches[1]["params"][:3]] == [a2.data_ptr(), b2.data_ptr(), out2.data_ptr()]
    assert out1.data_ptr() != out2.data_ptr()


@pytest.mark.parametrize("change", ["shape", "stride", "dtype", "count", "not a tensor", "subclass", "device"])
def test_a_call_off_every_plan_is_a_miss_and_launches_nothing(driver, change):
    launcher = make_launcher(driver)
    a, b = torch.randn(4, 16), torch.randn(16, 8)
    launcher.add(matmul_plan(a, b))
    if change == "shape":
        args = (torch.randn(5, 16), b)
    elif change == "stride":
        args = (torch.randn(16, 4).t(), b)
    elif change == "dtype":
        args = (a.double(), b)
    elif change == "count":
        args = (a,)
    elif change == "not a tensor":
        args = (a, 3)
    elif change == "subclass":
        class Sub(torch.Tensor):
            pass
        args = (a.as_subclass(Sub), b)
    else:
        args = (a, torch.randn(16, 8, device="meta"))
    assert launcher(args) is None
    assert driver.launches == [] and launcher.stats()["misses"] == 1


def test_a_parameter_is_accepted(driver):
    launcher = make_launcher(driver)
    a, b = torch.randn(4, 16), torch.nn.Parameter(torch.randn(16, 8))
    launcher.add(matmul_plan(a, b))
    assert launcher((a, b)) is not None
    assert pointer(driver.launches[0]["params"][1]) == b.data_ptr()


def test_another_context_current_or_a_failed_launch_is_a_miss(driver):
    launcher = make_launcher(driver)
    a, b = torch.randn(4, 16), torch.randn(16, 8)
    launcher.add(matmul_plan(a, b))
    driver.context = 0x1234
    assert launcher((a, b)) is None and driver.launches == []
    driver.context = CONTEXT_HANDLE
    driver.launch_result = 1   # CUDA_ERROR_INVALID_VALUE: the Python path launches again and reports it
    assert launcher((a, b)) is None and len(driver.launches) == 1


def test_plans_are_tried_newest_first_and_the_oldest_dropped(driver):
    launcher = make_launcher(driver)
    shapes = [(m, 16) for m in range(1, native.CAPACITY + 2)]
    b = torch.randn(16, 8)
    for shape in shapes:
        launcher.add(matmul_plan(torch.randn(shape), b, out_shape=(shape[0], 8)))
    assert launcher.stats()["plans"] == native.CAPACITY
    assert launcher((torch.randn(shapes[0]), b)) is None              # the first plan was dropped
    out = launcher((torch.randn(shapes[-1]), b))
    assert out.shape == (shapes[-1][0], 8)
    launcher.clear()
    assert launcher.stats()["plans"] == 0 and launcher((torch.randn(shapes[-1]), b)) is None


def test_a_hit_moves_its_plan_to_the_front_and_holds_says_which_are_kept(driver):
    """Least recently used goes first: after a hit on the oldest plan, adding one more drops
    the second oldest instead."""
    launcher = make_launcher(driver)
    b = torch.randn(16, 8)
    plans = [matmul_plan(torch.randn(m, 16), b, out_shape=(m, 8)) for m in range(1, native.CAPACITY + 1)]
    for plan in plans:
        launcher.add(plan)
    assert launcher((torch.randn(1, 16), b)) is not None          # the oldest, now the most recent
    launcher.add(matmul_plan(torch.randn(99, 16), b, out_shape=(99, 8)))
    assert launcher.holds(plans[0]) and not launcher.holds(plans[1])
    assert launcher((torch.randn(2, 16), b)) is None


def test_a_plan_whose_init_failed_is_refused():
    a, b = torch.randn(4, 16), torch.randn(16, 8)
    plan = Plan.__new__(Plan)
    bad_map = (0, 9, *map_args())   # tensor 9 of 3
    with pytest.raises(ValueError, match="map slot out of range"):
        plan.__init__(*layouts(a, b), ((4, 8),), ({"dtype": torch.bfloat16},), 1, 1, 1, 1, 128, 0, 0,
                      (bytes(128), bytes(8), bytes(8)), ((1, 1),), ((0, 0, *map_args()), bad_map))
    with pytest.raises(TypeError, match="initialised Plan"):
        make_launcher(FakeDriver([8])).add(plan)


def test_out_tensors_are_passed_and_returned(driver):
    """k(a, b, out={"out": o}): the plan takes the out tensor as a third given tensor, allocates
    nothing, and returns it."""
    launcher = make_launcher(driver)
    a, b, o = torch.randn(4, 16), torch.randn(16, 8), torch.empty(4, 8, dtype=torch.bfloat16)
    plan = Plan(*layouts(a, b, o), (), (), 1, FUNCTION_HANDLE, CONTEXT_HANDLE, 1, 128, 0, 0,
                (bytes(8), bytes(8), bytes(8), bytes(4), bytes(4)), ((0, 0), (1, 1), (2, 2)), ())
    launcher.add(plan)
    assert launcher((a, b, o)) is o
    assert pointer(driver.launches[0]["params"][2]) == o.data_ptr()


def test_several_outputs_come_back_as_a_tuple(driver):
    launcher = make_launcher(driver)
    a, b = torch.randn(4, 16), torch.randn(16, 8)
    launcher.add(matmul_plan(a, b, n_alloc=2, n_return=2, pointers=((0, 0), (1, 1), (2, 3))))
    o, lse = launcher((a, b))
    assert pointer(driver.launches[0]["params"][2]) == lse.data_ptr() != o.data_ptr()


def map_args():
    # bf16 (dtype 10 in the driver's enum) [4, 16] read in [2, 8] boxes: innermost first
    return (10, (16, 4), (32,), (8, 2), (1, 1), 0, 3, 2, 0)


def test_tensor_maps_are_encoded_once_per_address_and_kept():
    driver = FakeDriver([128, 8, 8])
    launcher = make_launcher(driver)
    a, b = torch.randn(4, 16).bfloat16(), torch.randn(16, 8)
    plan = Plan(*layouts(a, b), ((4, 8),), ({"dtype": torch.bfloat16, "device": torch.device("cpu")},), 1,
                FUNCTION_HANDLE, CONTEXT_HANDLE, 1, 128, 0, 0, (bytes(128), bytes(8), bytes(8)),
                ((1, 1), (2, 2)), ((0, 0, *map_args()),))
    launcher.add(plan)
    launcher((a, b))
    launcher((a, b))
    (encode,) = driver.encodes
    assert encode == {"dtype": 10, "rank": 2, "address": a.data_ptr(), "dims": [16, 4], "strides": [32],
                      "box": [8, 2], "element_strides": [1, 1], "modes": (0, 3, 2, 0)}
    first, second = (launch["params"][0] for launch in driver.launches)
    assert first == second and struct.unpack("<QQ", first[:16]) == (a.data_ptr(), 1)
    # more addresses than the cache holds: each new one is encoded, the oldest forgotten
    others = [torch.randn(4, 16).bfloat16() for _ in range(native._native_launch.MAPS_PER_SLOT)]
    for t in others:
        launcher((t, b))
        assert struct.unpack("<Q", driver.launches[-1]["params"][0][:8])[0] == t.data_ptr()
    assert len(driver.encodes) == 1 + len(others)
    launcher((others[-1], b))                       # still cached
    assert len(driver.encodes) == 1 + len(others)
    launcher((a, b))                                # was dropped: encoded again
    assert len(driver.encodes) == 2 + len(others)


def test_a_misaligned_map_base_or_a_failed_encode_is_a_miss():
    driver = FakeDriver([128, 8, 8])
    launcher = make_launcher(driver)
    base = torch.randn(4, 24).bfloat16()
    a, b = base[:, 8:], torch.randn(16, 8)           # 16 bytes in: aligned; the view 2 bytes in is not
    plan = Plan(*layouts(a, b), ((4, 8),), ({"dtype": torch.bfloat16, "device": torch.device("cpu")},), 1,
                FUNCTION_HANDLE, CONTEXT_HANDLE, 1, 128, 0, 0, (bytes(128), bytes(8), bytes(8)),
                ((1, 1), (2, 2)), ((0, 0, *map_args()),))
    launcher.add(plan)
    assert launcher((a, b)) is not None
    assert launcher((base[:, 1:17], b)) is None
    driver.encode_result = 1
    assert launcher((base[:, 0:16], b)) is None     # a new address whose encode fails
    assert len(driver.launches) == 1
    driver.encode_result = 0
    assert launcher((a, b)) is not None             # the failed encode cleared the cache: encoded again
    assert len(driver.encodes) == 3


@pytest.mark.parametrize("bad, message", [
    (lambda p: p.__setitem__(6, 0), "tensor counts out of range"),
    (lambda p: p.__setitem__(13, (bytes(129),)), "parameter 0 has 129 bytes (at most 128)"),
    (lambda p: p.__setitem__(14, ((7, 0),)), "pointer slot out of range"),
    (lambda p: p.__setitem__(15, ((0, 9, *map_args()),)), "map slot out of range"),
])
def test_a_malformed_plan_is_refused(bad, message):
    a, b = torch.randn(4, 16), torch.randn(16, 8)
    args = [*layouts(a, b), ((4, 8),), ({"dtype": torch.bfloat16},), 1, 1, 1, 1, 128, 0, 0,
            (bytes(8), bytes(8), bytes(8)), ((0, 0),), ()]
    bad(args)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Plan(*args)


def test_the_map_slot_of_a_spec_is_what_the_python_encode_passes():
    """native.map_slot gives cuTensorMapEncodeTiled's arguments as tma.driver_arguments does."""
    from wsched.codegen.tma import driver_arguments, spec_for_tensor

    t = torch.randn(2, 64, 128).bfloat16()
    spec = spec_for_tensor(t, (1, 64, 64), 128, "q", require_cuda=False)
    slot = native.map_slot(3, 1, spec)
    a = driver_arguments(spec)
    assert slot[:2] == (3, 1)
    assert slot[3:7] == ((128, 64, 2), (256, 256 * 64), (64, 64, 1), (1, 1, 1))
    assert slot[2] == int(a["tensorDataType"]) and slot[8] == int(a["swizzle"])


def test_the_knob_turns_the_path_off(monkeypatch):
    monkeypatch.setenv("WSCHED_NATIVE_LAUNCH", "0")
    assert not native.available() and native.available.reason == "WSCHED_NATIVE_LAUNCH=0"
    monkeypatch.delenv("WSCHED_NATIVE_LAUNCH")
    assert native.available()


HELPER_HANDLE = 0xBEEF0


def test_a_plans_helper_launches_first_with_the_ids_and_a_scratch_table_the_kernel_then_reads(driver):
    """A plan with a scratch tensor and a helper launch (a spans table): each call allocates the
    table as planned (torch.empty's arguments; not returned, released when the call returns),
    launches the helper with its own grid, block and scalars and the pointers of the given ids
    and the table, then the kernel with the table's pointer in its slot."""
    import weakref

    driver.helper_sizes = {HELPER_HANDLE: [8, 8, 8, 4]}
    allocated = []

    def empty(*shape, **kwargs):
        t = torch.empty(*shape, **kwargs)
        allocated.append((shape, kwargs["dtype"], weakref.ref(t), t.data_ptr()))
        return t
    launcher = native.launcher(driver.entry_points(), stream=driver.stream, empty=empty)
    a, b = torch.randn(4, 16), torch.randn(16, 8)
    helper = (HELPER_HANDLE, 6, 256, 0, (bytes(8), bytes(8), bytes(8), struct.pack("<i", 77)),
              ((0, 1), (1, 0), (2, 3)))   # (ids b, ids a, the table: tensor 3 = the first scratch)
    launcher.add(Plan(*layouts(a, b), ((4, 8),), ({"dtype": torch.bfloat16, "device": torch.device("cpu")},), 1,
                      FUNCTION_HANDLE, CONTEXT_HANDLE, 132, 384, 1024, 0,
                      (bytes(8), bytes(8), bytes(8), struct.pack("<i", 4), struct.pack("<f", 0.5)),
                      ((0, 0), (1, 3), (2, 2)), (), (((2, 3, 4), {"dtype": torch.int32}),), (helper,)))
    for call in range(2):
        out = launcher((a, b))
        assert isinstance(out, torch.Tensor) and out.shape == (4, 8) and out.dtype == torch.bfloat16
        (out_shape, out_dtype, out_ref, _), (table_shape, table_dtype, table_ref, table) = allocated[2 * call:]
        assert (out_shape, out_dtype, table_shape, table_dtype) == ((4, 8), torch.bfloat16, (2, 3, 4), torch.int32)
        assert out_ref() is out and table_ref() is None   # the table is released when the call returns
        spans, kernel = driver.launches[2 * call:]
        assert (spans["function"], spans["grid"], spans["block"], spans["smem"]) == (HELPER_HANDLE, (6, 1, 1),
                                                                                     (256, 1, 1), 0)
        assert spans["stream"] == kernel["stream"] == 0x5000
        assert [pointer(p) for p in spans["params"][:3]] == [b.data_ptr(), a.data_ptr(), table]
        assert spans["params"][3] == struct.pack("<i", 77)
        assert kernel["function"] == FUNCTION_HANDLE
        assert [pointer(p) for p in kernel["params"][:3]] == [a.data_ptr(), table, out.data_ptr()]
        assert kernel["params"][3:] == [struct.pack("<i", 4), struct.pack("<f", 0.5)]


@pytest.mark.parametrize("fault", [HELPER_HANDLE, FUNCTION_HANDLE])
def test_a_failed_helper_or_kernel_launch_is_a_miss(driver, fault):
    """A driver error on the helper's launch or the kernel's returns None: the Python path runs
    the whole call again, helper included, and reports it."""
    driver.helper_sizes = {HELPER_HANDLE: [8]}
    launcher = make_launcher(driver)
    a, b = torch.randn(4, 16), torch.randn(16, 8)
    launcher.add(Plan(*layouts(a, b), ((4, 8),), ({"dtype": torch.bfloat16, "device": torch.device("cpu")},), 1,
                      FUNCTION_HANDLE, CONTEXT_HANDLE, 132, 384, 1024, 0,
                      (bytes(8), bytes(8), bytes(8), struct.pack("<i", 4), struct.pack("<f", 0.5)),
                      ((0, 0), (1, 3), (2, 2)), (), (((8,), {"dtype": torch.int32}),),
                      ((HELPER_HANDLE, 1, 32, 0, (bytes(8),), ((0, 3),)),)))
    assert launcher((a, b)) is not None
    driver.failing = fault
    assert launcher((a, b)) is None
    assert [x["function"] for x in driver.launches[2:]] == [HELPER_HANDLE, FUNCTION_HANDLE][:1 + (fault == FUNCTION_HANDLE)]
    assert launcher.stats() == {"hits": 1, "misses": 1, "plans": 1}


@pytest.mark.parametrize("bad, message", [
    (dict(scratch=[((8,), {})]), "scratch must be a tuple"),
    (dict(scratch=(((8,), {}), ((8,),))), "a scratch entry must be \\(args tuple, kwargs dict\\)"),
    (dict(scratch=(([8], {}),)), "a scratch entry must be \\(args tuple, kwargs dict\\)"),
    (dict(pre=((HELPER_HANDLE, 1, 32, 0, (bytes(8),), ((0, 4),)),)), "pointer slot out of range"),
    (dict(pre=((HELPER_HANDLE, 1, 32, 0, (bytes(8),), ((1, 0),)),)), "pointer slot out of range"),
    (dict(pre=((HELPER_HANDLE, 1, 32, 0, (bytes(8),), ((0, 0),)),) * 5), "tensor counts out of range"),
])
def test_a_plans_scratch_and_helpers_are_checked(bad, message):
    a, b = torch.randn(4, 16), torch.randn(16, 8)
    args = (*layouts(a, b), ((4, 8),), ({"dtype": torch.bfloat16, "device": torch.device("cpu")},), 1,
            FUNCTION_HANDLE, CONTEXT_HANDLE, 132, 384, 1024, 0, (bytes(8),) * 3, ((0, 0),), (),
            bad.get("scratch", (((8,), {"dtype": torch.int32}),)), bad.get("pre", ()))
    with pytest.raises(ValueError, match=message):
        Plan(*args)


def test_a_plan_whose_init_failed_after_taking_its_tuples_cannot_be_initialised_again():
    """A failed init that already holds references (a bad scratch entry comes after the layout
    tuples) refuses a second init instead of overwriting them."""
    import sys

    a, b = torch.randn(4, 16), torch.randn(16, 8)
    shapes = layouts(a, b)[0]
    args = [shapes, *layouts(a, b)[1:], ((4, 8),), ({"dtype": torch.bfloat16, "device": torch.device("cpu")},), 1,
            FUNCTION_HANDLE, CONTEXT_HANDLE, 132, 384, 1024, 0, (bytes(8),) * 3, ((0, 0),), ()]
    refs = sys.getrefcount(shapes)
    plan = Plan.__new__(Plan)
    with pytest.raises(ValueError, match="a scratch entry"):
        plan.__init__(*args, (((8,),),), ())
    with pytest.raises(RuntimeError, match="Plan: already initialised"):
        plan.__init__(*args, (), ())
    del plan
    assert sys.getrefcount(shapes) == refs


# -- a compiled kernel's calls: the native launch repeats the Python path's --------------------


def native_on_fake_gpu(monkeypatch, fusion):
    """(FakeGpu, its compiled kernel) with the native path on: the fake stands in for the loaded
    module (function, threads, shared memory) and the device's primary context."""
    from test_launch_args import FakeGpu

    from wsched.codegen import cuda_driver

    gpu = FakeGpu(monkeypatch)
    k = gpu.compile(fusion)
    k._native = True
    gpu._functions = {0: FUNCTION_HANDLE}
    gpu.threads, gpu.smem_bytes = k.kernel.threads, k.kernel.smem_bytes
    monkeypatch.setitem(cuda_driver._primary_handles, 0, CONTEXT_HANDLE)
    return gpu, k


@pytest.mark.parametrize("call", ["matmul", "attention_lse"])
def test_a_kernels_second_call_launches_natively_with_the_python_paths_arguments(monkeypatch, call):
    """The first two calls of a layout take the Python path (FakeGpu records the bytes it packs),
    the second installs a plan; the third is launched by the native path (FakeDriver records its bytes).
    Every parameter but the tensor maps has the same bytes; each map is encoded from the
    address and layout the Python path used, once."""
    from test_launch_args import _attention_call, _matmul_call

    from wsched.codegen.launch import PARAM_BYTES
    from wsched.lowering import ir

    fusion, tensors, out, _ = (_matmul_call if call == "matmul" else _attention_call)()
    gpu, k = native_on_fake_gpu(monkeypatch, fusion)
    kinds = ["tensor_map" if isinstance(p, ir.TensorMapParam) else "ptr" if isinstance(p, ir.GlobalParam)
             else p.dtype for p in k.kernel.params]
    driver = FakeDriver([PARAM_BYTES.get(kind, 4) if kind != "ptr" else 8 for kind in kinds])
    real = native.launcher
    monkeypatch.setattr(native, "launcher", lambda: real(driver.entry_points(), stream=driver.stream))

    k(*tensors, out=out)
    k(*tensors, out=out)               # the layout's second call hands its plan over
    third = k(*tensors, out=out)
    assert (third if isinstance(third, tuple) else (third,)) == tuple(out.values())
    (python_grid, python_raw, _), _ = gpu.launches
    (launch,) = driver.launches
    assert launch["grid"] == (python_grid, 1, 1) and launch["function"] == FUNCTION_HANDLE
    assert launch["block"] == (k.kernel.threads, 1, 1) and launch["smem"] == k.kernel.smem_bytes
    for kind, ours, theirs in zip(kinds, launch["params"], python_raw):
        if kind != "tensor_map":
            assert ours == theirs[:len(ours)], kind
    by_name = {p: t for p, t in zip(k._plans[next(iter(k._plans))].inputs, tensors)} | out
    maps = [p for p in k.kernel.params if isinstance(p, ir.TensorMapParam)]
    assert [e["address"] for e in driver.encodes] == [by_name[p.name].data_ptr() for p in maps]
    assert [tuple(reversed(e["box"])) for e in driver.encodes] == [tuple(p.box) for p in maps]
    assert k._natives[tuple(out)].stats() == {"hits": 1, "misses": 0, "plans": 1}


def test_a_document_masks_call_launches_its_spans_helper_then_the_kernel_natively(monkeypatch):
    """A kernel with a spans table (a document mask) is planned too: its third call launches the
    helper with the bytes the Python path packed for it (the ids' pointers), then the kernel with
    the Python path's bytes but the table's pointer, which is the helper's new table."""
    from attention_fusions import make_variant, variant_inputs

    from wsched.codegen import block_spans
    from wsched.codegen.launch import PARAM_BYTES
    from wsched.lowering import ir

    fusion = make_variant(128, "document")
    q, k_, v, doc_q, doc_k = variant_inputs(fusion, 2, 2, 150, 150, 128)
    gpu, k = native_on_fake_gpu(monkeypatch, fusion)

    class Helper:   # the spans helper's LoadedKernel: the Python path's launches recorded
        _functions = {0: HELPER_HANDLE}
        launches = []

        def launch_packed(self, grid, packed, device_index):
            self.launches.append((grid, packed.raw()))
    monkeypatch.setattr(block_spans, "_loaded", Helper)
    kinds = ["tensor_map" if isinstance(p, ir.TensorMapParam) else "ptr" if isinstance(p, ir.GlobalParam)
             else p.dtype for p in k.kernel.params]
    driver = FakeDriver([PARAM_BYTES.get(kind, 4) if kind != "ptr" else 8 for kind in kinds],
                        {HELPER_HANDLE: [PARAM_BYTES.get("ptr", 8)] * 3 + [4] * 19})
    real = native.launcher
    cpu_empty = lambda *shape, dtype, device: torch.empty(*shape, dtype=dtype)   # noqa: E731 (the table)
    monkeypatch.setattr(native, "launcher", lambda: real(driver.entry_points(), stream=driver.stream,
                                                         empty=cpu_empty))

    out = {"o": torch.empty(2, 2, 150, 128, dtype=torch.bfloat16), "lse": torch.empty(2, 2, 150)}
    for _ in range(3):   # the second call hands its plan over
        assert k(q, k_, v, doc_q, doc_k, out=out) == tuple(out.values())
    assert k._natives[tuple(out)].stats() == {"hits": 1, "misses": 0, "plans": 1}
    (helper_grid, helper_raw), _ = Helper.launches
    (python_grid, python_raw, _), _ = gpu.launches
    spans, kernel = driver.launches
    assert spans["function"] == HELPER_HANDLE and spans["grid"] == (helper_grid, 1, 1)
    assert spans["block"] == (block_spans.THREADS, 1, 1) and spans["smem"] == 0
    assert [pointer(x) for x in spans["params"][:2]] == [doc_q.data_ptr(), doc_k.data_ptr()]
    assert spans["params"][3:] == [x[:4] for x in helper_raw[3:]]
    table = pointer(spans["params"][2])
    assert kernel["function"] == FUNCTION_HANDLE and kernel["grid"] == (python_grid, 1, 1)
    (position,) = [i for i, p in enumerate(k.kernel.params) if isinstance(p, ir.SpanParam)]
    for i, (kind, ours, theirs) in enumerate(zip(kinds, kernel["params"], python_raw)):
        if i == position:
            assert pointer(ours) == table
        elif kind != "tensor_map":
            assert ours == theirs[:len(ours)], k.kernel.params[i].name


def test_a_failed_install_never_fails_a_call_that_launched(monkeypatch):
    """Handing a plan over happens after the launch: if it raises, the call still returns its
    outputs, the kernel warns once and takes the Python path from then on."""
    from test_launch_args import _matmul_call

    fusion, tensors, out, _ = _matmul_call()
    gpu, k = native_on_fake_gpu(monkeypatch, fusion)
    monkeypatch.setattr(native, "launcher", lambda: (_ for _ in ()).throw(OSError("libcuda.so.1: cannot open")))
    k(*tensors, out=out)
    with pytest.warns(UserWarning, match=r"the native launch path is off for this kernel \(OSError: libcuda"):
        assert k(*tensors, out=out) is out["out"]
    assert not k._native and len(gpu.launches) == 2
    k(*tensors, out=out)
    assert len(gpu.launches) == 3
