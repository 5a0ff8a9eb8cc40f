// The gradients' hooks in C++ (built into the lanes' module with lane.cpp; contract.py
// states what they read and write of Python's, and gives the names).
//
// On a full-tier step the CPU hooks of GradHooks (normwatch.measure.layer.gradients): a
// node's pre-hook per site (hook_site, the hidden state's or the output's gradient), the
// output node's pre-hook that also computes the gradient through the norm (hook_out), the
// weight's tensor hook (hook_weight). Each reads as the Python hook does with the native
// backend (the same C readers, plans, lender and GradRows staged) with no Python frame of
// its own; a launch lane's (a layer the Triton backend serves) reads a site by its
// launcher (one launch, its only Python) and the weight by torch's norm; any case that is
// not the plain one calls the Python hook's method (GradHooks._node, ._both,
// ._weight_grad, ._in), which measures it as before. An error
// disables the layer through GradHooks._fail. Registered with no RemovableHandle (a
// node's hooks go with its graph).
#include "grads.h"

#include <ATen/Parallel.h>
#include <torch/csrc/PyInterpreter.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/python_cpp_function.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/dynamo/compiled_autograd.h>

#include <algorithm>
#include <optional>
#include <unordered_set>
#include <utility>

namespace {

using namespace normwatch;
using namespace normwatch::grads;

// The GIL held for a hook's body, the layer's gradients measured this step
struct Firing {
    PyGILState_STATE gil;
    Shared gr;
    int now = 0;  // 1: measured, 0: nothing to do, -1: an error (handled)
    explicit Firing(Shared g) : gil(PyGILState_Ensure()), gr(std::move(g)) {
        if (!gr->open) return;
        now = grads_now(gr->runtime);
        if (now < 0) grad_failed(*gr);
    }
    ~Firing() { PyGILState_Release(gil); }
};

// Run a hook's body (1 done, -1 an error): an error, a C++ exception too, disables the
// layer (nothing reaches the autograd engine)
template <class Body>
void guarded(Grads &gr, Body body) {
    int t;
    try {
        t = body();
    } catch (const std::exception &e) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, e.what());
        t = -1;
    }
    if (t < 0) grad_failed(gr);
}

// functools.partial(f, *args) (a new reference), or nullptr with an error
PyObject *partial_of(PyObject *f, PyObject *args) {
    PyObject *functools = PyImport_ImportModule("functools");
    PyObject *make = functools ? PyObject_GetAttrString(functools, "partial") : nullptr;
    PyObject *first = make ? PyTuple_Pack(1, f) : nullptr;
    PyObject *all = first ? PySequence_Concat(first, args) : nullptr;
    PyObject *partial = all ? PyObject_CallObject(make, all) : nullptr;
    for (PyObject *o : {functools, make, first, all}) Py_XDECREF(o);
    return partial;
}

// Compiled autograd traces a node's hooks as Python: hand it the Python hook this one
// stands for, GradHooks.<name>(*bound(), grads) (nothing where the layer is gone)
template <class Bound>
void python_twin(const Shared &gr, PyObject *name, Bound bound,
                 torch::dynamo::autograd::CompiledNodeArgs &compiled) {
    PyGILState_STATE gil = PyGILState_Ensure();
    PyObject *method = method_of(*gr, name);
    PyObject *args = method ? bound() : nullptr;
    PyObject *partial = args ? partial_of(method, args) : nullptr;
    for (PyObject *o : {method, args}) Py_XDECREF(o);
    if (partial == nullptr) {
        PyErr_Clear();
        PyGILState_Release(gil);
        return;
    }
    compiled.add_pre_hook(c10::SafePyObject(partial, getPyInterpreter()));
    PyGILState_Release(gil);
}

// A node's pre-hook: its output k's gradient at `site` (GradHooks._node's C++ twin)
struct SiteHook : torch::autograd::FunctionPreHook {
    Shared gr;
    int site;
    size_t k;
    SiteHook(Shared g, int s, size_t i) : gr(std::move(g)), site(s), k(i) {}
    void compiled_args(torch::dynamo::autograd::CompiledNodeArgs &args) const override {
        python_twin(gr, names.node, [&] { return Py_BuildValue("(in)", site, (Py_ssize_t)k); },
                    args);
    }
    torch::autograd::variable_list operator()(
        const torch::autograd::variable_list &grads) override {
        if (k >= grads.size() || !grads[k].defined()) return grads;
        Firing f(gr);
        if (f.now != 1) return grads;
        guarded(*gr, [&] {
            const at::Tensor &g = grads[k];
            int t = g.numel() ? read_site(*gr, site, g) : 1;
            if (t != 0) return t;
            PyObject *go = wrapped(g);  // the Python hook's way
            PyObject *args = go ? Py_BuildValue("(iiN)", site, 0, Py_BuildValue("(N)", go))
                                : nullptr;
            t = args && fallback(*gr, names.node, args) == 0 ? 1 : -1;
            Py_XDECREF(args);
            return t;
        });
        return grads;
    }
};

