// The forward lane in C++ (normwatch.measure.backends.native.lane builds and loads the
// module; contract.py states what it reads and writes of Python's, and gives the names).
//
// hook(layer, module, args, kwargs, output) is registered with torch as
// functools.partial(hook, layer): torch's hook loop calls it with no Python frame. A
// training call of the common CPU case is recorded here as Recorder.record records it
// with the native backend: the same C reader (normwatch_rows_planned), a buffer from the
// same lender, the same CallRows staged, the same counts; in the full tier, with the
// layer's moments; then on the interval's first call and a full-tier call that is not the
// common case the layer's _tail (Recorder.after); the common full-tier call's rest here
// (full_tail). A launch lane (a layer the Triton backend serves: on CUDA, or in Triton's
// interpreter) reads the call by the backend's launcher instead, into a buffer from the
// same lender: the same CallRows, with no Python frame but the launch's (and on full-tier
// calls its gradient hooks, grads.cpp's, reading by the launcher too). Any other call,
// every call while Dynamo traces (a Python stand-in) and every call where Dynamo compiles
// the frames run (see hook) goes to the Python hook. An error here disables the layer as
// the Python hook's would (its _fail): training goes on.
#include "lane.h"

#include <ATen/Parallel.h>
#include <ATen/SavedTensorHooks.h>
#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/graph_task.h>

#include <algorithm>
#include <string>
#include <vector>

