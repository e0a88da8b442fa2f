/* The eager call's native fast path: a launch of a compiled kernel with no Python in between.
 *
 * `CompiledKernel.__call__` first hands its arguments to a `Launcher`. The launcher holds the
 * `Plan`s of argument layouts seen before (built by the Python call path the first time a layout
 * is seen, codegen/native.py). A call whose tensors match a plan's layouts exactly (type, shape,
 * strides, dtype, device) is launched here: outputs allocated through torch.empty, data pointers
 * written into the plan's parameter storage, TMA maps taken from a per-parameter cache of
 * encoded maps by address (cuTensorMapEncodeTiled on a new address), torch's current stream
 * read, cuLaunchKernel. Anything else — a layout not seen, a tensor subclass, a base address that
 * breaks TMA's alignment, another context current, a driver error — returns None, and the Python
 * path runs the call, checks everything and says what is wrong. So this file never decides an
 * error message: it only repeats, for a layout the Python path has accepted, what that path does.
 *
 * A plan may launch helper kernels first, on the same stream (a document mask's spans table:
 * codegen/block_spans.py): each with its own packed parameters and data pointers, reading the
 * call's tensors and writing scratch tensors allocated per call like the outputs (torch.empty),
 * which the kernel then reads. A scratch tensor is released when the call returns: torch's
 * allocator hands its memory out again only to work queued after these launches on the stream,
 * and under CUDA graph capture it comes from the graph's pool, as the outputs do.
 *
 * The driver entry points and the torch callables are given to the Launcher (plain addresses and
 * Python objects), so the module links against nothing but Python and the tests drive it on a
 * machine without a GPU through stand-ins.
 *
 * Threads: the GIL is held throughout. Python calls (attribute reads, torch.empty, the stream
 * query) come first and may let another thread run; the parameter storage and the map cache are
 * written only after the last of them, between one GIL-holding stretch and the launch, so two
 * threads never interleave their writes with a launch. A matched plan is referenced for the whole
 * call, so a plan evicted meanwhile stays alive.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef CUresult (*launch_fn)(void *function, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                              unsigned by, unsigned bz, unsigned smem, void *stream, void **params,
                              void **extra);
typedef CUresult (*context_fn)(void **context);
typedef CUresult (*encode_fn)(void *map, int dtype, uint32_t rank, void *address, const uint64_t *dims,
                              const uint64_t *strides, const uint32_t *box, const uint32_t *element_strides,
                              int interleave, int swizzle, int l2_promotion, int oob_fill);

#define NATIVE_ABI 3      /* codegen/native.py refuses a build of another ABI (a stale in-place .so) */
#define PARAM_BYTES 128   /* the largest parameter: a CUtensorMap */
#define MAP_ALIGN 64      /* a CUtensorMap is 64-byte aligned */
#define MAX_RANK 5        /* TMA's rank limit */
#define MAPS_PER_SLOT 8   /* encoded maps kept per parameter (by address) */
#define MAX_TENSORS 32    /* tensors of a call: inputs, outputs and scratch */
#define MAX_PRE 4         /* helper launches before the kernel */

/* ------------------------------------------------------------------------------------ Plan */

static PyObject *s_shape, *s_stride, *s_dtype, *s_device, *s_data_ptr;

/* a tensor's data_ptr() */
static int read_address(PyObject *t, uint64_t *address) {
    PyObject *value = PyObject_CallMethodNoArgs(t, s_data_ptr);
    if (!value) return -1;
    *address = PyLong_AsUnsignedLongLong(value);
    Py_DECREF(value);
    return PyErr_Occurred() ? -1 : 0;
}


typedef struct {
    Py_ssize_t param;            /* parameter index */
    Py_ssize_t tensor;           /* index into (*given, *allocated outputs, *scratch) */
} PointerSlot;

typedef struct {
    Py_ssize_t param, tensor;
    int dtype, interleave, swizzle, l2_promotion, oob_fill;
    uint32_t rank;
    uint64_t dims[MAX_RANK], strides[MAX_RANK];
    uint32_t box[MAX_RANK], element_strides[MAX_RANK];
    int count, next;             /* the cache below: entries used, the one replaced next */
    uint64_t addresses[MAPS_PER_SLOT];
    unsigned char *maps;         /* MAPS_PER_SLOT * PARAM_BYTES, MAP_ALIGN-aligned */
} MapSlot;

