/*
 * The public step's entry from Python with torch tensors, batch_bytes.step_bytes' entry for
 * steps read from the wire (step_spans) and CacheSet's (plane_step, plane_buffers, at the end):
 * the Python module _gqa_torch_step,
 * built apart from the C library (it needs torch's and Python's headers and a C++ compiler;
 * backends/native_build.py, build_torch_step) and optional: without it the step takes the
 * ctypes path (backends/native_step.py), which does the same work in Python.
 *
 * Why it exists: a model's step of one layer finds torch's and Python's code and data evicted
 * by the other layers. The ctypes path's checks and pointers (nine tensor attributes, three
 * contiguous() and four data_ptr() calls through torch's bindings, then ctypes' argument
 * conversion) took ~55 us of such a cold step; here they are inline reads of each tensor's
 * TensorImpl (docs/design.md, "The public step's entry in C++").
 *
 * step(ctx, query, new_key, new_value, out), ctx = (gqa_step's address, and those of the
 * cache's descriptor pointer, io (4 pointers), results (7 int64) and status (int32) arrays,
 * q_like, kv_like) made once per cache (native_step.NativeStep._attach_native). Returns:
 * - None, nothing called: a tensor is not a plain strided torch.Tensor on the CPU, contiguous,
 *   of q_like's dtype and shape (query, out) or kv_like's (new_key, new_value). The caller's own
 *   checks then name what is wrong, or make it contiguous;
 * - the 7 results of a step (a tuple of ints): the row stepped;
 * - an int: gqa_step's own nonzero return code, or 0 when it returned 0 but refused the row
 *   (its status, in the status array).
 * The GIL is released while gqa_step runs, as ctypes releases it; the tensors stay alive (the
 * caller holds them).
 *
 * step_public(pctx, query, new_key, new_value): the whole public step of a cache in this one
 * call, pctx = (ctx, the prewake's address or 0, the descriptor's address, the cache's output
 * holder, StepOutcome, its nine fields' member descriptors, bytes_written) made once per cache.
 * It alerts the pool (gqa_prewake), takes the step's output tensor (below), steps as step()
 * does and returns the StepOutcome itself (made without running the dataclass's __init__: each
 * field stored through its slot's descriptor). A cold step's Python around the call took ~45 us
 * for these three (a ctypes call, a method and a dataclass __init__; docs/design.md, "The public
 * step in one call"). Returns as step() does, the StepOutcome in place of the tuple.
 *
 * The output: the holder (a one-item list) keeps the tensor the cache's last step made. When
 * the caller has let go of it (the holder's reference is the only one to the tensor and to its
 * memory: no view, no weak reference, no autograd), this step writes into it again; otherwise
 * the step makes a new one, which the holder keeps instead. So a caller that consumes each
 * output before the next step (a model's layer) gets the same memory back without an
 * allocation, and an output it keeps is never written again. A new tensor per step cost ~10 us
 * of a cold step, and a slab of them made by torch's Python API ~140 us every few steps
 * (docs/design.md, "A step's output tensor, reused").
 *
 * plane_step and plane_buffers: CacheSet.step and step_buffers in one call each (their
 * contracts at the functions). A cold call of 64 short caches spent ~140 us in the Python
 * around gqa_step (four tensors' checks, numpy's take and copy, ctypes, the StepBatch): 14-23%
 * of it (docs/design.md, "CacheSet's step in one call").
 */
#include <Python.h>
#include <ATen/EmptyTensor.h>
#include <torch/csrc/autograd/python_variable.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>
#include <time.h>

#include <cstdint>
#include <vector>

