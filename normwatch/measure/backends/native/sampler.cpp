// The update monitor's step hooks in C++ (built into the lanes' module with lane.cpp;
// contract.py gives the names of a NativePack's fields it reads): what UpdateMonitor's pre- and post-step hooks do around the C kernel
// (normwatch_sample, native_rows.c) for an optimizer whose samples are all NativePacks,
// with no line of Python. Inside a training step each line of the hooks' Python costs
// several times what it costs warm: their checks (the parameters are the sampled ones,
// nothing wrote them since, every gradient is laid out like its parameter) took longer
// than the kernel's read. Any other case returns a "no" to Python, whose path measures it.
#include "lane.h"

#include <ATen/Parallel.h>

#include <cstdint>
#include <vector>

namespace {

using normwatch::names;
using SampleFn = int (*)(int64_t, int, const int64_t *, const int64_t *, const int64_t *,
                         const double *, void *const *, void *const *, void *, int, double *,
                         int);
SampleFn sample_fn = nullptr;

constexpr int MEASURE = 1, SIZE = 2;  // sampler.MEASURE, SIZE

// One NativePack: its parameters (indices), the kernel's plan of their samples, the kept
// values
struct Pack {
    std::vector<size_t> index;
    int kind = 0;
    std::vector<int64_t> blocks, width, stride;
    std::vector<double> scale;
    std::vector<void *> samples;
    at::Tensor kept;
    bool split = false;
};

// An optimizer's sampled parameters (_Sampled's, owned) and its packs
struct Sampler {
    std::vector<PyObject *> objects;  // the parameters as Python saw them (identity)
    std::vector<at::Tensor> params;
    std::vector<const void *> addresses;
    std::vector<Pack> packs;
    int64_t versions = -1;  // their versions' sum when last read (-1: none noted)
};

void drop(PyObject *capsule) {
    auto *s = static_cast<Sampler *>(PyCapsule_GetPointer(capsule, "normwatch.sampler"));
    if (s == nullptr) return;
    for (PyObject *o : s->objects) Py_DECREF(o);
    delete s;
}

Sampler *held(PyObject *capsule) {
    return static_cast<Sampler *>(PyCapsule_GetPointer(capsule, "normwatch.sampler"));
}

// Call f on each item of a sequence, up to its first error: 0, or -1 with an error set
template <class F>
int each(PyObject *seq, F f) {
    PyObject *fast = PySequence_Fast(seq, "sampler: a sequence");
    if (fast == nullptr) return -1;
    int r = 0;
    for (Py_ssize_t i = 0; r == 0 && i < PySequence_Fast_GET_SIZE(fast); i++)
        r = f(PySequence_Fast_GET_ITEM(fast, i));
    Py_DECREF(fast);
    return r;
}

// A sequence's items read by `read` into `out` (0, or -1 with an error)
template <class T>
int items(PyObject *seq, std::vector<T> &out, T (*read)(PyObject *)) {
    return each(seq, [&](PyObject *item) {
        out.push_back(read(item));
        return PyErr_Occurred() ? -1 : 0;
    });
}

int64_t as_int(PyObject *o) { return PyLong_AsLongLong(o); }
double as_double(PyObject *o) { return PyFloat_AsDouble(o); }
size_t as_size(PyObject *o) { return PyLong_AsSize_t(o); }
void *as_pointer(PyObject *o) { return o == Py_None ? nullptr : PyLong_AsVoidPtr(o); }

// An attribute read into `out` by `items` (0, or -1 with an error)
template <class T>
int field(PyObject *owner, PyObject *name, std::vector<T> &out, T (*read)(PyObject *)) {
    PyObject *v = PyObject_GetAttr(owner, name);
    if (v == nullptr) return -1;
    int r = items(v, out, read);
    Py_DECREF(v);
    return r;
}

int pack_from(PyObject *index, PyObject *native, Pack &p) {
    PyObject *kind = PyObject_GetAttr(native, names.pack_kind);
    PyObject *kept = kind ? PyObject_GetAttr(native, names.pack_kept) : nullptr;
    PyObject *split = kept ? PyObject_GetAttr(native, names.pack_split) : nullptr;
    int r = -1;
    if (split != nullptr && THPVariable_Check(kept)) {
        p.kind = (int)PyLong_AsLong(kind);
        p.kept = THPVariable_Unpack(kept);
        p.split = PyObject_IsTrue(split) == 1;
        r = PyErr_Occurred() || items(index, p.index, as_size) < 0 ||
            field(native, names.pack_blocks, p.blocks, as_int) < 0 ||
            field(native, names.pack_width, p.width, as_int) < 0 ||
            field(native, names.pack_stride, p.stride, as_int) < 0 ||
            field(native, names.pack_scale, p.scale, as_double) < 0 ||
            field(native, names.pack_params, p.samples, as_pointer) < 0 ? -1 : 0;
        size_t n = p.index.size();
        if (r == 0 && (p.blocks.size() != n || p.width.size() != n || p.stride.size() != n ||
                       p.scale.size() != n || p.samples.size() != n)) {
            PyErr_SetString(PyExc_ValueError, "sampler: a pack's plan of another length");
            r = -1;
        }
    } else if (split != nullptr) {
        PyErr_SetString(PyExc_TypeError, "sampler: a pack's kept values: a tensor");
    }
    for (PyObject *o : {kind, kept, split}) Py_XDECREF(o);
    return r;
}

// A parameter added to the sampler: 0, or -1 with an error
int add_param(Sampler &s, PyObject *p) {
    if (!THPVariable_Check(p)) {
        PyErr_SetString(PyExc_TypeError, "sampler: params: tensors");
        return -1;
    }
    Py_INCREF(p);
    s.objects.push_back(p);
    s.params.push_back(THPVariable_Unpack(p));
    s.addresses.push_back(s.params.back().const_data_ptr());
    return 0;
}

// An (index, NativePack) pair added to the sampler: 0, or -1 with an error
int add_pack(Sampler &s, PyObject *pair) {
    if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
        PyErr_SetString(PyExc_TypeError, "sampler: packs: (index, NativePack) pairs");
        return -1;
    }
    Pack p;
    if (pack_from(PyTuple_GET_ITEM(pair, 0), PyTuple_GET_ITEM(pair, 1), p) < 0) return -1;
    for (size_t k : p.index)
        if (k >= s.params.size()) {
            PyErr_SetString(PyExc_IndexError, "sampler: a pack's index");
            return -1;
        }
    s.packs.push_back(std::move(p));
    return 0;
}