namespace {

using namespace normwatch;

PyObject *s_shape = nullptr;  // "shape": a tensor's, torch's name

constexpr int PLAN_SIZE = 9;   // normwatch_rows_planned's plan (readers.row_plan's args)
constexpr int ROWS_FIELDS = 10;  // CallRows' (contract.ROWS_FIELDS)

// One layer's lane: what LayerHook hands over once (owned references), and per tier
// (sentinel, full) its plan (a launch lane's: its launcher's); `launcher` None but in a
// launch lane
struct Lane {
    PyObject *runtime, *recorder, *counts, *lender, *planner, *call_type, *row, *eps,
        *centred, *moments, *launcher;
    int64_t width, key_stride;
    Plan tiers[2];
    // The dtypes the recorder's record_dtypes last noted from here (full_tail): its
    // signature then (owned), and what that signature is made of
    PyObject *signature = nullptr;
    int64_t dtypes[5] = {-1, -1, -1, -1, -1};
    std::string op;
};

void drop(PyObject *capsule) {
    auto *lane = static_cast<Lane *>(PyCapsule_GetPointer(capsule, "normwatch.lane"));
    if (lane == nullptr) return;
    for (PyObject *o : {lane->runtime, lane->recorder, lane->counts, lane->lender,
                        lane->planner, lane->call_type, lane->row, lane->eps, lane->centred,
                        lane->moments, lane->launcher, lane->signature})
        Py_XDECREF(o);
    for (Plan &p : lane->tiers) release(p);
    delete lane;
}

// The tier's plan for x and y's layout (asked of the planner on a new one, with the
// layer's moments in the full tier), copied into `plan` and `shape` (a new reference)
// where planned: 1 planned, 0 not covered, -1 an error. (Copied while the GIL is held
// throughout: the lender's Python after it may let another thread in, whose call of this
// layer may plan another layout.)
int planned(Lane *lane, bool full, PyObject *xo, PyObject *yo, const at::Tensor &x,
            const at::Tensor &y, int64_t *plan, PyObject **shape) {
    Plan &tier = lane->tiers[full];
    if (!same_layout(tier, x, y.scalar_type())) {
        Owned got(PyObject_CallFunctionObjArgs(lane->planner, xo, yo,
                                               full ? lane->moments : Py_None, nullptr));
        if (got.p == nullptr || take_plan(tier, got.p, x, y.scalar_type()) < 0) return -1;
        if (tier.planned && (tier.args.size() != PLAN_SIZE || tier.shape == nullptr)) {
            tier.threads = -1;
            PyErr_SetString(PyExc_ValueError, "lane: a plan of 9 and the rows' shape");
            return -1;
        }
    }
    if (!tier.planned) return 0;
    std::copy(tier.args.begin(), tier.args.end(), plan);
    Py_INCREF(*shape = tier.shape);
    return 1;
}

int full_tail(Lane *lane, PyObject *module, PyObject *args, PyObject *kwargs, PyObject *xo,
              PyObject *yo, const at::Tensor &x, const at::Tensor &y);
int note_dtypes(Lane *lane, PyObject *module, PyObject *xo, PyObject *yo, const at::Tensor &x,
                const at::Tensor &y, const at::Tensor &w);
int compiled_tail(Lane *lane, int64_t calls, PyObject *xo, PyObject *yo);

// getattr(module, "weight", None): a new reference, or nullptr with an error
PyObject *weight_of(PyObject *module) {
    PyObject *weight = PyObject_GetAttr(module, names.weight);
    if (weight != nullptr || !PyErr_ExceptionMatches(PyExc_AttributeError)) return weight;
    PyErr_Clear();
    return Py_NewRef(Py_None);
}

// A launch lane's read of a call of `tokens` tokens: a buffer from the lender, of the
// tier's plan for x and y's layout, filled by one launch on x's stream (the plan's static
// launch, from here; else the backend's lane_launch). The buffer (a new reference),
// Py_None where the planner does not cover the layout (a new reference too), nullptr an
// error.
PyObject *launch_rows(Lane *lane, bool full, PyObject *xo, PyObject *yo, const at::Tensor &x,
                      const at::Tensor &y, int64_t tokens) {
    Plan &tier = lane->tiers[full];
    if (!same_layout(tier, x, y.scalar_type())) {
        PyObject *ask[4] = {xo, yo, full ? Py_True : Py_False, lane->centred};
        Owned got(PyObject_Vectorcall(lane->planner, ask, 4, nullptr));
        if (got.p == nullptr || take_plan(tier, got.p, x, y.scalar_type()) < 0) return nullptr;
    }
    if (!tier.planned) return Py_NewRef(Py_None);
    PyObject *buffer = lend_launch(lane->lender, tier);
    if (buffer == nullptr) return nullptr;
    int t = launch_native(tier, -1, {&x, &y, &THPVariable_Unpack(buffer)});
    if (t != 0) {
        if (t < 0) Py_CLEAR(buffer);
        return buffer;
    }
    Owned n(PyLong_FromLongLong(tokens)), width(PyLong_FromLongLong(lane->width));
    PyObject *run[7] = {xo, yo, buffer, n.p, width.p, full ? Py_True : Py_False, lane->centred};
    Owned done(n.p && width.p ? PyObject_Vectorcall(lane->launcher, run, 7, nullptr) : nullptr);
    if (done.p == nullptr) Py_CLEAR(buffer);
    return buffer;
}

// A call of the common case read and staged as Recorder.record stages it, its counts
// added: the watch not paused, no output check pending, x and y plain tensors alike
// whose last dim is one token, readable by the lane. 1 staged (`full`: its tier,
// `calls`: the layer's counted calls before it), 0 not the common case (nothing done),
// -1 an error
int staged(Lane *lane, PyObject *xo, PyObject *yo, int *full, int64_t *calls) {
    if (!THPVariable_CheckExact(xo) || !THPVariable_CheckExact(yo)) return 0;
    PyObject *rt = lane->runtime, *c = lane->counts;
    int t;
    if ((t = truth(rt, names.paused)) != 0) return t < 0 ? -1 : 0;
    if ((*full = truth(rt, names.full_stats)) < 0) return -1;
    if ((*calls = integer(c, names.calls)) < 0) return *calls == -1 && PyErr_Occurred() ? -1 : 0;
    if ((t = truth(rt, names.check_outputs)) != 0) {  // the interval's output check pending
        if (t < 0) return -1;
        if ((t = truth(c, names.output_checked)) != 1) return t;
    }
    const at::Tensor &x = THPVariable_Unpack(xo);
    const at::Tensor &y = THPVariable_Unpack(yo);
    bool launch = lane->launcher != Py_None;
    if (x.dim() == 0 || x.size(-1) != lane->width || y.numel() == 0 ||
        !(launch ? launchable(x, y) : readable(x) && readable(y)) ||
        !x.sizes().equals(y.sizes()))
        return 0;
    int64_t tokens = x.numel() / lane->width;
    PyObject *buffer;
    if (launch) {
        if ((buffer = launch_rows(lane, *full, xo, yo, x, y, tokens)) == nullptr) return -1;
        if (buffer == Py_None) {
            Py_DECREF(buffer);
            return 0;
        }
    } else {
        int64_t plan[PLAN_SIZE];
        PyObject *shape;
        if ((t = planned(lane, *full, xo, yo, x, y, plan, &shape)) != 1) return t;
        buffer = lend(lane->lender, shape);
        Py_DECREF(shape);
        if (buffer == nullptr) return -1;
        if (rows_planned(x.const_data_ptr(), y.const_data_ptr(),
                         THPVariable_Unpack(buffer).mutable_data_ptr<float>(), plan) != 0) {
            Py_DECREF(buffer);
            PyErr_SetString(PyExc_RuntimeError, "lane: the C reader refused the call");
            return -1;
        }
    }
    int64_t step = integer(rt, names.step), at = step == -1 && PyErr_Occurred()
                                                     ? -1 : integer(rt, names.calls_this_step);
    if (at == -1 && PyErr_Occurred()) {
        Py_DECREF(buffer);
        return -1;
    }
    PyObject *key = PyFloat_FromDouble((double)(step * lane->key_stride + at));
    PyObject *width = PyLong_FromLongLong(lane->width), *count = PyLong_FromLongLong(tokens);
    auto *type = reinterpret_cast<PyTypeObject *>(lane->call_type);
    PyObject *call = key && width && count ? type->tp_alloc(type, ROWS_FIELDS) : nullptr;
    if (call == nullptr) {
        for (PyObject *o : {key, width, count, buffer}) Py_XDECREF(o);
        return -1;
    }
    // CallRows(row, key, width, eps, v, n, lined_up, full, centred, out)
    PyObject *borrowed[ROWS_FIELDS] = {lane->row, nullptr, nullptr, lane->eps, nullptr,
                                       nullptr, Py_True, *full ? Py_True : Py_False,
                                       lane->centred, Py_None};
    PyObject *owned[ROWS_FIELDS] = {nullptr, key, width, nullptr, buffer, count};
    for (int i = 0; i < ROWS_FIELDS; i++) {
        PyObject *v = owned[i] ? owned[i] : borrowed[i];
        if (!owned[i]) Py_INCREF(v);
        PyTuple_SET_ITEM(call, i, v);
    }
    int r = stage(rt, names.staged_calls, call, tokens);
    Py_DECREF(call);
    if (r < 0) return -1;
    Owned size(PyObject_GetAttr(xo, s_shape));  // (torch's Tensor.shape)
    if (size.p == nullptr || add(rt, names.calls_this_step, 1) < 0 ||
        add(c, names.calls, 1) < 0 || add(c, names.tokens, tokens) < 0 ||
        PyObject_SetAttr(c, names.input_shape, size.p) < 0)
        return -1;
    return 1;
}

// The eager lane: 1 measured, 0 not taken (the Python hook measures it), -1 an error
int measured(Lane *lane, PyObject *layer, PyObject *module, PyObject *args, PyObject *kwargs,
             PyObject *output) {
    if (!PyTuple_Check(args) || PyTuple_GET_SIZE(args) < 1) return 0;
    PyObject *xo = PyTuple_GET_ITEM(args, 0);
    int t, full;
    int64_t calls;
    if ((t = truth(module, names.training)) != 1) return t;  // (a training call with grad)
    if (!at::GradMode::is_enabled() || torch::autograd::get_current_graph_task_id() != -1)
        return 0;
    if ((t = staged(lane, xo, output, &full, &calls)) != 1) return t;
    if (!full && calls > 0) return 1;
    if (full && calls > 0 &&
        (t = full_tail(lane, module, args, kwargs, xo, output, THPVariable_Unpack(xo),
                       THPVariable_Unpack(output))) != 0)
        return t;
    // the rest of a full-tier or first call: the gradients hooked (full), the dtypes and
    // the place in the forward order noted (the layer's _tail: Recorder.after)
    PyObject *rest[6] = {layer, module, args, kwargs, output, full ? Py_True : Py_False};
    Owned done(PyObject_VectorcallMethod(names.tail, rest, 6, nullptr));
    return done.p == nullptr ? -1 : 1;
}

// Disable `layer` as its own hook does (an Exception; anything else goes on up)
PyObject *failed(PyObject *layer) {
    if (!PyErr_ExceptionMatches(PyExc_Exception)) return nullptr;
    if (hand_to_fail(layer) < 0) return nullptr;
    Py_RETURN_NONE;
}

// The capsule of `owner`'s lane state (owner._lane_state.capsule; None where the state is
// None): a new reference, or nullptr with an error
PyObject *capsule_of(PyObject *owner) {
    PyObject *state = PyObject_GetAttr(owner, names.lane_state);  // a lane.State, or None
    if (state == nullptr || state == Py_None) return state;  // (None: the reference moves)
    PyObject *capsule = PyObject_GetAttr(state, names.capsule);
    Py_DECREF(state);
    return capsule;
}

// The lane in `capsule` (nullptr: None, or an error set)
Lane *lane_in(PyObject *capsule) {
    return capsule == Py_None ? nullptr
                              : static_cast<Lane *>(PyCapsule_GetPointer(capsule, "normwatch.lane"));
}

// f(lane) on the lane in `capsule` (0 where it holds none), a C++ exception turned into
// the Python error: 1, 0, or -1 an error
template <typename F>
int on_lane(PyObject *capsule, F f) {
    Lane *lane = lane_in(capsule);
    if (lane == nullptr) return PyErr_Occurred() ? -1 : 0;
    try {
        return f(lane);
    } catch (const std::exception &e) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, e.what());
        return -1;
    }
}