namespace {

using step_fn = int32_t (*)(void *const *caches, int64_t n, const void *const *io, const void *const *base,
                            const int64_t *stride, int64_t *results, int64_t rcols, int32_t *status, int32_t threads,
                            int32_t isa);

constexpr Py_ssize_t kAddrs = 5;   // gqa_step, descriptor pointer array, io, results, status
constexpr int64_t kResults = 7;    // the result columns a public step asks for: the first 7 of native.RESULT_COLUMNS_ALL

// Whether o is a plain CPU tensor (strided, with storage), contiguous, of like's dtype and of
// shape `sizes`; its data pointer to *at. Asks nothing that throws for another kind of tensor (a
// sparse one's is_contiguous does): those fail the layout test first.
bool fits_shape(PyObject *o, const at::Tensor &like, c10::IntArrayRef sizes, void **at) {
    if (!THPVariable_CheckExact(o)) return false;
    const at::Tensor &t = THPVariable_Unpack(o);
    if (!t.defined() || t.layout() != at::kStrided || !t.is_cpu() || !t.has_storage() ||
        t.scalar_type() != like.scalar_type() || t.sizes() != sizes || !t.is_contiguous())
        return false;
    *at = t.data_ptr();
    return true;
}

// fits_shape with like's shape.
bool fits(PyObject *o, const at::Tensor &like, void **at) { return fits_shape(o, like, like.sizes(), at); }

// What run() did with a row.
enum Ran { kStepped, kCode, kNotTaken, kError };

// ctx's last two items, the tensors a query (and output) and a new key (and value) must match:
// false with a TypeError set when they are not tensors.
bool likes(PyObject *ctx, const at::Tensor **ql, const at::Tensor **kvl) {
    PyObject *q_like = PyTuple_GET_ITEM(ctx, kAddrs), *kv_like = PyTuple_GET_ITEM(ctx, kAddrs + 1);
    if (!THPVariable_Check(q_like) || !THPVariable_Check(kv_like)) {
        PyErr_SetString(PyExc_TypeError, "step: ctx's last two items are tensors");
        return false;
    }
    *ql = &THPVariable_Unpack(q_like);
    *kvl = &THPVariable_Unpack(kv_like);
    return true;
}

// The row through gqa_step when every tensor fits ql / kvl (likes()): kStepped (the results at
// *results), kCode (*code: gqa_step's nonzero return, or 0 with the row refused in the status
// array), kNotTaken (nothing called), or kError (a null address in ctx: a Python error set).
Ran run(PyObject *ctx, const at::Tensor &ql, const at::Tensor &kvl, PyObject *query, PyObject *new_key,
        PyObject *new_value, PyObject *out, const int64_t **results, int32_t *code) {
    void *addr[kAddrs];
    for (Py_ssize_t i = 0; i < kAddrs; i++) {
        addr[i] = PyLong_AsVoidPtr(PyTuple_GET_ITEM(ctx, i));
        if (!addr[i]) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "step: a null address in ctx");
            return kError;
        }
    }
    void **io = static_cast<void **>(addr[2]);
    bool ok;
    try {  // no C++ exception may cross into Python's C code: any is a tensor this entry does not take
        ok = fits(query, ql, &io[0]) && fits(new_key, kvl, &io[1]) && fits(new_value, kvl, &io[2]) &&
             fits(out, ql, &io[3]);
    } catch (...) {
        ok = false;
    }
    if (!ok) return kNotTaken;
    const auto fn = reinterpret_cast<step_fn>(addr[0]);
    auto *res = static_cast<int64_t *>(addr[3]);
    auto *status = static_cast<int32_t *>(addr[4]);
    int32_t rc;
    Py_BEGIN_ALLOW_THREADS
    rc = fn(static_cast<void *const *>(addr[1]), 1, io, nullptr, nullptr, res, kResults, status, 0, 0);
    Py_END_ALLOW_THREADS
    *code = rc;
    *results = res;
    return rc || *status ? kCode : kStepped;
}

bool is_ctx(PyObject *ctx) { return PyTuple_Check(ctx) && PyTuple_GET_SIZE(ctx) == kAddrs + 2; }

PyObject *step(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5 || !is_ctx(args[0])) {
        PyErr_SetString(PyExc_TypeError, "step(ctx, query, new_key, new_value, out): ctx is a 7-tuple");
        return nullptr;
    }
    const at::Tensor *ql, *kvl;
    if (!likes(args[0], &ql, &kvl)) return nullptr;
    const int64_t *results;
    int32_t code;
    switch (run(args[0], *ql, *kvl, args[1], args[2], args[3], args[4], &results, &code)) {
        case kError: return nullptr;
        case kNotTaken: Py_RETURN_NONE;
        case kCode: return PyLong_FromLong(code);
        case kStepped: break;
    }
    PyObject *out = PyTuple_New(kResults);
    if (!out) return nullptr;
    for (int64_t i = 0; i < kResults; i++) {
        PyObject *x = PyLong_FromLongLong(results[i]);
        if (!x) {
            Py_DECREF(out);
            return nullptr;
        }
        PyTuple_SET_ITEM(out, i, x);
    }
    return out;
}

constexpr Py_ssize_t kFields = 9;  // StepOutcome's fields, in order