typedef struct {                 /* a launch of a helper kernel before the plan's own */
    void *function;
    unsigned grid, threads, smem;
    Py_ssize_t n_params, n_pointers;
    unsigned char *storage;      /* n_params * PARAM_BYTES */
    void **kernel_params;
    PointerSlot *pointers;       /* tensor: an index into (*given, *allocated outputs, *scratch) */
} PreLaunch;

typedef struct {
    PyObject_HEAD
    int ready;                   /* Plan_init ran to the end */
    Py_ssize_t n_given;          /* tensors the call passes */
    PyObject *shapes, *strides, *dtypes, *devices;   /* tuples of n_given each */
    PyObject *alloc_args, *alloc_kwargs;            /* tuples: per allocated output */
    PyObject *scratch;           /* tuple of (args, kwargs) of torch.empty: per scratch tensor (not returned) */
    Py_ssize_t n_alloc, n_scratch, n_return;
    void *function, *context;
    unsigned grid, threads, smem;
    PyObject *stream_arg;
    Py_ssize_t n_params;
    unsigned char *storage;      /* n_params * PARAM_BYTES */
    void **kernel_params;
    Py_ssize_t n_pointers, n_maps;
    PointerSlot *pointers;
    MapSlot *map_slots;
    Py_ssize_t n_pre;
    PreLaunch pre[MAX_PRE];
} Plan;

static void *aligned_zeroed(size_t bytes) {
    size_t rounded = (bytes + MAP_ALIGN - 1) / MAP_ALIGN * MAP_ALIGN;
    void *p = aligned_alloc(MAP_ALIGN, rounded ? rounded : MAP_ALIGN);
    if (p) memset(p, 0, rounded ? rounded : MAP_ALIGN);
    return p;
}

static void Plan_dealloc(Plan *self) {
    Py_XDECREF(self->shapes);
    Py_XDECREF(self->strides);
    Py_XDECREF(self->dtypes);
    Py_XDECREF(self->devices);
    Py_XDECREF(self->alloc_args);
    Py_XDECREF(self->alloc_kwargs);
    Py_XDECREF(self->scratch);
    Py_XDECREF(self->stream_arg);
    for (Py_ssize_t i = 0; i < self->n_pre; i++) {
        free(self->pre[i].storage);
        free(self->pre[i].kernel_params);
        free(self->pre[i].pointers);
    }
    free(self->storage);
    free(self->kernel_params);
    free(self->pointers);
    if (self->map_slots) {
        for (Py_ssize_t i = 0; i < self->n_maps; i++) free(self->map_slots[i].maps);
        free(self->map_slots);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int read_u64s(PyObject *seq, uint64_t *out, Py_ssize_t n, const char *what) {
    if (!PyTuple_Check(seq) || PyTuple_GET_SIZE(seq) != n) {
        PyErr_Format(PyExc_ValueError, "Plan: %s must be a tuple of %zd ints", what, n);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        out[i] = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(seq, i));
        if (PyErr_Occurred()) return -1;
    }
    return 0;
}

static int tuple_of(PyObject *value, Py_ssize_t n, const char *what) {
    if (!PyTuple_Check(value) || (n >= 0 && PyTuple_GET_SIZE(value) != n)) {
        PyErr_Format(PyExc_ValueError, "Plan: %s must be a tuple of %zd items", what, n);
        return -1;
    }
    return 0;
}

/* Parameter storage from a tuple of bytes objects (each at most PARAM_BYTES). */
static int read_params(PyObject *params, unsigned char **storage, void ***kernel_params) {
    Py_ssize_t n = PyTuple_GET_SIZE(params);
    *storage = aligned_zeroed((size_t)n * PARAM_BYTES);
    *kernel_params = calloc(n ? n : 1, sizeof(void *));
    if (!*storage || !*kernel_params) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        char *bytes;
        Py_ssize_t size;
        if (PyBytes_AsStringAndSize(PyTuple_GET_ITEM(params, i), &bytes, &size) < 0) return -1;
        if (size > PARAM_BYTES) {
            PyErr_Format(PyExc_ValueError, "Plan: parameter %zd has %zd bytes (at most %d)", i, size, PARAM_BYTES);
            return -1;
        }
        memcpy(*storage + i * PARAM_BYTES, bytes, size);
        (*kernel_params)[i] = *storage + i * PARAM_BYTES;
    }
    return 0;
}