PyObject *hook(PyObject *, PyObject *const *a, Py_ssize_t n) {
    if (n != 5) {
        PyErr_SetString(PyExc_TypeError, "hook(layer, module, args, kwargs, output)");
        return nullptr;
    }
    PyObject *layer = a[0];
    // There the Python hook is traced as in a compiled graph, not run here: the Python
    // this lane calls (the lender, the accumulator, _tail) would each be compiled apart.
    int dynamo = compiling_frames();
    if (dynamo < 0) return failed(layer);
    if (dynamo) return PyObject_Vectorcall(layer, a + 1, 4, nullptr);
    PyObject *capsule = capsule_of(layer);
    if (capsule == nullptr) return failed(layer);
    int r = on_lane(capsule, [&](Lane *lane) {
        return measured(lane, layer, a[1], a[2], a[3], a[4]);
    });
    Py_DECREF(capsule);
    if (r == 1) Py_RETURN_NONE;
    if (r < 0) return failed(layer);
    return PyObject_Vectorcall(layer, a + 1, 4, nullptr);  // the Python hook
}

// observe(path, x, y, alone): a compiled call's operator body (normwatch::observe's,
// bound to the layer's CompiledPath), the common case here as CompiledPath.compiled_call
// records it: the call's grad mode and training were decided where it was traced; a
// call inside a backward (an activation checkpoint's recompute) counts nothing. Any
// other call goes to path.compiled_call; an error disables the layer (path._fail).
PyObject *compiled(PyObject *, PyObject *const *a, Py_ssize_t n) {
    if (n != 4) {
        PyErr_SetString(PyExc_TypeError, "observe(path, x, y, alone)");
        return nullptr;
    }
    PyObject *path = a[0];
    if (torch::autograd::get_current_graph_task_id() != -1) Py_RETURN_NONE;
    PyObject *capsule = capsule_of(path);
    if (capsule == nullptr) return failed(path);
    int r = on_lane(capsule, [&](Lane *lane) {
        int full, t;
        int64_t calls;
        t = staged(lane, a[1], a[2], &full, &calls);
        return t == 1 ? compiled_tail(lane, calls, a[1], a[2]) : t;
    });
    Py_DECREF(capsule);
    if (r == 1) Py_RETURN_NONE;
    if (r < 0) return failed(path);
    return PyObject_VectorcallMethod(names.python_call, a, 4, nullptr);
}