// The StepOutcome of a stepped row: `cls` allocated and each field set through its member
// descriptor (fields), from the output row, the results and bytes_written. nullptr: an error set.
PyObject *outcome(PyObject *cls, PyObject *fields, PyObject *out, const int64_t *r, PyObject *bytes) {
    PyTypeObject *type = reinterpret_cast<PyTypeObject *>(cls);
    PyObject *o = type->tp_alloc(type, 0);
    if (!o) return nullptr;
    PyObject *values[kFields] = {out, nullptr, nullptr, nullptr, nullptr, nullptr, bytes, nullptr, nullptr};
    const int64_t numbers[kFields] = {0, r[0], r[1], r[2], r[3], r[4], 0, 0, r[6]};
    for (Py_ssize_t i = 0; i < kFields; i++) {
        PyObject *v = values[i];
        if (v) Py_INCREF(v);
        else v = PyLong_FromLongLong(numbers[i]);
        PyObject *d = PyTuple_GET_ITEM(fields, i);
        const int rc = v ? Py_TYPE(d)->tp_descr_set(d, o, v) : -1;
        Py_XDECREF(v);
        if (rc) {
            Py_DECREF(o);
            return nullptr;
        }
    }
    return o;
}

// The deleter of the memory new_output allocates (nullptr before the first): a tensor whose
// memory another allocator made (shared memory, say) is not reused.
c10::DeleterFnPtr our_deleter = nullptr;

// Whether o, the holder's tensor, is free to be written again: the holder's reference is the
// only one (no weak reference either), nothing else holds its TensorImpl or its storage (a
// view, a DLPack export), it needs no gradient, and it still fits like's dtype and shape, alone
// in memory of ours.
bool let_go(PyObject *o, const at::Tensor &like) {
    if (Py_REFCNT(o) != 1 || !THPVariable_CheckExact(o)) return false;
    const Py_ssize_t weak = Py_TYPE(o)->tp_weaklistoffset;
    if (weak <= 0 || *reinterpret_cast<PyObject **>(reinterpret_cast<char *>(o) + weak)) return false;
    const at::Tensor &t = THPVariable_Unpack(o);
    void *data;
    if (!fits(o, like, &data) || t.use_count() != 1 || t.requires_grad() || t.storage_offset() != 0) return false;
    const c10::Storage &storage = t.storage();
    return storage.use_count() == 1 && storage.nbytes() == t.nbytes() && our_deleter &&
           storage.data_ptr().get_deleter() == our_deleter;
}

// A new tensor of like's dtype and shape (nullptr: a Python error set).
PyObject *new_output(const at::Tensor &like) {
    try {
        at::Tensor t = at::detail::empty_cpu(like.sizes(), like.scalar_type());
        our_deleter = t.storage().data_ptr().get_deleter();
        return THPVariable_Wrap(std::move(t));
    } catch (const std::exception &e) {
        PyErr_Format(PyExc_MemoryError, "step: cannot allocate the output (%s)", e.what());
        return nullptr;
    }
}