// sampler(params, packs: [(index, NativePack)]): an optimizer's sampler, as a capsule
PyObject *sampler(PyObject *, PyObject *args) {
    PyObject *params, *packs;
    if (!PyArg_ParseTuple(args, "OO", &params, &packs)) return nullptr;
    auto *s = new Sampler();
    PyObject *capsule = PyCapsule_New(s, "normwatch.sampler", drop);
    if (capsule == nullptr) {
        delete s;
        return nullptr;
    }
    if (each(params, [&](PyObject *p) { return add_param(*s, p); }) < 0 ||
        each(packs, [&](PyObject *pair) { return add_pack(*s, pair); }) < 0)
        Py_CLEAR(capsule);  // (its references with it)
    return capsule;
}

int64_t versions(const Sampler &s) {
    int64_t sum = 0;
    for (const auto &p : s.params) sum += p._version();
    return sum;
}

// Run the kernel on a pack (grads: their data, or nullptr): 0, or -1 with an error
int run(Pack &p, void *const *grads, int mode, double *out) {
    int threads = p.split ? at::get_num_threads() : 1;
    int r;
    Py_BEGIN_ALLOW_THREADS  // (as the ctypes call let other threads run)
    r = sample_fn((int64_t)p.index.size(), p.kind, p.blocks.data(), p.width.data(),
                  p.stride.data(), p.scale.data(), p.samples.data(), grads,
                  p.kept.mutable_data_ptr(), mode, out, threads);
    Py_END_ALLOW_THREADS
    if (r != 0) PyErr_SetString(PyExc_RuntimeError, "sampler: the C kernel refused the call");
    return r;
}