// A compiled gradient of a measured step (observe_grad's args after the path: site, g, x,
// weight) read by the layer's C++ gradient hooks: 1 read, 0 not theirs (Python's), -1 an
// error
int gradient(Lane *lane, PyObject *const *a) {
    long site = PyLong_AsLong(a[0]);
    if (site == -1 && PyErr_Occurred()) return -1;
    if (!THPVariable_CheckExact(a[1]) || (a[2] != Py_None && !THPVariable_CheckExact(a[2])) ||
        (a[3] != Py_None && !THPVariable_CheckExact(a[3])))
        return 0;
    Owned grads(PyObject_GetAttr(lane->recorder, names.grads));
    if (grads.p == nullptr || grads.p == Py_None) return grads.p ? 0 : -1;
    Owned gradlane(PyObject_GetAttr(grads.p, names.grad_lane));
    if (gradlane.p == nullptr || gradlane.p == Py_None) return gradlane.p ? 0 : -1;
    Owned capsule(PyObject_GetAttr(gradlane.p, names.capsule));
    if (capsule.p == nullptr) return -1;
    at::Tensor none;
    return compiled_gradient(capsule.p, (int)site, THPVariable_Unpack(a[1]),
                             a[2] == Py_None ? none : THPVariable_Unpack(a[2]),
                             a[3] == Py_None ? none : THPVariable_Unpack(a[3]));
}