/* Pointer slots from a tuple of (param, tensor) pairs, each in range. */
static int read_pointer_slots(PyObject *slots, PointerSlot **out, Py_ssize_t *count, Py_ssize_t n_params,
                              Py_ssize_t n_tensors) {
    Py_ssize_t n = *count = PyTuple_GET_SIZE(slots);
    *out = calloc(n ? n : 1, sizeof(PointerSlot));
    if (!*out) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PointerSlot *slot = &(*out)[i];
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(slots, i), "nn", &slot->param, &slot->tensor)) return -1;
        if (slot->param < 0 || slot->param >= n_params || slot->tensor < 0 || slot->tensor >= n_tensors) {
            PyErr_SetString(PyExc_ValueError, "Plan: pointer slot out of range");
            return -1;
        }
    }
    return 0;
}

/* Plan(shapes, strides, dtypes, devices, alloc_args, alloc_kwargs, n_return, function, context,
 *      grid, threads, smem, stream_arg, params, pointer_slots, map_slots[, scratch, pre_launches])
 * map_slots: tuples (param, tensor, dtype, dims, strides, box, element_strides, interleave,
 * swizzle, l2_promotion, oob_fill) with dims etc. as cuTensorMapEncodeTiled takes them.
 * pre_launches: tuples (function, grid, threads, smem, params, pointer_slots), launched in order
 * before the kernel; scratch: (args tuple, kwargs dict) of torch.empty per scratch tensor, allocated
 * per call. Tensor indices count (*given, *allocated outputs, *scratch). */
static int Plan_fill(Plan *self, PyObject *shapes, PyObject *strides, PyObject *dtypes, PyObject *devices,
                     PyObject *alloc_args, PyObject *alloc_kwargs, Py_ssize_t n_return, unsigned long long function,
                     unsigned long long context, unsigned grid, unsigned threads, unsigned smem, PyObject *stream_arg,
                     PyObject *params, PyObject *pointer_slots, PyObject *map_slots, PyObject *scratch,
                     PyObject *pre_launches);

static int Plan_init(Plan *self, PyObject *args, PyObject *kwargs) {
    PyObject *shapes, *strides, *dtypes, *devices, *alloc_args, *alloc_kwargs, *stream_arg, *params;
    PyObject *pointer_slots, *map_slots;
    PyObject *scratch = NULL, *pre_launches = NULL;
    Py_ssize_t n_return;
    unsigned long long function, context;
    unsigned grid, threads, smem;
    if (!PyArg_ParseTuple(args, "OOOOOOnKKIIIOOOO|OO", &shapes, &strides, &dtypes, &devices, &alloc_args,
                          &alloc_kwargs, &n_return, &function, &context, &grid, &threads, &smem,
                          &stream_arg, &params, &pointer_slots, &map_slots, &scratch, &pre_launches))
        return -1;
    if (self->storage || self->shapes) {   /* a failed init may have kept references: no second one */
        PyErr_SetString(PyExc_RuntimeError, "Plan: already initialised");
        return -1;
    }
    PyObject *none = PyTuple_New(0);   /* the optional two default to empty tuples */
    if (!none) return -1;
    int result = Plan_fill(self, shapes, strides, dtypes, devices, alloc_args, alloc_kwargs, n_return, function,
                           context, grid, threads, smem, stream_arg, params, pointer_slots, map_slots,
                           scratch ? scratch : none, pre_launches ? pre_launches : none);
    Py_DECREF(none);
    return result;
}