// The output node's pre-hook: its output k's gradient and, from it, the norm's input x
// and weight w, the gradient through the norm (GradHooks._both's C++ twin)
struct OutHook : torch::autograd::FunctionPreHook {
    Shared gr;
    size_t k;
    at::Tensor x, w;
    uint32_t version;
    OutHook(Shared g, size_t i, at::Tensor x_, at::Tensor w_)
        : gr(std::move(g)), k(i), x(std::move(x_)), w(std::move(w_)), version(x._version()) {}
    void compiled_args(torch::dynamo::autograd::CompiledNodeArgs &args) const override {
        python_twin(gr, names.both, [&] {
            PyObject *xo = wrapped(x), *wo = wrapped(w);
            PyObject *bound = xo && wo
                ? Py_BuildValue("(n[OOI])", (Py_ssize_t)k, xo, wo, version) : nullptr;
            Py_XDECREF(xo);
            Py_XDECREF(wo);
            return bound;
        }, args);
    }
    torch::autograd::variable_list operator()(
        const torch::autograd::variable_list &grads) override {
        if (k >= grads.size() || !grads[k].defined() || !x.defined()) return grads;
        at::Tensor xs = std::move(x), ws = std::move(w);  // (let go here, as _both does)
        x.reset();
        w.reset();
        Firing f(gr);
        if (f.now != 1) return grads;
        guarded(*gr, [&] {
            const at::Tensor &g = grads[k];
            int t = g.numel() ? read(g, xs, ws) : 1;
            if (t != 0) return t;
            // the Python hook's way (its version check, torch's ops)
            PyObject *xo = wrapped(xs), *wo = wrapped(ws), *go = wrapped(g);
            PyObject *args = xo && wo && go
                ? Py_BuildValue("(iNN)", 0, Py_BuildValue("[OOI]", xo, wo, version),
                                Py_BuildValue("(O)", go))
                : nullptr;
            for (PyObject *o : {xo, wo, go}) Py_XDECREF(o);
            t = args && fallback(*gr, names.both, args) == 0 ? 1 : -1;
            Py_XDECREF(args);
            return t;
        });
        return grads;
    }
    // 1 read here, 0 not the plain case, -1 an error
    int read(const at::Tensor &g, const at::Tensor &xs, const at::Tensor &ws) {
        return xs._version() != version ? 0 : read_out(*gr, g, xs, ws);
    }
};

// The gradient through the norm, from the parts its own nodes send to x: gathered by
// their post-hooks (ThroughHook; GradHooks' _Through's C++ twin), read once the last came
struct Gather {
    Shared gr;
    int count, left;
    std::vector<at::Tensor> parts;
    std::optional<c10::SafePyObject> twin;  // compiled autograd's (GradHooks._gather)
    Gather(Shared g, int n) : gr(std::move(g)), count(n), left(n) {}
};

// A norm's node's post-hook: the part of dL/dx its edge k into x carries
struct ThroughHook : torch::autograd::FunctionPostHook {
    std::shared_ptr<Gather> gather;
    size_t k;
    ThroughHook(std::shared_ptr<Gather> g, size_t i) : gather(std::move(g)), k(i) {}
    torch::autograd::variable_list operator()(
        const torch::autograd::variable_list &outputs,
        const torch::autograd::variable_list &) override {
        Gather &t = *gather;
        PyGILState_STATE gil = PyGILState_Ensure();  // (the parts, one hook at a time)
        t.left -= 1;
        if (k < outputs.size() && outputs[k].defined()) t.parts.push_back(outputs[k]);
        if (t.left == 0 && !t.parts.empty()) {
            std::vector<at::Tensor> parts = std::move(t.parts);
            t.parts.clear();
            Firing f(t.gr);
            if (f.now == 1) guarded(*t.gr, [&] { return read_through(*t.gr, parts); });
        }
        PyGILState_Release(gil);
        return outputs;
    }
    // compiled autograd: one Python gatherer for the nodes (GradHooks._gather), called
    // as a post-hook with k first, as _Through.watch places it
    void compiled_args(torch::dynamo::autograd::CompiledNodeArgs &args) const override {
        PyGILState_STATE gil = PyGILState_Ensure();
        Gather &t = *gather;
        if (!t.twin) {
            PyObject *make = method_of(*t.gr, names.gather);
            PyObject *made = make ? PyObject_CallFunction(make, "i", t.count) : nullptr;
            Py_XDECREF(make);
            if (made != nullptr) t.twin.emplace(made, getPyInterpreter());
        }
        PyObject *edge = t.twin ? Py_BuildValue("(n)", (Py_ssize_t)k) : nullptr;
        PyObject *partial = edge ? partial_of(t.twin->ptr(getPyInterpreter()), edge) : nullptr;
        Py_XDECREF(edge);
        if (partial != nullptr)
            args.add_post_hook(c10::SafePyObject(partial, getPyInterpreter()));
        PyErr_Clear();
        PyGILState_Release(gil);
    }
};