PyObject *step_public(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
    constexpr Py_ssize_t kItems = 7;
    PyObject *p = nargs == 4 ? args[0] : nullptr;
    if (!p || !PyTuple_Check(p) || PyTuple_GET_SIZE(p) != kItems || !is_ctx(PyTuple_GET_ITEM(p, 0)) ||
        !PyList_Check(PyTuple_GET_ITEM(p, 3)) || PyList_GET_SIZE(PyTuple_GET_ITEM(p, 3)) != 1 ||
        !PyType_Check(PyTuple_GET_ITEM(p, 4)) || !PyTuple_Check(PyTuple_GET_ITEM(p, 5)) ||
        PyTuple_GET_SIZE(PyTuple_GET_ITEM(p, 5)) != kFields || !PyLong_Check(PyTuple_GET_ITEM(p, 6))) {
        PyErr_SetString(PyExc_TypeError,
                        "step_public(pctx, query, new_key, new_value): pctx is (ctx, prewake, descriptor, output "
                        "holder (a 1-item list), StepOutcome, its 9 field descriptors, bytes_written)");
        return nullptr;
    }
    PyObject *fields = PyTuple_GET_ITEM(p, 5);
    for (Py_ssize_t i = 0; i < kFields; i++)
        if (!Py_TYPE(PyTuple_GET_ITEM(fields, i))->tp_descr_set) {
            PyErr_SetString(PyExc_TypeError, "step_public: a field descriptor that cannot set");
            return nullptr;
        }
    void *wake = PyLong_AsVoidPtr(PyTuple_GET_ITEM(p, 1));
    const void *desc = wake ? PyLong_AsVoidPtr(PyTuple_GET_ITEM(p, 2)) : nullptr;
    if (PyErr_Occurred()) return nullptr;
    if (wake && desc) reinterpret_cast<void (*)(const void *)>(wake)(desc);  // first: the workers' wake-up overlaps the rest
    PyObject *ctx = PyTuple_GET_ITEM(p, 0), *holder = PyTuple_GET_ITEM(p, 3);
    const at::Tensor *ql, *kvl;
    if (!likes(ctx, &ql, &kvl)) return nullptr;
    PyObject *out = PyList_GET_ITEM(holder, 0);
    if (let_go(out, *ql)) {
        Py_INCREF(out);  // ours while stepped, and the holder's
    } else {
        out = new_output(*ql);
        if (!out) return nullptr;
        Py_INCREF(out);  // ours while stepped (the holder's last one, let go below, may run a weakref callback)
        if (PyList_SetItem(holder, 0, out)) {  // and the holder's: a tensor not taken or a refused row stays there
            Py_DECREF(out);
            return nullptr;
        }
    }
    const int64_t *results;
    int32_t code;
    const Ran ran = run(ctx, *ql, *kvl, args[1], args[2], args[3], out, &results, &code);
    PyObject *o = ran == kError      ? nullptr
                  : ran == kNotTaken ? Py_NewRef(Py_None)
                  : ran == kCode     ? PyLong_FromLong(code)
                                     : outcome(PyTuple_GET_ITEM(p, 4), fields, out, results, PyTuple_GET_ITEM(p, 6));
    Py_DECREF(out);
    return o;
}

// -- step_spans: a batch of Decode steps read from the wire ---------------------------------------

// the numbers a row's step gives step_spans and the plane entries: native.RESULT_COLUMNS,
// tokens_seen .. rollback_reach
constexpr Py_ssize_t kFieldCols = 6;

// A row's cache as step_spans takes it: its _span, (kernel, gqa_step's address, the descriptor's
// address, the query's bytes), set by NativeStep._attach_native; *span borrowed. False (no error
// set) when the cache has none; nullptr-safe on any other failure (an error set, returns false).
bool span_of(PyObject *cache, PyObject **span) {
    static PyObject *name = PyUnicode_InternFromString("_span");
    PyObject *o = name ? PyObject_GetAttr(cache, name) : nullptr;
    if (!o) {
        PyErr_Clear();
        return false;
    }
    const bool ok = PyTuple_Check(o) && PyTuple_GET_SIZE(o) == 4 && PyLong_Check(PyTuple_GET_ITEM(o, 3));
    *span = o;
    Py_DECREF(o);  // the cache's attribute keeps it alive for the call
    return ok;
}