static int Plan_fill(Plan *self, PyObject *shapes, PyObject *strides, PyObject *dtypes, PyObject *devices,
                     PyObject *alloc_args, PyObject *alloc_kwargs, Py_ssize_t n_return, unsigned long long function,
                     unsigned long long context, unsigned grid, unsigned threads, unsigned smem, PyObject *stream_arg,
                     PyObject *params, PyObject *pointer_slots, PyObject *map_slots, PyObject *scratch,
                     PyObject *pre_launches) {
    if (tuple_of(shapes, -1, "shapes") < 0) return -1;
    Py_ssize_t n_given = PyTuple_GET_SIZE(shapes);
    if (tuple_of(strides, n_given, "strides") < 0 || tuple_of(dtypes, n_given, "dtypes") < 0 ||
        tuple_of(devices, n_given, "devices") < 0 || tuple_of(alloc_args, -1, "alloc_args") < 0 ||
        tuple_of(alloc_kwargs, PyTuple_GET_SIZE(alloc_args), "alloc_kwargs") < 0 ||
        tuple_of(params, -1, "params") < 0 || tuple_of(pointer_slots, -1, "pointer_slots") < 0 ||
        tuple_of(map_slots, -1, "map_slots") < 0 || tuple_of(scratch, -1, "scratch") < 0 ||
        tuple_of(pre_launches, -1, "pre_launches") < 0)
        return -1;
    Py_ssize_t n_alloc = PyTuple_GET_SIZE(alloc_args), n_scratch = PyTuple_GET_SIZE(scratch);
    if (n_given + n_alloc + n_scratch > MAX_TENSORS || n_return < 1 || n_return > n_given + n_alloc ||
        PyTuple_GET_SIZE(pre_launches) > MAX_PRE) {
        PyErr_SetString(PyExc_ValueError, "Plan: tensor counts out of range");
        return -1;
    }
    Py_INCREF(shapes); self->shapes = shapes;
    Py_INCREF(strides); self->strides = strides;
    Py_INCREF(dtypes); self->dtypes = dtypes;
    Py_INCREF(devices); self->devices = devices;
    Py_INCREF(alloc_args); self->alloc_args = alloc_args;
    Py_INCREF(alloc_kwargs); self->alloc_kwargs = alloc_kwargs;
    Py_INCREF(stream_arg); self->stream_arg = stream_arg;
    self->n_given = n_given;
    self->n_alloc = n_alloc;
    self->n_scratch = n_scratch;
    for (Py_ssize_t j = 0; j < n_scratch; j++) {
        PyObject *entry = PyTuple_GET_ITEM(scratch, j);
        if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != 2 || !PyTuple_Check(PyTuple_GET_ITEM(entry, 0)) ||
            !PyDict_Check(PyTuple_GET_ITEM(entry, 1))) {
            PyErr_SetString(PyExc_ValueError, "Plan: a scratch entry must be (args tuple, kwargs dict)");
            return -1;
        }
    }
    Py_INCREF(scratch); self->scratch = scratch;
    self->n_return = n_return;
    self->function = (void *)(uintptr_t)function;
    self->context = (void *)(uintptr_t)context;
    self->grid = grid;
    self->threads = threads;
    self->smem = smem;

    Py_ssize_t n_params = self->n_params = PyTuple_GET_SIZE(params);
    Py_ssize_t n_tensors = n_given + n_alloc + n_scratch;
    if (read_params(params, &self->storage, &self->kernel_params) < 0 ||
        read_pointer_slots(pointer_slots, &self->pointers, &self->n_pointers, n_params, n_tensors) < 0)
        return -1;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(pre_launches); i++) {
        PreLaunch *pre = &self->pre[i];
        PyObject *pre_params, *pre_slots;
        unsigned long long pre_function;
        self->n_pre = i + 1;   /* freed by the dealloc from here */
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(pre_launches, i), "KIIIO!O!", &pre_function, &pre->grid,
                              &pre->threads, &pre->smem, &PyTuple_Type, &pre_params, &PyTuple_Type, &pre_slots))
            return -1;
        pre->function = (void *)(uintptr_t)pre_function;
        pre->n_params = PyTuple_GET_SIZE(pre_params);
        if (read_params(pre_params, &pre->storage, &pre->kernel_params) < 0 ||
            read_pointer_slots(pre_slots, &pre->pointers, &pre->n_pointers, pre->n_params, n_tensors) < 0)
            return -1;
    }
    self->n_maps = PyTuple_GET_SIZE(map_slots);
    self->map_slots = calloc(self->n_maps ? self->n_maps : 1, sizeof(MapSlot));
    if (!self->map_slots) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < self->n_maps; i++) {
        MapSlot *slot = &self->map_slots[i];
        PyObject *dims, *map_strides, *box, *element_strides;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(map_slots, i), "nniOOOOiiii", &slot->param, &slot->tensor,
                              &slot->dtype, &dims, &map_strides, &box, &element_strides, &slot->interleave,
                              &slot->swizzle, &slot->l2_promotion, &slot->oob_fill))
            return -1;
        if (slot->param < 0 || slot->param >= n_params || slot->tensor < 0 || slot->tensor >= n_tensors ||
            !PyTuple_Check(dims) || PyTuple_GET_SIZE(dims) < 1 || PyTuple_GET_SIZE(dims) > MAX_RANK) {
            PyErr_SetString(PyExc_ValueError, "Plan: map slot out of range");
            return -1;
        }
        Py_ssize_t rank = PyTuple_GET_SIZE(dims);
        uint64_t box64[MAX_RANK], element64[MAX_RANK];
        slot->rank = (uint32_t)rank;
        if (read_u64s(dims, slot->dims, rank, "dims") < 0 || read_u64s(map_strides, slot->strides, rank - 1, "strides") < 0 ||
            read_u64s(box, box64, rank, "box") < 0 || read_u64s(element_strides, element64, rank, "element strides") < 0)
            return -1;
        for (Py_ssize_t d = 0; d < rank; d++) {
            slot->box[d] = (uint32_t)box64[d];
            slot->element_strides[d] = (uint32_t)element64[d];
        }
        slot->maps = aligned_zeroed(MAPS_PER_SLOT * PARAM_BYTES);
        if (!slot->maps) {
            PyErr_NoMemory();
            return -1;
        }
    }
    self->ready = 1;
    return 0;
}