// Post-hooks on `nodes` (each with its edge k into x) gathering the gradient through the
// norm (nothing where there are none)
void gather_through(const Shared &gr,
                    const std::vector<std::pair<torch::autograd::Node *, size_t>> &nodes) {
    if (nodes.empty()) return;
    auto gather = std::make_shared<Gather>(gr, (int)nodes.size());
    for (const auto &[node, k] : nodes)
        node->add_post_hook(std::make_unique<ThroughHook>(gather, k));
}

// The nodes between y's and x's (x not a leaf) that feed x directly, each with the index of
// its edge into x: GradHooks' through_nodes, walked alike (none past max_nodes)
std::vector<std::pair<torch::autograd::Node *, size_t>> through_nodes(const at::Tensor &y,
                                                                      const at::Tensor &x) {
    std::vector<std::pair<torch::autograd::Node *, size_t>> found;
    torch::autograd::Node *start = y.grad_fn().get(), *target = x.grad_fn().get();
    if (start == nullptr || target == nullptr) return found;
    uint64_t floor = target->sequence_nr();
    std::vector<torch::autograd::Node *> stack{start};
    std::unordered_set<torch::autograd::Node *> seen{start};
    while (!stack.empty()) {
        torch::autograd::Node *node = stack.back();
        stack.pop_back();
        const auto &edges = node->next_edges();
        for (size_t k = 0; k < edges.size(); k++) {
            torch::autograd::Node *next = edges[k].function.get();
            if (next == nullptr) continue;
            if (next == target) {
                if (edges[k].input_nr == x.output_nr()) found.emplace_back(node, k);
                continue;
            }
            if (dynamic_cast<torch::autograd::AccumulateGrad *>(next) != nullptr)
                continue;  // a leaf (a parameter: x is none)
            if (seen.count(next) || next->sequence_nr() < floor) continue;
            seen.insert(next);
            if ((int64_t)seen.size() > max_nodes) return {};
            stack.push_back(next);
        }
    }
    return found;
}

int weight_read(Grads &r, const at::Tensor &g);

// The weight's tensor pre-hook: its gradient (GradHooks._weight_grad's C++ twin)
struct WeightHook : torch::autograd::FunctionPreHook {
    Shared gr;
    explicit WeightHook(Shared g) : gr(std::move(g)) {}
    torch::autograd::variable_list operator()(
        const torch::autograd::variable_list &grads) override {
        if (grads.empty() || !grads[0].defined()) return grads;
        Firing f(gr);
        if (f.now == 1) guarded(*gr, [&] { return weight_read(*gr, grads[0]); });
        return grads;
    }
    // compiled autograd: GradHooks._weight_grad, as a tensor hook (called with the grad)
    void compiled_args(torch::dynamo::autograd::CompiledNodeArgs &args) const override {
        PyGILState_STATE gil = PyGILState_Ensure();
        PyObject *method = method_of(*gr, names.weight_grad);
        PyErr_Clear();
        if (method != nullptr)
            args.add_tensor_pre_hook(c10::SafePyObject(method, getPyInterpreter()), 0);
        PyGILState_Release(gil);
    }
};

// The weight's gradient read: 1 (here or by the Python hook's method) or -1 an error
int weight_read(Grads &r, const at::Tensor &g) {
    int t = read_weight(r, g);
    if (t == 0) {
        PyObject *go = wrapped(g);
        PyObject *args = go ? Py_BuildValue("(N)", go) : nullptr;
        t = args && fallback(r, names.weight_grad, args) == 0 ? 1 : -1;
        Py_XDECREF(args);
    }
    return t;
}