// step_spans(steps): batch_bytes.step_bytes' native part in one call. steps: a list of
// ByteStep (cache, data: bytes, q_at, k_at, v_at). Returns None, nothing done, when a row's
// cache has no _span or its data is not bytes (step_bytes then runs its Python path). Else
// (fields, out, offsets, left): out a bytearray with each row's output at offsets[i] (the
// query's length), fields[i] its 6 numbers (zeros for a row not stepped), left the rows not
// stepped (their caches unchanged): refused or handed back by gqa_step, whose cache's kernel is
// not the first row's (a test's stand-in), or all of them when gqa_step refused the whole call.
// ValueError, nothing done, when a cache appears twice. The GIL is released during gqa_step.
PyObject *step_spans(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 1 || !PyList_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "step_spans(steps): steps is a list of ByteStep");
        return nullptr;
    }
    static PyObject *native_name = PyUnicode_InternFromString("_native");
    if (!native_name) return nullptr;
    PyObject *steps = args[0];
    const Py_ssize_t n = PyList_GET_SIZE(steps);
    std::vector<void *> descs(n);     // every row's, for the duplicate check
    std::vector<int64_t> offsets(n);  // every row's output in `out`
    std::vector<Py_ssize_t> slot(n, -1);  // the row's place among those this call steps, or -1
    std::vector<void *> sdescs, sio;  // the stepped rows' descriptors and four pointers, packed
    PyObject *kernel = nullptr;
    void *fn = nullptr;
    int64_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *row = PyList_GET_ITEM(steps, i), *span;
        if (!PyTuple_Check(row) || PyTuple_GET_SIZE(row) != 5 || !PyBytes_Check(PyTuple_GET_ITEM(row, 1)) ||
            !span_of(PyTuple_GET_ITEM(row, 0), &span))
            Py_RETURN_NONE;
        offsets[i] = total;
        total += PyLong_AsLongLong(PyTuple_GET_ITEM(span, 3));
        void *desc = PyLong_AsVoidPtr(PyTuple_GET_ITEM(span, 2));
        const char *data = PyBytes_AS_STRING(PyTuple_GET_ITEM(row, 1));
        int64_t at[3];
        for (int j = 0; j < 3; j++) at[j] = PyLong_AsLongLong(PyTuple_GET_ITEM(row, 2 + j));
        if (PyErr_Occurred()) return nullptr;
        if (!desc) {
            PyErr_SetString(PyExc_ValueError, "step_spans: a cache's _span has a null descriptor");
            return nullptr;
        }
        for (Py_ssize_t j = 0; j < i; j++)
            if (descs[j] == desc) {
                PyErr_SetString(PyExc_ValueError, "step_bytes: a cache appears twice in one batch");
                return nullptr;
            }
        descs[i] = desc;
        PyObject *own = PyObject_GetAttr(PyTuple_GET_ITEM(row, 0), native_name);
        if (!own) return nullptr;
        Py_DECREF(own);  // compared by identity only
        PyObject *k = PyTuple_GET_ITEM(span, 0);
        if (own != k || (kernel && k != kernel)) continue;  // another kernel: left to the Python path
        if (!kernel) {
            kernel = k;
            fn = PyLong_AsVoidPtr(PyTuple_GET_ITEM(span, 1));
            if (!fn) {
                if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "step_spans: a null gqa_step address");
                return nullptr;
            }
        }
        slot[i] = static_cast<Py_ssize_t>(sdescs.size());
        sdescs.push_back(desc);
        // the output's pointer once `out` exists (below)
        sio.insert(sio.end(), {const_cast<char *>(data + at[0]), const_cast<char *>(data + at[1]),
                               const_cast<char *>(data + at[2]), nullptr});
    }
    PyObject *out = PyByteArray_FromStringAndSize(nullptr, total);
    if (!out) return nullptr;
    char *base = PyByteArray_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++)
        if (slot[i] >= 0) sio[4 * slot[i] + 3] = base + offsets[i];
    const int64_t m = static_cast<int64_t>(sdescs.size());
    std::vector<int64_t> results(kFieldCols * m, 0);
    std::vector<int32_t> status(m, 0);
    int32_t rc = 0;
    if (m) {
        const auto step_call = reinterpret_cast<step_fn>(fn);
        Py_BEGIN_ALLOW_THREADS
        rc = step_call(sdescs.data(), m, sio.data(), nullptr, nullptr, results.data(), kFieldCols, status.data(), 0, 0);
        Py_END_ALLOW_THREADS
    }
    PyObject *fields = PyList_New(n), *offs = PyList_New(n), *left = PyList_New(0);
    PyObject *answer = fields && offs && left ? PyTuple_New(4) : nullptr;
    for (Py_ssize_t i = 0; answer && i < n; i++) {
        // a row stepped has its numbers; one not (the whole call refused, this row refused or
        // handed back, another kernel's) has zeros and goes to `left`, for the Python path
        const Py_ssize_t j = slot[i];
        const bool stepped = j >= 0 && !rc && !status[j];
        PyObject *r = PyList_New(kFieldCols), *o = PyLong_FromLongLong(offsets[i]);
        for (Py_ssize_t c = 0; r && c < kFieldCols; c++) {
            PyObject *x = PyLong_FromLongLong(stepped ? results[kFieldCols * j + c] : 0);
            if (!x) {
                Py_CLEAR(r);
                break;
            }
            PyList_SET_ITEM(r, c, x);
        }
        PyObject *idx = stepped ? nullptr : PyLong_FromSsize_t(i);
        if (!r || !o || (!stepped && (!idx || PyList_Append(left, idx)))) {
            Py_XDECREF(r);
            Py_XDECREF(o);
            Py_XDECREF(idx);
            Py_CLEAR(answer);
            break;
        }
        Py_XDECREF(idx);
        PyList_SET_ITEM(fields, i, r);
        PyList_SET_ITEM(offs, i, o);
    }
    if (!answer) {
        Py_XDECREF(fields);
        Py_XDECREF(offs);
        Py_XDECREF(left);
        Py_DECREF(out);
        return nullptr;
    }
    PyTuple_SET_ITEM(answer, 0, fields);
    PyTuple_SET_ITEM(answer, 1, out);
    PyTuple_SET_ITEM(answer, 2, offs);
    PyTuple_SET_ITEM(answer, 3, left);
    return answer;
}