// observe_grad(path, site, g, x, weight): a compiled gradient's operator body
// (normwatch::observe_grad's, bound to the layer's CompiledPath): nothing where this
// step's backward is not measured (Runtime.grads_now); else its plain case read by the
// layer's C++ gradient hooks, every other by path.compiled_grad.
PyObject *compiled_grad(PyObject *, PyObject *const *a, Py_ssize_t n) {
    if (n != 5) {
        PyErr_SetString(PyExc_TypeError, "observe_grad(path, site, g, x, weight)");
        return nullptr;
    }
    PyObject *capsule = capsule_of(a[0]);
    if (capsule == nullptr) return failed(a[0]);
    int r = on_lane(capsule, [&](Lane *lane) {
        int t = grads_now(lane->runtime);
        if (t != 1) return t < 0 ? -1 : 1;  // not measured: nothing to do
        return gradient(lane, a + 1);
    });
    Py_DECREF(capsule);
    if (r == 1) Py_RETURN_NONE;
    if (r < 0) return failed(a[0]);
    return PyObject_VectorcallMethod(names.python_grad, a, 5, nullptr);
}

// The rest of a full-tier call that is not the interval's first (Recorder.after's work),
// its common case here: x the call's only argument, both with autograd nodes; the
// C reader's (a CPU lane's): both float32, the gradient through the norm computed
// (GradHooks.computes: no saved-tensor hooks, a float32 weight of one element per x's,
// or none), a launch lane's: any dtypes (its backend computes no gradient through the
// norm: GradHooks.watch_call hooks the norm's own nodes); the weight, if any, already
// hooked. The layer's C++ gradient hooks placed as GradHooks.watch_call places them, then
// the dtypes noted where they changed since this lane last noted them (the recorder's
// record_dtypes, called). 1 done, 0 not that case (nothing done: the Python _tail does
// it), -1 an error.
int full_tail(Lane *lane, PyObject *module, PyObject *args, PyObject *kwargs, PyObject *xo,
              PyObject *yo, const at::Tensor &x, const at::Tensor &y) {
    bool launch = lane->launcher != Py_None;
    if (PyTuple_GET_SIZE(args) != 1 ||
        (kwargs != nullptr && kwargs != Py_None &&
         (!PyDict_Check(kwargs) || PyDict_GET_SIZE(kwargs) != 0)))
        return 0;
    if (!x.requires_grad() || !y.requires_grad() || !x.grad_fn() || !y.grad_fn() ||
        (!launch && (through == nullptr || y.scalar_type() != at::kFloat ||
                     at::SavedTensorDefaultHooks::get_hooks(false).has_value())))
        return 0;
    int t = grads_now(lane->runtime);
    if (t != 1) return t;
    Owned weight(weight_of(module));
    if (weight.p == nullptr) return -1;
    at::Tensor w;
    if (weight.p != Py_None) {
        if (!THPVariable_Check(weight.p)) return 0;
        w = THPVariable_Unpack(weight.p);
    }
    if (!launch && !c_through(x, w)) return 0;
    PyObject *recorder = lane->recorder;
    Owned grads(PyObject_GetAttr(recorder, names.grads));
    if (grads.p == nullptr) return -1;
    if (grads.p == Py_None) return 0;
    Owned computed(PyObject_GetAttr(grads.p, names.computed)),
        hooked(computed.p ? PyObject_GetAttr(grads.p, names.hooked_weight) : nullptr),
        gradlane(hooked.p ? PyObject_GetAttr(grads.p, names.grad_lane) : nullptr);
    if (gradlane.p == nullptr) return -1;
    if ((t = launch ? 1 : PyObject_IsTrue(computed.p)) != 1 || gradlane.p == Py_None ||
        (w.defined() && w.requires_grad() && weight.p != hooked.p))  // (watch_weight's to do)
        return t < 0 ? -1 : 0;
    Owned capsule(PyObject_GetAttr(gradlane.p, names.capsule));
    if (capsule.p == nullptr ||
        (launch ? hook_launch_gradients(capsule.p, x, y) : hook_call_gradients(capsule.p, x, y, w))
            < 0)
        return -1;
    return note_dtypes(lane, module, xo, yo, x, y, w);
}