// grads(owner weakref, runtime, lender, GradRows, row, width, eps, site planner
// (readers.grad_read_plan, or a launcher's lane_grad_plan), through planner
// (ThroughReader.plan), launcher (its lane_grad_launch, or None)): a layer's capsule
PyObject *make_grads(PyObject *, PyObject *args) {
    PyObject *o[8];
    long long width;
    double eps;
    if (!PyArg_ParseTuple(args, "OOOOOLdOOO", &o[0], &o[1], &o[2], &o[3], &o[4], &width, &eps,
                          &o[5], &o[6], &o[7]))
        return nullptr;
    if (!PyWeakref_CheckRef(o[0])) return PyErr_Format(PyExc_TypeError, "grads: a weakref");
    if (!PyType_Check(o[3]) ||
        !PyType_IsSubtype(reinterpret_cast<PyTypeObject *>(o[3]), &PyTuple_Type))
        return PyErr_Format(PyExc_TypeError, "grads: rows type: a tuple's subclass");
    auto shared = std::make_shared<Grads>();
    PyObject **slots[8] = {&shared->owner, &shared->runtime, &shared->lender, &shared->rows_type,
                           &shared->row, &shared->site_planner, &shared->through_planner,
                           &shared->launcher};
    for (int i = 0; i < 8; i++) {
        Py_INCREF(o[i]);
        *slots[i] = o[i];
    }
    shared->width = width;
    shared->eps = eps;
    auto *held = new Shared(std::move(shared));
    PyObject *capsule = PyCapsule_New(held, "normwatch.grads", drop_grads);
    if (capsule == nullptr) {
        (*held)->close();
        delete held;
    }
    return capsule;
}

PyObject *close(PyObject *, PyObject *capsule) {
    Shared *held = held_grads(capsule);
    if (held == nullptr) return nullptr;
    (*held)->close();
    Py_RETURN_NONE;
}

// The capsule's gradients and a tensor argument's node (or nullptr with an error set)
Shared *unpack(PyObject *capsule, PyObject *t, at::Tensor &out) {
    Shared *held = held_grads(capsule);
    if (held == nullptr) return nullptr;
    if (!THPVariable_Check(t)) {
        PyErr_SetString(PyExc_TypeError, "grads: a tensor");
        return nullptr;
    }
    out = THPVariable_Unpack(t);
    return held;
}

}  // namespace

// The gradient hooks of a full-tier call's common case (lane.cpp's full_tail): the hidden
// state's on x's node, then the output's with the one through the norm on y's, as
// GradHooks.watch_call places them
int normwatch::hook_call_gradients(PyObject *capsule, const at::Tensor &x,
                                   const at::Tensor &y, const at::Tensor &w) {
    Shared *held = held_grads(capsule);
    if (held == nullptr) return -1;
    x.grad_fn()->add_pre_hook(std::make_unique<SiteHook>(*held, SITE_HIDDEN, x.output_nr()));
    y.grad_fn()->add_pre_hook(std::make_unique<OutHook>(*held, y.output_nr(), x, w));
    return 0;
}

// A launch lane's full-tier call's gradient hooks (lane.cpp's full_tail): the hidden
// state's on x's node, the output's on y's, the gradient through the norm's on the norm's
// own nodes, as GradHooks.watch_call places them where the backend computes no gradient
int normwatch::hook_launch_gradients(PyObject *capsule, const at::Tensor &x,
                                     const at::Tensor &y) {
    Shared *held = held_grads(capsule);
    if (held == nullptr) return -1;
    x.grad_fn()->add_pre_hook(std::make_unique<SiteHook>(*held, SITE_HIDDEN, x.output_nr()));
    y.grad_fn()->add_pre_hook(std::make_unique<SiteHook>(*held, SITE_OUT, y.output_nr()));
    gather_through(*held, through_nodes(y, x));
    return 0;
}

int64_t normwatch::max_nodes = 64;