// -- plane_step, plane_buffers: CacheSet's step in one call -----------------------------------------

// A CacheSet's context, from the 10-tuple its _attach_plane makes: gqa_step's address, the
// addresses array's (layers x capacity uint64), layers, capacity, the rows array's (uint64) and
// its length, the status array's (int32, as long), the io array's (4 uint64 a row, as long),
// the strides array's (4 int64, bytes a row of query, new key, new value, output), and
// (a tensor of the set's dtype, Hq, Hkv, D, StepBatch).
struct Plane {
    step_fn fn;
    const uint64_t *addrs;
    int64_t layers, cap;
    uint64_t *rows;
    int64_t room;
    int32_t *status;
    uint64_t *io;
    const int64_t *stride;
    PyObject *like, *batch_type;
    int64_t hq, hkv, d;
};

// False with a TypeError or ValueError set when p is not such a tuple.
bool plane_of(PyObject *p, Plane *c) {
    constexpr Py_ssize_t kItems = 10, kShape = 5;
    if (!PyTuple_Check(p) || PyTuple_GET_SIZE(p) != kItems || !PyTuple_Check(PyTuple_GET_ITEM(p, kItems - 1)) ||
        PyTuple_GET_SIZE(PyTuple_GET_ITEM(p, kItems - 1)) != kShape) {
        PyErr_SetString(PyExc_TypeError, "plane: pctx is CacheSet._attach_plane's 10-tuple");
        return false;
    }
    int64_t v[kItems - 1];
    for (Py_ssize_t i = 0; i < kItems - 1; i++) v[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(p, i));
    PyObject *shape = PyTuple_GET_ITEM(p, kItems - 1);
    c->like = PyTuple_GET_ITEM(shape, 0);
    c->batch_type = PyTuple_GET_ITEM(shape, 4);
    c->hq = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, 1));
    c->hkv = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, 2));
    c->d = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, 3));
    if (PyErr_Occurred()) return false;
    if (!THPVariable_Check(c->like) || !PyType_Check(c->batch_type) ||
        !PyType_IsSubtype(reinterpret_cast<PyTypeObject *>(c->batch_type), &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "plane: pctx's last item is (a tensor, Hq, Hkv, D, StepBatch)");
        return false;
    }
    c->fn = reinterpret_cast<step_fn>(v[0]);
    c->addrs = reinterpret_cast<const uint64_t *>(v[1]);
    c->layers = v[2];
    c->cap = v[3];
    c->rows = reinterpret_cast<uint64_t *>(v[4]);
    c->room = v[5];
    c->status = reinterpret_cast<int32_t *>(v[6]);
    c->io = reinterpret_cast<uint64_t *>(v[7]);
    c->stride = reinterpret_cast<const int64_t *>(v[8]);
    if (!c->fn || !c->addrs || !c->rows || !c->status || !c->io || !c->stride) {
        PyErr_SetString(PyExc_ValueError, "plane: a null address in pctx");
        return false;
    }
    return true;
}

// A C-contiguous vector of int64 (a numpy int64 array): its items and length; false (no error
// set) for anything else.
bool int64_vector(PyObject *o, Py_buffer *view, const int64_t **items, int64_t *n) {
    if (PyObject_GetBuffer(o, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT)) {
        PyErr_Clear();
        return false;
    }
    const char *fmt = view->format ? view->format : "B";
    if (view->ndim != 1 || view->itemsize != 8 || (fmt[0] != 'l' && fmt[0] != 'q') || fmt[1] != '\0') {
        PyBuffer_Release(view);
        return false;
    }
    *items = static_cast<const int64_t *>(view->buf);
    *n = view->len / 8;
    return true;
}