// The recorder's record_dtypes, called where anything its signature is made of (the
// dtypes of x, the weight `w` and y, the autocast dtype, the device, the node that made
// y) changed since this lane last noted it: 1, or -1 an error
int note_dtypes(Lane *lane, PyObject *module, PyObject *xo, PyObject *yo, const at::Tensor &x,
                const at::Tensor &y, const at::Tensor &w) {
    c10::DeviceType where = x.device().type();
    int64_t dtypes[5] = {(int64_t)x.scalar_type(), w.defined() ? (int64_t)w.scalar_type() : -1,
                         (int64_t)y.scalar_type(),
                         at::autocast::is_autocast_enabled(where)
                             ? (int64_t)at::autocast::get_autocast_dtype(where) : -1,
                         (int64_t)where};
    std::string op = y.grad_fn() ? y.grad_fn()->name() : "";
    PyObject *recorder = lane->recorder;
    Owned signature(PyObject_GetAttr(recorder, names.signature));
    if (signature.p == nullptr) return -1;
    if (signature.p == lane->signature && std::equal(dtypes, dtypes + 5, lane->dtypes) &&
        op == lane->op)
        return 1;
    PyObject *call[4] = {recorder, module, xo, yo};
    Owned done(PyObject_VectorcallMethod(names.record_dtypes, call, 4, nullptr));
    Owned noted(done.p ? PyObject_GetAttr(recorder, names.signature) : nullptr);
    if (noted.p == nullptr) return -1;
    Py_XSETREF(lane->signature, Py_NewRef(noted.p));
    std::copy(dtypes, dtypes + 5, lane->dtypes);
    lane->op = std::move(op);
    return 1;
}