namespace {

PyObject *hook_site(PyObject *, PyObject *args) {
    PyObject *capsule, *to;
    int site;
    if (!PyArg_ParseTuple(args, "OOi", &capsule, &to, &site)) return nullptr;
    at::Tensor t;
    Shared *held = unpack(capsule, to, t);
    if (held == nullptr) return nullptr;
    const auto &node = t.grad_fn();
    if (!node) return PyErr_Format(PyExc_ValueError, "hook_site: a tensor with a node");
    node->add_pre_hook(std::make_unique<SiteHook>(*held, site, t.output_nr()));
    Py_RETURN_NONE;
}

PyObject *hook_out(PyObject *, PyObject *args) {
    PyObject *capsule, *yo, *xo, *wo;
    if (!PyArg_ParseTuple(args, "OOOO", &capsule, &yo, &xo, &wo)) return nullptr;
    at::Tensor y, x, w;
    Shared *held = unpack(capsule, yo, y);
    if (held == nullptr || unpack(capsule, xo, x) == nullptr) return nullptr;
    if (wo != Py_None && unpack(capsule, wo, w) == nullptr) return nullptr;
    const auto &node = y.grad_fn();
    if (!node) return PyErr_Format(PyExc_ValueError, "hook_out: a tensor with a node");
    node->add_pre_hook(std::make_unique<OutHook>(*held, y.output_nr(), x, w));
    Py_RETURN_NONE;
}

// Post-hooks on the norm's nodes [(node, k), ...] that feed its input, gathering the
// gradient through it: True, or False where a node is not a C++ one (none placed)
PyObject *hook_through(PyObject *, PyObject *args) {
    PyObject *capsule, *nodes;
    if (!PyArg_ParseTuple(args, "OO!", &capsule, &PyList_Type, &nodes)) return nullptr;
    Shared *held = held_grads(capsule);
    if (held == nullptr) return nullptr;
    Py_ssize_t n = PyList_GET_SIZE(nodes);
    std::vector<std::pair<torch::autograd::Node *, size_t>> found;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *pair = PyList_GET_ITEM(nodes, i), *node;
        Py_ssize_t k;
        if (!PyTuple_Check(pair) || !PyArg_ParseTuple(pair, "On", &node, &k) || k < 0)
            return PyErr_Format(PyExc_TypeError, "hook_through: a list of (node, k)");
        if (!torch::autograd::THPCppFunction_Check(node)) Py_RETURN_FALSE;
        found.emplace_back(
            reinterpret_cast<torch::autograd::THPCppFunction *>(node)->cdata.get(), (size_t)k);
    }
    if (found.empty()) Py_RETURN_FALSE;
    gather_through(*held, found);
    Py_RETURN_TRUE;
}

PyObject *hook_weight(PyObject *, PyObject *args) {
    PyObject *capsule, *wo;
    if (!PyArg_ParseTuple(args, "OO", &capsule, &wo)) return nullptr;
    at::Tensor w;
    Shared *held = unpack(capsule, wo, w);
    if (held == nullptr) return nullptr;
    if (!w.requires_grad()) return PyErr_Format(PyExc_ValueError, "hook_weight: no grad");
    auto hook = std::make_unique<WeightHook>(*held);
    void *handle = hook.get();
    // appended beside any hook already there (impl::add_hook asserts there is none: a
    // weight Python hooked once, by the user or a watch before, would abort the process)
    torch::autograd::impl::hooks(w).push_back(std::move(hook));
    return PyLong_FromVoidPtr(handle);
}

// Remove w's hook `handle` (hook_weight's; harmless where it is gone)
PyObject *unhook(PyObject *, PyObject *args) {
    PyObject *wo, *handle;
    if (!PyArg_ParseTuple(args, "OO", &wo, &handle)) return nullptr;
    if (!THPVariable_Check(wo)) return PyErr_Format(PyExc_TypeError, "unhook: a tensor");
    void *p = PyLong_AsVoidPtr(handle);
    if (p == nullptr && PyErr_Occurred()) return nullptr;
    auto &hooks = torch::autograd::impl::hooks(THPVariable_Unpack(wo));
    hooks.erase(std::remove_if(hooks.begin(), hooks.end(),
                               [p](const auto &h) { return h.get() == p; }),
                hooks.end());
    Py_RETURN_NONE;
}

}  // namespace

PyMethodDef normwatch_grads_methods[] = {
    {"grads", make_grads, METH_VARARGS, "one layer's gradient hooks (a capsule)"},
    {"close", close, METH_O, "close(capsule): its hooks do nothing from now on"},
    {"hook_site", hook_site, METH_VARARGS, "hook_site(capsule, t, site): t's node's pre-hook"},
    {"hook_out", hook_out, METH_VARARGS,
     "hook_out(capsule, y, x, weight): y's node's pre-hook, with the gradient through"},
    {"hook_through", hook_through, METH_VARARGS,
     "hook_through(capsule, [(node, k), ...]): the norm's nodes' post-hooks (False: none)"},
    {"hook_weight", hook_weight, METH_VARARGS, "hook_weight(capsule, w): w's hook's handle"},
    {"unhook", unhook, METH_VARARGS, "unhook(w, handle)"},
    {nullptr, nullptr, 0, nullptr}};