// The rows array filled with the descriptors of `slots` at `layer`; the row count, or 0 when
// the call is not for here (no rows, more than the rows array holds, the layer or a slot out of
// range, slots not int64s): the caller's Python path then takes it, as it always could.
int64_t plane_rows(const Plane &c, PyObject *layer_o, PyObject *slots_o) {
    const int64_t layer = PyLong_AsLongLong(layer_o);
    if (PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    Py_buffer view;
    const int64_t *slots;
    int64_t n;
    if (layer < 0 || layer >= c.layers || !int64_vector(slots_o, &view, &slots, &n)) return 0;
    bool ok = n > 0 && n <= c.room;
    for (int64_t i = 0; ok && i < n; i++) ok = slots[i] >= 0 && slots[i] < c.cap;
    for (int64_t i = 0; ok && i < n; i++) c.rows[i] = c.addrs[layer * c.cap + slots[i]];
    PyBuffer_Release(&view);
    return ok ? n : 0;
}

// Both entries' start: nargs checked (usage: the TypeError's message), pctx read, the rows
// array filled (plane_rows). The row count; 0 when the call is not for here; -1 with an error set.
int64_t plane_begin(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, const char *usage, Plane *c) {
    if (nargs != want) {
        PyErr_SetString(PyExc_TypeError, usage);
        return -1;
    }
    if (!plane_of(args[0], c)) return -1;
    return plane_rows(*c, args[1], args[2]);
}

int64_t monotonic_ns() {  // CLOCK_MONOTONIC, as Python's time.perf_counter_ns on Linux
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return static_cast<int64_t>(t.tv_sec) * 1000000000LL + t.tv_nsec;
}

// gqa_step over the rows array's n rows (io: a pointer per row and tensor, or nullptr and base
// with the strides), the GIL released, the fields written into a fresh (n, 6) int64 array.
// Returns the StepBatch when every row was stepped; gqa_step's nonzero return as an int; or
// (fields, start) when it refused a row (its status in the status array), for the caller to
// finish. start: this call's CLOCK_MONOTONIC ns at its entry.
PyObject *plane_run(const Plane &c, int64_t n, void *const *io, void *const *base, int64_t start) {
    npy_intp dims[2] = {static_cast<npy_intp>(n), kFieldCols};
    PyObject *fields = PyArray_SimpleNew(2, dims, NPY_INT64);
    if (!fields) return nullptr;
    auto *at = static_cast<int64_t *>(PyArray_DATA(reinterpret_cast<PyArrayObject *>(fields)));
    int32_t rc;
    Py_BEGIN_ALLOW_THREADS
    rc = c.fn(reinterpret_cast<void *const *>(c.rows), n, io, base, io ? nullptr : c.stride, at, kFieldCols, c.status,
              0, 0);
    Py_END_ALLOW_THREADS
    if (rc) {
        Py_DECREF(fields);
        return PyLong_FromLong(rc);
    }
    for (int64_t i = 0; i < n; i++)
        if (c.status[i]) return Py_BuildValue("(NL)", fields, static_cast<long long>(start));
    PyObject *refused = PyDict_New();
    PyObject *ns = refused ? PyLong_FromLongLong(monotonic_ns() - start) : nullptr;
    PyTypeObject *type = reinterpret_cast<PyTypeObject *>(c.batch_type);
    PyObject *batch = ns ? type->tp_alloc(type, 3) : nullptr;  // a NamedTuple: a tuple subclass
    if (!batch) {
        Py_DECREF(fields);
        Py_XDECREF(refused);
        Py_XDECREF(ns);
        return nullptr;
    }
    PyTuple_SET_ITEM(batch, 0, fields);
    PyTuple_SET_ITEM(batch, 1, refused);
    PyTuple_SET_ITEM(batch, 2, ns);
    return batch;
}

// fits_shape with the shape of n rows of a set's heads: (n, heads, d).
bool fits_rows(PyObject *o, const at::Tensor &like, int64_t n, int64_t heads, int64_t d, void **at) {
    const int64_t sizes[3] = {n, heads, d};
    return fits_shape(o, like, sizes, at);
}

// plane_step(pctx, layer, slots, query, new_key, new_value, out): CacheSet.step's native part:
// the rows' descriptors, the tensors' checks and pointers, gqa_step and the StepBatch. Returns as
// plane_run, or None with nothing called when plane_rows says so or a tensor is not (n, heads,
// D) of the set's dtype, contiguous on the CPU (CacheSet.step's checks then name it).
PyObject *plane_step(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
    const int64_t start = monotonic_ns();
    Plane c;
    const int64_t n = plane_begin(args, nargs, 7, "plane_step(pctx, layer, slots, query, new_key, new_value, out)", &c);
    if (n < 0) return nullptr;
    if (!n) Py_RETURN_NONE;
    void *base[4];
    bool ok;
    try {  // no C++ exception may cross into Python's C code
        const at::Tensor &like = THPVariable_Unpack(c.like);
        ok = fits_rows(args[3], like, n, c.hq, c.d, &base[0]) && fits_rows(args[4], like, n, c.hkv, c.d, &base[1]) &&
             fits_rows(args[5], like, n, c.hkv, c.d, &base[2]) && fits_rows(args[6], like, n, c.hq, c.d, &base[3]);
    } catch (...) {
        ok = false;
    }
    if (!ok) Py_RETURN_NONE;
    return plane_run(c, n, nullptr, base, start);
}

// plane_buffers(pctx, layer, slots, query, new_key, new_value, out, rows): CacheSet.step_buffers'
// native part, the buffers held (their exports keep a bytearray from resizing) while gqa_step
// runs. Returns as plane_run, or None with nothing called when plane_rows says so, a buffer is
// not contiguous (out: writable) or not a whole number N of its rows, the four Ns differ, or
// rows is None with N != n, or not n int64s below N (step_buffers' checks then name it).
PyObject *plane_buffers(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
    const int64_t start = monotonic_ns();
    Plane c;
    const int64_t n =
        plane_begin(args, nargs, 8, "plane_buffers(pctx, layer, slots, query, new_key, new_value, out, rows)", &c);
    if (n < 0) return nullptr;
    if (!n) Py_RETURN_NONE;
    Py_buffer b[4];
    int held = 0;
    for (; held < 4; held++)
        if (PyObject_GetBuffer(args[3 + held], &b[held], held == 3 ? PyBUF_WRITABLE : PyBUF_SIMPLE)) {
            PyErr_Clear();
            break;
        }
    bool ok = held == 4 && c.stride[0] > 0 && c.stride[1] > 0;
    const int64_t total = ok ? b[0].len / c.stride[0] : 0;
    for (int j = 0; ok && j < 4; j++) ok = b[j].len == total * c.stride[j];
    PyObject *result = nullptr;
    if (ok && args[7] == Py_None) {
        ok = total == n;
        void *base[4] = {b[0].buf, b[1].buf, b[2].buf, b[3].buf};
        if (ok) result = plane_run(c, n, nullptr, base, start);
    } else if (ok) {
        Py_buffer rv;
        const int64_t *rows;
        int64_t nr;
        ok = int64_vector(args[7], &rv, &rows, &nr);
        if (ok) {
            ok = nr == n;
            for (int64_t i = 0; ok && i < n; i++) ok = rows[i] >= 0 && rows[i] < total;
            for (int64_t i = 0; ok && i < n; i++)
                for (int j = 0; j < 4; j++)
                    c.io[4 * i + j] =
                        reinterpret_cast<uint64_t>(b[j].buf) + static_cast<uint64_t>(rows[i] * c.stride[j]);
            PyBuffer_Release(&rv);
        }
        if (ok) result = plane_run(c, n, reinterpret_cast<void *const *>(c.io), nullptr, start);
    }
    for (int j = 0; j < held; j++) PyBuffer_Release(&b[j]);
    if (!ok) Py_RETURN_NONE;
    return result;
}

PyMethodDef methods[] = {
    {"step", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(step)), METH_FASTCALL,
     "step(ctx, query, new_key, new_value, out): one public step through gqa_step (see the source)"},
    {"step_public", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(step_public)), METH_FASTCALL,
     "step_public(pctx, query, new_key, new_value): the public step and its StepOutcome in one call (see the source)"},
    {"step_spans", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(step_spans)), METH_FASTCALL,
     "step_spans(steps): batch_bytes.step_bytes' steps through gqa_step in one call (see the source)"},
    {"plane_step", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(plane_step)), METH_FASTCALL,
     "plane_step(pctx, layer, slots, query, new_key, new_value, out): CacheSet.step's native part (see the source)"},
    {"plane_buffers", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(plane_buffers)), METH_FASTCALL,
     "plane_buffers(pctx, layer, slots, query, new_key, new_value, out, rows): CacheSet.step_buffers' native part"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_gqa_torch_step", "The public step's entry with torch tensors.", -1,
                      methods};

}  // namespace

PyMODINIT_FUNC PyInit__gqa_torch_step(void) {
    import_array();  // numpy's C API (plane_step's fields array); returns NULL with the error set if it fails
    return PyModule_Create(&module);
}