static PyTypeObject PlanType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "wsched.codegen._native_launch.Plan",
    .tp_basicsize = sizeof(Plan),
    .tp_dealloc = (destructor)Plan_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One argument layout of a kernel, packed for the native launch.",
    .tp_init = (initproc)Plan_init,
    .tp_new = PyType_GenericNew,
};

/* ------------------------------------------------------------------------------------ Launcher */

typedef struct {
    PyObject_HEAD
    launch_fn launch;
    context_fn current_context;
    encode_fn encode;
    PyObject *stream_fn, *empty_fn, *tensor_types;   /* tensor_types: exact types a call may pass */
    Py_ssize_t capacity, count;
    PyObject **plans;            /* owned; the newest first */
    unsigned long long hits, misses;
} Launcher;

static void Launcher_clear_plans(Launcher *self) {
    for (Py_ssize_t i = 0; i < self->count; i++) Py_CLEAR(self->plans[i]);
    self->count = 0;
}

static void Launcher_dealloc(Launcher *self) {
    if (self->plans) {
        Launcher_clear_plans(self);
        free(self->plans);
    }
    Py_XDECREF(self->stream_fn);
    Py_XDECREF(self->empty_fn);
    Py_XDECREF(self->tensor_types);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Launcher(launch, current_context, encode, stream_fn, empty_fn, tensor_types, capacity)
 * launch / current_context / encode: addresses of cuLaunchKernel, cuCtxGetCurrent and
 * cuTensorMapEncodeTiled (or stand-ins with their signatures). */
static int Launcher_init(Launcher *self, PyObject *args, PyObject *kwargs) {
    unsigned long long launch, current_context, encode;
    PyObject *stream_fn, *empty_fn, *tensor_types;
    Py_ssize_t capacity;
    if (!PyArg_ParseTuple(args, "KKKOOOn", &launch, &current_context, &encode, &stream_fn, &empty_fn,
                          &tensor_types, &capacity))
        return -1;
    if (self->plans) {
        PyErr_SetString(PyExc_RuntimeError, "Launcher: already initialised");
        return -1;
    }
    if (!launch || !current_context || !encode || capacity < 1 || !PyTuple_Check(tensor_types) ||
        !PyCallable_Check(stream_fn) || !PyCallable_Check(empty_fn)) {
        PyErr_SetString(PyExc_ValueError, "Launcher: bad arguments");
        return -1;
    }
    self->launch = (launch_fn)(uintptr_t)launch;
    self->current_context = (context_fn)(uintptr_t)current_context;
    self->encode = (encode_fn)(uintptr_t)encode;
    Py_INCREF(stream_fn); self->stream_fn = stream_fn;
    Py_INCREF(empty_fn); self->empty_fn = empty_fn;
    Py_INCREF(tensor_types); self->tensor_types = tensor_types;
    self->capacity = capacity;
    self->plans = calloc(capacity, sizeof(PyObject *));
    if (!self->plans) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

/* add(plan): the plan is tried first from now on; the least recently used is dropped past the
 * capacity (a hit moves its plan to the front). */
static PyObject *Launcher_add(Launcher *self, PyObject *plan) {
    if (!PyObject_TypeCheck(plan, &PlanType) || !((Plan *)plan)->ready) {
        PyErr_SetString(PyExc_TypeError, "Launcher.add takes an initialised Plan");
        return NULL;
    }
    if (self->count == self->capacity) {
        Py_CLEAR(self->plans[self->count - 1]);
        self->count--;
    }
    memmove(self->plans + 1, self->plans, self->count * sizeof(PyObject *));
    Py_INCREF(plan);
    self->plans[0] = plan;
    self->count++;
    Py_RETURN_NONE;
}

/* holds(plan): whether the plan is among those tried (it may have been dropped since it was added). */
static PyObject *Launcher_holds(Launcher *self, PyObject *plan) {
    for (Py_ssize_t i = 0; i < self->count; i++)
        if (self->plans[i] == plan) Py_RETURN_TRUE;
    Py_RETURN_FALSE;
}

static PyObject *Launcher_clear(Launcher *self, PyObject *unused) {
    Launcher_clear_plans(self);
    Py_RETURN_NONE;
}

static PyObject *Launcher_stats(Launcher *self, PyObject *unused) {
    return Py_BuildValue("{s:K,s:K,s:n}", "hits", self->hits, "misses", self->misses, "plans", self->count);
}

static int exact_tensor(Launcher *self, PyObject *t) {
    PyObject *type = (PyObject *)Py_TYPE(t);
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(self->tensor_types); i++)
        if (PyTuple_GET_ITEM(self->tensor_types, i) == type) return 1;
    return 0;
}

/* 0: equal; 1: not equal; -1: error */
static int differs(PyObject *a, PyObject *b) {
    if (a == b) return 0;
    int equal = PyObject_RichCompareBool(a, b, Py_EQ);
    return equal < 0 ? -1 : !equal;
}

/* launcher(tensors): the kernel's outputs (one tensor, or a tuple), or None where the Python
 * path must run the call. */
static PyObject *Launcher_call(Launcher *self, PyObject *args, PyObject *kwargs) {
    PyObject *tensors;
    if (!PyArg_ParseTuple(args, "O!", &PyTuple_Type, &tensors)) return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(tensors);
    PyObject *shapes[MAX_TENSORS] = {0}, *strides[MAX_TENSORS] = {0}, *dtypes[MAX_TENSORS] = {0},
             *devices[MAX_TENSORS] = {0}, *allocated[MAX_TENSORS] = {0};
    uint64_t addresses[MAX_TENSORS];
    Plan *plan = NULL;
    PyObject *result = NULL, *stream_value = NULL;
    int failed = 0;   /* a Python error to raise (not a miss) */

    if (n > MAX_TENSORS || self->count == 0) goto miss;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *t = PyTuple_GET_ITEM(tensors, i);
        if (!exact_tensor(self, t)) goto miss;
        if (!(shapes[i] = PyObject_GetAttr(t, s_shape)) || !(strides[i] = PyObject_CallMethodNoArgs(t, s_stride)) ||
            !(dtypes[i] = PyObject_GetAttr(t, s_dtype)) || !(devices[i] = PyObject_GetAttr(t, s_device))) {
            failed = 1;
            goto done;
        }
    }
    Py_ssize_t matched = -1;
    for (Py_ssize_t p = 0; p < self->count && !plan; p++) {
        Plan *candidate = (Plan *)self->plans[p];
        if (candidate->n_given != n) continue;
        int match = 1;
        for (Py_ssize_t i = 0; i < n && match; i++) {
            int d;
            if (dtypes[i] != PyTuple_GET_ITEM(candidate->dtypes, i) ||
                (d = differs(shapes[i], PyTuple_GET_ITEM(candidate->shapes, i))) ||
                (d = differs(strides[i], PyTuple_GET_ITEM(candidate->strides, i))) ||
                (d = differs(devices[i], PyTuple_GET_ITEM(candidate->devices, i)))) {
                if (PyErr_Occurred()) {
                    failed = 1;
                    goto done;
                }
                match = 0;
            }
        }
        if (match) {
            plan = candidate;
            Py_INCREF(plan);
            matched = p;
        }
    }
    if (!plan) goto miss;
    if (matched > 0) {   /* least recently used last: move the plan to the front */
        memmove(self->plans + 1, self->plans, matched * sizeof(PyObject *));
        self->plans[0] = (PyObject *)plan;
    }
    /* another context current (a thread on another device): the Python path switches; checked
     * before anything is allocated (a driver call, no Python) */
    void *context = NULL;
    if (self->current_context(&context) != 0 || context != plan->context) goto miss;
    for (Py_ssize_t i = 0; i < n; i++)
        if (read_address(PyTuple_GET_ITEM(tensors, i), &addresses[i]) < 0) {
            failed = 1;
            goto done;
        }
    for (Py_ssize_t j = 0; j < plan->n_alloc + plan->n_scratch; j++) {   /* the outputs, then scratch */
        PyObject *args, *kw;
        if (j < plan->n_alloc) {
            args = PyTuple_GET_ITEM(plan->alloc_args, j);
            kw = PyTuple_GET_ITEM(plan->alloc_kwargs, j);
        } else {
            PyObject *entry = PyTuple_GET_ITEM(plan->scratch, j - plan->n_alloc);
            args = PyTuple_GET_ITEM(entry, 0);
            kw = PyTuple_GET_ITEM(entry, 1);
        }
        allocated[j] = PyObject_Call(self->empty_fn, args, kw);
        if (!allocated[j] || read_address(allocated[j], &addresses[n + j]) < 0) {
            failed = 1;
            goto done;
        }
    }
    stream_value = PyObject_CallOneArg(self->stream_fn, plan->stream_arg);
    if (!stream_value) {
        failed = 1;
        goto done;
    }
    void *stream = PyLong_AsVoidPtr(stream_value);
    if (PyErr_Occurred()) {
        failed = 1;
        goto done;
    }

    /* No Python call from here to the launch: this stretch runs under the GIL as one piece. */
    for (Py_ssize_t i = 0; i < plan->n_pointers; i++) {
        PointerSlot *slot = &plan->pointers[i];
        memcpy(plan->storage + slot->param * PARAM_BYTES, &addresses[slot->tensor], sizeof(uint64_t));
    }
    for (Py_ssize_t i = 0; i < plan->n_maps; i++) {
        MapSlot *slot = &plan->map_slots[i];
        uint64_t address = addresses[slot->tensor];
        if (address % 16) goto miss;   /* the Python path names the misaligned tensor */
        int found = -1;
        for (int e = 0; e < slot->count; e++)
            if (slot->addresses[e] == address) {
                found = e;
                break;
            }
        if (found < 0) {
            found = slot->next;
            if (self->encode(slot->maps + found * PARAM_BYTES, slot->dtype, slot->rank, (void *)(uintptr_t)address,
                             slot->dims, slot->strides, slot->box, slot->element_strides, slot->interleave,
                             slot->swizzle, slot->l2_promotion, slot->oob_fill) != 0) {
                slot->count = slot->next = 0;   /* that entry is overwritten: forget them all */
                goto miss;                      /* the Python path encodes again and reports */
            }
            slot->addresses[found] = address;
            if (slot->count < MAPS_PER_SLOT) slot->count++;
            slot->next = (found + 1) % MAPS_PER_SLOT;
        }
        memcpy(plan->storage + slot->param * PARAM_BYTES, slot->maps + found * PARAM_BYTES, PARAM_BYTES);
    }
    /* the helpers first (their tables are the kernel's inputs); a failed launch is a miss: the
     * Python path runs the whole call again, helpers included, and reports the driver's error */
    for (Py_ssize_t h = 0; h < plan->n_pre; h++) {
        PreLaunch *pre = &plan->pre[h];
        for (Py_ssize_t i = 0; i < pre->n_pointers; i++)
            memcpy(pre->storage + pre->pointers[i].param * PARAM_BYTES, &addresses[pre->pointers[i].tensor],
                   sizeof(uint64_t));
        if (self->launch(pre->function, pre->grid, 1, 1, pre->threads, 1, 1, pre->smem, stream,
                         pre->kernel_params, NULL) != 0)
            goto miss;
    }
    if (self->launch(plan->function, plan->grid, 1, 1, plan->threads, 1, 1, plan->smem, stream,
                     plan->kernel_params, NULL) != 0)
        goto miss;   /* the kernel did not run: the Python path launches again and reports the driver's error */

    self->hits++;
    Py_ssize_t total = n + plan->n_alloc;
    if (plan->n_return == 1) {
        Py_ssize_t last = total - 1;
        result = last >= n ? allocated[last - n] : PyTuple_GET_ITEM(tensors, last);
        Py_INCREF(result);
    } else {
        result = PyTuple_New(plan->n_return);
        if (!result) {
            failed = 1;
            goto done;
        }
        for (Py_ssize_t r = 0; r < plan->n_return; r++) {
            Py_ssize_t index = total - plan->n_return + r;
            PyObject *t = index >= n ? allocated[index - n] : PyTuple_GET_ITEM(tensors, index);
            Py_INCREF(t);
            PyTuple_SET_ITEM(result, r, t);
        }
    }
    goto done;

miss:
    self->misses++;
    result = Py_None;
    Py_INCREF(result);
done:
    for (Py_ssize_t i = 0; i < n && i < MAX_TENSORS; i++) {
        Py_XDECREF(shapes[i]);
        Py_XDECREF(strides[i]);
        Py_XDECREF(dtypes[i]);
        Py_XDECREF(devices[i]);
    }
    for (Py_ssize_t j = 0; j < MAX_TENSORS; j++) Py_XDECREF(allocated[j]);
    Py_XDECREF(stream_value);
    Py_XDECREF((PyObject *)plan);
    if (failed) {
        Py_XDECREF(result);
        return NULL;
    }
    return result;
}