// pre(capsule, param_groups): UpdateMonitor._pre's work where the groups' trained
// parameters are the sampled ones, in place: the values before the step kept (read again
// unless nothing wrote the parameters since the last step's read). False: they are not
// (nothing done).
PyObject *pre(PyObject *, PyObject *args) {
    PyObject *capsule, *groups;
    if (!PyArg_ParseTuple(args, "OO", &capsule, &groups)) return nullptr;
    Sampler *s = held(capsule);
    if (s == nullptr) return nullptr;
    if (!PyList_Check(groups)) Py_RETURN_FALSE;
    size_t at = 0;
    for (Py_ssize_t g = 0; g < PyList_GET_SIZE(groups); g++) {
        PyObject *group = PyList_GET_ITEM(groups, g);
        PyObject *params = PyDict_Check(group) ? PyDict_GetItemString(group, "params")
                                               : nullptr;
        if (params == nullptr || !PyList_Check(params)) Py_RETURN_FALSE;
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(params); i++) {
            PyObject *p = PyList_GET_ITEM(params, i);
            if (!THPVariable_Check(p)) Py_RETURN_FALSE;
            const at::Tensor &t = THPVariable_Unpack(p);
            if (!t.requires_grad()) continue;
            if (at >= s->objects.size() || s->objects[at] != p ||
                s->addresses[at] != t.const_data_ptr())
                Py_RETURN_FALSE;
            at++;
        }
    }
    if (at != s->objects.size()) Py_RETURN_FALSE;
    int64_t seen = s->versions;
    s->versions = -1;
    if (seen == -1 || seen != versions(*s)) {  // written since: read the values again
        double unused[3];
        for (Pack &p : s->packs)
            if (run(p, nullptr, 0, unused) < 0) return nullptr;
    }
    Py_RETURN_TRUE;
}

// The gradients' data, where each is laid out like its (dense, plain) parameter
bool grads_alike(const Sampler &s, std::vector<void *> &out) {
    for (const auto &p : s.params) {
        const at::Tensor &g = p.grad();
        if (!g.defined() || g.layout() != at::kStrided || g.scalar_type() != p.scalar_type() ||
            !g.is_cpu() || g.key_set().has(c10::DispatchKey::Python) ||
            !g.sizes().equals(p.sizes()) || !g.strides().equals(p.strides()))
            return false;
        out.push_back(g.data_ptr());
    }
    return true;
}

// post(capsule, sized): UpdateMonitor._measure's row where every gradient is laid out
// like its parameter: [|g|², |Δp|², |p|² (with sized, else 0)] (float64), the values read
// kept, the versions noted. None: a gradient is not (nothing done).
PyObject *post(PyObject *, PyObject *args) {
    PyObject *capsule;
    int sized;
    if (!PyArg_ParseTuple(args, "Op", &capsule, &sized)) return nullptr;
    Sampler *s = held(capsule);
    if (s == nullptr) return nullptr;
    std::vector<void *> grads;
    if (!grads_alike(*s, grads)) Py_RETURN_NONE;
    double sum[3] = {0, 0, 0};
    std::vector<void *> picked;
    int mode = MEASURE | (sized ? SIZE : 0);
    for (size_t k = 0; k < s->packs.size(); k++) {
        Pack &p = s->packs[k];
        picked.clear();
        for (size_t i : p.index) picked.push_back(grads[i]);
        double row[3];
        if (run(p, picked.data(), mode, row) < 0) return nullptr;
        for (int c = 0; c < 3; c++) sum[c] = k ? sum[c] + row[c] : row[c];
    }
    s->versions = versions(*s);
    at::Tensor row = at::empty({3}, at::kDouble);
    std::copy(sum, sum + 3, row.mutable_data_ptr<double>());
    return THPVariable_Wrap(row);
}

// seen(capsule): the parameters were just read (their versions noted)
PyObject *seen(PyObject *, PyObject *capsule) {
    Sampler *s = held(capsule);
    if (s == nullptr) return nullptr;
    s->versions = versions(*s);
    Py_RETURN_NONE;
}

}  // namespace

// setup_sampler(address of normwatch_sample)
static PyObject *setup_sampler(PyObject *, PyObject *address) {
    void *p = PyLong_AsVoidPtr(address);
    if (p == nullptr)
        return PyErr_Occurred() ? nullptr : PyErr_Format(PyExc_ValueError, "setup: null");
    sample_fn = reinterpret_cast<SampleFn>(p);
    Py_RETURN_NONE;
}

PyMethodDef normwatch_sampler_methods[] = {
    {"sampler", sampler, METH_VARARGS, "sampler(params, packs): an optimizer's (a capsule)"},
    {"sampler_pre", pre, METH_VARARGS, "sampler_pre(capsule, param_groups): whether done"},
    {"sampler_post", post, METH_VARARGS, "sampler_post(capsule, sized): the row, or None"},
    {"sampler_seen", seen, METH_O, "sampler_seen(capsule): the versions noted"},
    {"setup_sampler", setup_sampler, METH_O, "setup_sampler(address of normwatch_sample)"},
    {nullptr, nullptr, 0, nullptr}};