// A compiled call's rest once staged (Recorder.after's for compiled code, whose gradients
// its traced hooks measure): on the layer's first call the recorder's after, else its
// dtypes noted where they changed. 1, or -1 an error
int compiled_tail(Lane *lane, int64_t calls, PyObject *xo, PyObject *yo) {
    Owned module(PyObject_GetAttr(lane->recorder, names.module));
    if (module.p == nullptr) return -1;
    if (calls == 0) {
        PyObject *rest[5] = {lane->recorder, module.p, xo, yo, Py_None};
        Owned done(PyObject_VectorcallMethod(names.after, rest, 5, nullptr));
        return done.p == nullptr ? -1 : 1;
    }
    Owned weight(weight_of(module.p));
    if (weight.p == nullptr) return -1;
    at::Tensor w;
    if (THPVariable_Check(weight.p)) w = THPVariable_Unpack(weight.p);
    return note_dtypes(lane, module.p, xo, yo, THPVariable_Unpack(xo), THPVariable_Unpack(yo), w);
}

// lane(runtime, recorder, counts, lender, planner (readers.row_plan; a launch lane's: the
// backend's lane_plan), CallRows, row, width, eps, centred, key_stride, moments (the full
// tier's, readers.MOMENTS' name), launcher (None; a launch lane's: the backend's
// lane_launch)): one layer's lane, as a capsule for its LayerHook's lane state
PyObject *lane(PyObject *, PyObject *args) {
    PyObject *o[11];
    long long width, key_stride;
    if (!PyArg_ParseTuple(args, "OOOOOOOLOOLOO", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5],
                          &o[6], &width, &o[7], &o[8], &key_stride, &o[9], &o[10]))
        return nullptr;
    if (!PyType_Check(o[5]) ||
        !PyType_IsSubtype(reinterpret_cast<PyTypeObject *>(o[5]), &PyTuple_Type))
        return PyErr_Format(PyExc_TypeError, "lane: call type: a tuple's subclass");
    auto *state = new Lane{o[0], o[1], o[2], o[3], o[4], o[5], o[6], o[7], o[8], o[9],
                           o[10], width, key_stride};
    for (PyObject *p : o) Py_INCREF(p);
    PyObject *capsule = PyCapsule_New(state, "normwatch.lane", drop);
    if (capsule == nullptr) {  // (its references with it)
        for (PyObject *p : o) Py_DECREF(p);
        delete state;
    }
    return capsule;
}

PyMethodDef methods[] = {
    {"hook", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(hook)),
     METH_FASTCALL, "hook(layer, module, args, kwargs, output): the forward hook"},
    {"observe", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(compiled)),
     METH_FASTCALL, "observe(path, x, y, alone): a compiled call's operator body"},
    {"observe_grad",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(compiled_grad)),
     METH_FASTCALL, "observe_grad(path, site, g, x, weight): a compiled gradient's body"},
    {"lane", lane, METH_VARARGS, "one layer's lane (a capsule)"},
    {"setup", normwatch::setup, METH_VARARGS, "setup(names, addresses of the C readers, callback)"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef definition = {PyModuleDef_HEAD_INIT, "normwatch_lane", nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit_normwatch_lane() {
    if ((s_shape = PyUnicode_InternFromString("shape")) == nullptr) return nullptr;
    PyObject *m = PyModule_Create(&definition);
    if (m != nullptr && (PyModule_AddFunctions(m, normwatch_grads_methods) < 0 ||
                         PyModule_AddFunctions(m, normwatch_sampler_methods) < 0))
        Py_CLEAR(m);
    return m;
}
