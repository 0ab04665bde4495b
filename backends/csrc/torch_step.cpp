/*
 * The public step's entry from Python with torch tensors: the Python module _gqa_torch_step,
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
 */
#include <Python.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>

namespace {

using step_fn = int32_t (*)(void *const *caches, int64_t n, const void *const *io, const void *const *base,
                            const int64_t *stride, int64_t *results, int64_t rcols, int32_t *status, int32_t threads,
                            int32_t isa);

constexpr Py_ssize_t kAddrs = 5;   // gqa_step, descriptor pointer array, io, results, status
constexpr int64_t kResults = 7;    // the result columns a public step asks for: the first 7 of native.RESULT_COLUMNS_ALL

// Whether o is a plain CPU tensor (strided, with storage), contiguous, of like's dtype and
// shape; its data pointer to *at. Asks nothing that throws for another kind of tensor (a
// sparse one's is_contiguous does): those fail the layout test first.
bool fits(PyObject *o, const at::Tensor &like, void **at) {
    if (!THPVariable_CheckExact(o)) return false;
    const at::Tensor &t = THPVariable_Unpack(o);
    if (!t.defined() || t.layout() != at::kStrided || !t.is_cpu() || !t.has_storage() ||
        t.scalar_type() != like.scalar_type() || t.sizes() != like.sizes() || !t.is_contiguous())
        return false;
    *at = t.data_ptr();
    return true;
}

PyObject *step(PyObject *, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5 || !PyTuple_Check(args[0]) || PyTuple_GET_SIZE(args[0]) != kAddrs + 2) {
        PyErr_SetString(PyExc_TypeError, "step(ctx, query, new_key, new_value, out): ctx is a 7-tuple");
        return nullptr;
    }
    PyObject *ctx = args[0];
    void *addr[kAddrs];
    for (Py_ssize_t i = 0; i < kAddrs; i++) {
        addr[i] = PyLong_AsVoidPtr(PyTuple_GET_ITEM(ctx, i));
        if (!addr[i]) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "step: a null address in ctx");
            return nullptr;
        }
    }
    PyObject *q_like = PyTuple_GET_ITEM(ctx, kAddrs), *kv_like = PyTuple_GET_ITEM(ctx, kAddrs + 1);
    if (!THPVariable_Check(q_like) || !THPVariable_Check(kv_like)) {
        PyErr_SetString(PyExc_TypeError, "step: ctx's last two items are tensors");
        return nullptr;
    }
    const at::Tensor &ql = THPVariable_Unpack(q_like), &kvl = THPVariable_Unpack(kv_like);
    void **io = static_cast<void **>(addr[2]);
    bool ok;
    try {  // no C++ exception may cross into Python's C code: any is a tensor this entry does not take
        ok = fits(args[1], ql, &io[0]) && fits(args[2], kvl, &io[1]) && fits(args[3], kvl, &io[2]) &&
             fits(args[4], ql, &io[3]);
    } catch (...) {
        ok = false;
    }
    if (!ok) Py_RETURN_NONE;
    const auto fn = reinterpret_cast<step_fn>(addr[0]);
    auto *results = static_cast<int64_t *>(addr[3]);
    auto *status = static_cast<int32_t *>(addr[4]);
    int32_t rc;
    Py_BEGIN_ALLOW_THREADS
    rc = fn(static_cast<void *const *>(addr[1]), 1, io, nullptr, nullptr, results, kResults, status, 0, 0);
    Py_END_ALLOW_THREADS
    if (rc || *status) return PyLong_FromLong(rc);
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

PyMethodDef methods[] = {
    {"step", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(step)), METH_FASTCALL,
     "step(ctx, query, new_key, new_value, out): one public step through gqa_step (see the source)"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_gqa_torch_step", "The public step's entry with torch tensors.", -1,
                      methods};

}  // namespace

PyMODINIT_FUNC PyInit__gqa_torch_step(void) { return PyModule_Create(&module); }