static PyMethodDef Launcher_methods[] = {
    {"add", (PyCFunction)Launcher_add, METH_O, "add(plan): try this plan first from now on."},
    {"holds", (PyCFunction)Launcher_holds, METH_O, "holds(plan): whether the plan is still among those tried."},
    {"clear", (PyCFunction)Launcher_clear, METH_NOARGS, "Drop every plan."},
    {"stats", (PyCFunction)Launcher_stats, METH_NOARGS, "{'hits', 'misses', 'plans'}: counts so far."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject LauncherType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "wsched.codegen._native_launch.Launcher",
    .tp_basicsize = sizeof(Launcher),
    .tp_dealloc = (destructor)Launcher_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The plans of a kernel's argument layouts; calling it launches a matching call.",
    .tp_init = (initproc)Launcher_init,
    .tp_new = PyType_GenericNew,
    .tp_call = (ternaryfunc)Launcher_call,
    .tp_methods = Launcher_methods,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_native_launch",
    "The eager call's native launch path (see codegen/native.py).", -1, NULL,
};

PyMODINIT_FUNC PyInit__native_launch(void) {
    if (PyType_Ready(&PlanType) < 0 || PyType_Ready(&LauncherType) < 0) return NULL;
    if (!(s_shape = PyUnicode_InternFromString("shape")) || !(s_stride = PyUnicode_InternFromString("stride")) ||
        !(s_dtype = PyUnicode_InternFromString("dtype")) || !(s_device = PyUnicode_InternFromString("device")) ||
        !(s_data_ptr = PyUnicode_InternFromString("data_ptr")))
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&PlanType);
    Py_INCREF(&LauncherType);
    if (PyModule_AddObject(m, "Plan", (PyObject *)&PlanType) < 0 ||
        PyModule_AddObject(m, "Launcher", (PyObject *)&LauncherType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    PyModule_AddIntConstant(m, "ABI", NATIVE_ABI);
    PyModule_AddIntConstant(m, "MAX_TENSORS", MAX_TENSORS);
    PyModule_AddIntConstant(m, "MAPS_PER_SLOT", MAPS_PER_SLOT);
    PyModule_AddIntConstant(m, "MAX_PRE", MAX_PRE);
    return m;
}
