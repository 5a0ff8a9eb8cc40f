// The per-call floor: what normwatch's eager reads cost with no Python per call.
//
// A forward hook written in C++ (a builtin function, called by torch's module hook loop
// without a Python frame) reads each norm call's rows with normwatch's own C kernels
// (their addresses handed over from `normwatch.measure.backends.native.readers`), into a ring buffer. On a
// measured step it also adds C++ pre-hooks to the autograd nodes (no Python in the
// backward, no RemovableHandle): on the output's node, the output's gradient and the
// gradient through the norm computed from it (`normwatch_through`); on the input's node,
// the input's gradient in total.
//
// Not normwatch: nothing is staged, folded or flushed, no check of the call's kind, and
// the weights' gradients are not read (a C++ tensor hook on each weight, tried once, read
// 1.064x against 1.024x without it at d=128, stats_every=1, in 60 steps: not explained,
// so left out). It
// measures what the same reads cost without the Python around them
// (tests/benchmarks/floor.py builds and runs it).
#include <Python.h>

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <memory>

namespace {

using torch::autograd::variable_list;

using RowsFn = int (*)(const void *, int, int64_t, int64_t, const void *, int, int64_t,
                       int64_t, int64_t, float *, int, int);
using GradFn = int (*)(const void *, const void *, int, int64_t, int64_t, float *, int);
using ThroughFn = int (*)(const void *, const void *, const void *, float *, float *,
                          const int64_t *, double);

RowsFn rows_fn = nullptr;
GradFn grad_fn = nullptr;
ThroughFn through_fn = nullptr;
float *ring = nullptr;
int64_t capacity = 0, position = 0, calls = 0, grads = 0;
int threads = 1;
bool full = false;

float *take(int64_t n) {  // n floats of the ring (a benchmark's: overwritten in turn)
    if (position + n > capacity) position = 0;
    float *p = ring + position;
    position += n;
    return p;
}

bool plain(const at::Tensor &t) {
    return t.is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous() && t.dim() > 0;
}

// The output's gradient k, and from it, the norm's input and weight, the gradient through
// the norm (the input and weight let go once it ran)
struct Through : torch::autograd::FunctionPreHook {
    int k;
    at::Tensor x, weight;
    double eps;
    Through(int k, at::Tensor x, at::Tensor weight, double eps)
        : k(k), x(std::move(x)), weight(std::move(weight)), eps(eps) {}
    variable_list operator()(const variable_list &in) override {
        if (k < (int64_t)in.size() && in[k].defined() && x.defined()) {
            const at::Tensor &g = in[k];
            if (plain(g) && g.sizes() == x.sizes()) {
                int64_t w = g.size(-1), n = g.numel() / w;
                int64_t plan[5] = {n, w, 0, 0, threads};
                float *dg = take(n + 2), *dx = take(n + 2);
                through_fn(g.data_ptr(), x.data_ptr(),
                           weight.defined() ? weight.data_ptr() : nullptr, dg, dx, plan, eps);
                grads++;
            }
        }
        x = at::Tensor();
        weight = at::Tensor();
        return in;
    }
};

// A node's output k's gradient, read by rows
struct Rows : torch::autograd::FunctionPreHook {
    int k;
    explicit Rows(int k) : k(k) {}
    variable_list operator()(const variable_list &in) override {
        if (k < (int64_t)in.size() && in[k].defined() && plain(in[k])) {
            const at::Tensor &g = in[k];
            int64_t w = g.size(-1), n = g.numel() / w;
            grad_fn(g.data_ptr(), nullptr, 0, n, w, take(n + 2), threads);
            grads++;
        }
        return in;
    }
};

// hook(eps, module, args, kwargs, output): a forward hook (with kwargs) once bound to its
// eps (functools.partial)
PyObject *hook(PyObject *, PyObject *const *a, Py_ssize_t n) {
    if (!rows_fn || n != 5 || !PyTuple_Check(a[2]) || PyTuple_GET_SIZE(a[2]) < 1) Py_RETURN_NONE;
    PyObject *xo = PyTuple_GET_ITEM(a[2], 0);
    if (!THPVariable_CheckExact(xo) || !THPVariable_CheckExact(a[4]) ||
        !at::GradMode::is_enabled())
        Py_RETURN_NONE;
    const at::Tensor &x = THPVariable_Unpack(xo);
    const at::Tensor &y = THPVariable_Unpack(a[4]);
    if (!plain(x) || !plain(y) || x.sizes() != y.sizes()) Py_RETURN_NONE;
    int64_t w = x.size(-1), rows = x.numel() / w;
    rows_fn(x.data_ptr(), 0, w, w, y.data_ptr(), 0, w, w, rows, take(rows * (full ? 7 : 4)),
            threads, full ? 1 : 0);
    calls++;
    if (full && y.requires_grad() && y.grad_fn()) {
        at::Tensor weight;
        PyObject *wo = PyObject_GetAttrString(a[1], "weight");
        if (wo && THPVariable_Check(wo)) weight = THPVariable_Unpack(wo);
        Py_XDECREF(wo);
        PyErr_Clear();
        double eps = PyFloat_AsDouble(a[0]);
        if (eps == -1.0 && PyErr_Occurred()) PyErr_Clear(), eps = 0.0;  // (not a float)
        y.grad_fn()->add_pre_hook(std::make_unique<Through>(y.output_nr(), x, weight, eps));
        if (x.grad_fn()) x.grad_fn()->add_pre_hook(std::make_unique<Rows>(x.output_nr()));
    }
    Py_RETURN_NONE;
}

// setup(rows, grad_rows, through, ring, ring's floats, threads): the kernels' addresses
PyObject *setup(PyObject *, PyObject *args) {
    unsigned long long r, g, t, b;
    long long cap;
    if (!PyArg_ParseTuple(args, "KKKKLi", &r, &g, &t, &b, &cap, &threads)) return nullptr;
    rows_fn = (RowsFn)r;
    grad_fn = (GradFn)g;
    through_fn = (ThroughFn)t;
    ring = (float *)b;
    capacity = cap;
    position = 0;
    Py_RETURN_NONE;
}

PyObject *set_full(PyObject *, PyObject *on) {
    full = PyObject_IsTrue(on);
    Py_RETURN_NONE;
}

PyObject *counts(PyObject *, PyObject *) { return Py_BuildValue("LL", calls, grads); }

PyMethodDef methods[] = {
    {"hook", (PyCFunction)(void (*)(void))hook, METH_FASTCALL, nullptr},
    {"setup", setup, METH_VARARGS, nullptr},
    {"set_full", set_full, METH_O, nullptr},
    {"counts", counts, METH_NOARGS, nullptr},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "normwatch_floor", nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit_normwatch_floor() { return PyModule_Create(&module); }
