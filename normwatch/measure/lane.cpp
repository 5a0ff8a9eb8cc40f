// The hooks' lanes in C++ (normwatch.measure.fastlane builds and loads them; compiled
// against torch's headers): the forward hook's sentinel lane, then the gradients' hooks
// (below). The module also holds sampler.cpp's functions (the update monitor's).
//
// hook(layer, module, args, kwargs, output) is registered with torch as
// functools.partial(hook, layer): torch's hook loop calls it with no Python frame. A
// training call of the common CPU case (what LayerHook._lane takes) is measured here as
// _lane measures it: the same C kernel (normwatch_rows_planned), the same buffer lender,
// the same CallRows staged, the same counts; in the full tier, with the layer's moments;
// then, on the interval's first call and a full-tier call that is not the common case,
// LayerHook._tail (its gradients hooked, its dtypes noted); the common full-tier call's
// tail runs here (full_tail: the same C++ gradient hooks placed, the dtypes noted where
// they changed). Any other call, every call while Dynamo traces (a
// Python stand-in) and every call where Dynamo compiles the frames run (see hook), goes
// to the Python LayerHook. An error here disables the hook as the Python hook's would
// (LayerHook._fail): training goes on.
#include <Python.h>

#include <ATen/Parallel.h>
#include <ATen/SavedTensorHooks.h>
#include <ATen/autocast_mode.h>
#include <torch/csrc/PyInterpreter.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/dynamo/compiled_autograd.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace {

using RowsFn = int (*)(const void *, const void *, float *, const int64_t *);
using ThroughFn = int (*)(const float *, const float *, const float *, float *, float *,
                          const int64_t *, double);
RowsFn rows_planned = nullptr, grad_rows_planned = nullptr;
ThroughFn through = nullptr;
PyObject *dynamo_callback = nullptr;  // torch._C._dynamo.eval_frame.get_eval_frame_callback
// RowBuffers.take, Accumulator.stage and .stage_grad: where a lender's or accumulator's
// method is still the class's own, its common case runs here (borrowed_buffer, staged)
PyObject *f_take = nullptr, *f_stage = nullptr, *f_stage_grad = nullptr;
// LayerHook._tail, ._watch_grads, .record_dtypes, GradHooks.watch_call, .computes,
// .watch_weight: where a layer's and its GradHooks' are still these, full_tail does their
// common case
constexpr int TAIL_METHODS = 6;
PyObject *f_tail[TAIL_METHODS] = {nullptr};

constexpr int PLAN_SIZE = 9;   // normwatch_rows_planned's plan (native.row_plan's args)

// A tier's plan of the last layout met
struct Planned {
    std::vector<int64_t> sizes;  // the last layout: x's sizes, dtypes, torch's threads
    at::ScalarType dx = at::ScalarType::Undefined, dy = at::ScalarType::Undefined;
    int threads = -1;
    bool planned = false;  // the planner covered that layout
    PyObject *shape = nullptr;  // the rows' shape (a tuple), where planned
    int64_t plan[PLAN_SIZE] = {0};
};

// One layer's lane: what LayerHook hands over once (owned references), and per tier
// (sentinel, full) its plan
struct Lane {
    PyObject *runtime, *counts, *take, *planner, *call_type, *row, *eps, *centred, *moments;
    int64_t width, key_stride;
    Planned tiers[2];
    // The dtypes the layer's record_dtypes last noted from here (full_tail): its
    // `_signature` then (owned), and what that signature is made of
    PyObject *signature = nullptr;
    int64_t dtypes[4] = {-1, -1, -1, -1};
    std::string op;
};

PyObject *s_paused, *s_full_stats, *s_tail, *s_kernel, *s_check_outputs, *s_output_checked,
    *s_calls, *s_training, *s_step, *s_calls_this_step, *s_tokens, *s_input_shape, *s_auto, *s_lane,
    *s_fail, *s_accumulator, *s_stage, *s_shape, *s_capsule, *s_gradients, *s_stage_grad,
    *s_both, *s_node, *s_weight_grad, *s_free, *s_lent, *s_staged_calls, *s_staged_grads,
    *s_staged_tokens, *s_max_staged, *s_commit, *s_grads, *s_grad_lane, *s_computed,
    *s_hooked_weight, *s_weight, *s_signature, *s_record_dtypes, *s_watch_grads,
    *s_watch_call, *s_computes, *s_watch_weight;

// The holder of a new reference (or nullptr)
struct Owned {
    PyObject *p;
    explicit Owned(PyObject *o) : p(o) {}
    Owned(const Owned &) = delete;
    Owned &operator=(const Owned &) = delete;
    ~Owned() { Py_XDECREF(p); }
};

void drop(PyObject *capsule) {
    auto *lane = static_cast<Lane *>(PyCapsule_GetPointer(capsule, "normwatch.lane"));
    if (lane == nullptr) return;
    for (PyObject *o : {lane->runtime, lane->counts, lane->take, lane->planner,
                        lane->call_type, lane->row, lane->eps, lane->centred, lane->moments,
                        lane->tiers[0].shape, lane->tiers[1].shape, lane->signature})
        Py_XDECREF(o);
    delete lane;
}

// An attribute read by `read` (`bad`: it could not be got)
template <class T>
T attribute(PyObject *owner, PyObject *name, T (*read)(PyObject *), T bad) {
    PyObject *v = PyObject_GetAttr(owner, name);
    if (v == nullptr) return bad;
    T got = read(v);
    Py_DECREF(v);
    return got;
}

// An attribute's truth (-1: an error)
int truth(PyObject *owner, PyObject *name) {
    return attribute<int>(owner, name, PyObject_IsTrue, -1);
}

// An integer attribute (-1 with an error set: an error)
int64_t integer(PyObject *owner, PyObject *name) {
    return attribute<long long>(owner, name, PyLong_AsLongLong, -1);
}

// Add `by` to an integer attribute (-1: an error)
int add(PyObject *owner, PyObject *name, int64_t by) {
    int64_t i = integer(owner, name);
    if (i == -1 && PyErr_Occurred()) return -1;
    PyObject *v = PyLong_FromLongLong(i + by);
    if (v == nullptr) return -1;
    int r = PyObject_SetAttr(owner, name, v);
    Py_DECREF(v);
    return r;
}

// vmap's and grad's wrappers (functorch's: no data pointer)
const c10::DispatchKeySet WRAPPERS({c10::DispatchKey::FuncTorchGradWrapper,
                                    c10::DispatchKey::FuncTorchBatched,
                                    c10::DispatchKey::BatchedNestedTensor});

bool readable(const at::Tensor &t) {  // what the C reader takes (native._rowwise, RowReader)
    return t.is_cpu() && t.layout() == at::kStrided && t.is_contiguous() &&
           !t.key_set().has_any(WRAPPERS);
}

// A plain tensor the C readers take (no tensor subclass: a DTensor's gradient is Python's)
bool plain(const at::Tensor &t) {
    return t.defined() && readable(t) && !t.key_set().has(c10::DispatchKey::Python);
}

// The tier's plan for x and y's layout (asked of the planner on a new one, with the
// layer's moments in the full tier), copied into `plan`
// and `shape` (a new reference) where planned: 1 planned, 0 not covered, -1 an error.
// (Copied while the GIL is held throughout: the lender's Python after it may let another
// thread in, whose call of this layer may plan another layout.)
int planned(Lane *lane, bool full, PyObject *xo, PyObject *yo, const at::Tensor &x,
            const at::Tensor &y, int64_t *plan, PyObject **shape) {
    Planned *tier = &lane->tiers[full];
    int threads = at::get_num_threads();
    auto sizes = x.sizes();
    if (tier->threads == threads && tier->dx == x.scalar_type() && tier->dy == y.scalar_type() &&
        sizes.equals(tier->sizes)) {
        if (!tier->planned) return 0;
        std::copy(tier->plan, tier->plan + PLAN_SIZE, plan);
        Py_INCREF(*shape = tier->shape);
        return 1;
    }
    tier->threads = -1;  // (until the new plan is read whole)
    PyObject *got = PyObject_CallFunctionObjArgs(lane->planner, xo, yo,
                                                 full ? lane->moments : Py_None, nullptr);
    if (got == nullptr) return -1;
    bool covered = got != Py_None;
    if (covered) {  // a native.RowPlan: (shape, args: a ctypes array of int64)
        PyObject *args = PyTuple_Check(got) ? PyTuple_GetItem(got, 1) : nullptr;
        if (args == nullptr || PySequence_Size(args) != PLAN_SIZE) {
            Py_DECREF(got);
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "lane: a plan of 9");
            return -1;
        }
        for (int i = 0; i < PLAN_SIZE; i++) {
            PyObject *v = PySequence_GetItem(args, i);
            tier->plan[i] = v == nullptr ? -1 : PyLong_AsLongLong(v);
            Py_XDECREF(v);
            if (tier->plan[i] == -1 && PyErr_Occurred()) {
                Py_DECREF(got);
                return -1;
            }
        }
        PyObject *shape = PyTuple_GetItem(got, 0);
        Py_XINCREF(shape);
        Py_XSETREF(tier->shape, shape);
    }
    Py_DECREF(got);
    tier->sizes.assign(sizes.begin(), sizes.end());
    tier->dx = x.scalar_type();
    tier->dy = y.scalar_type();
    tier->planned = covered;
    tier->threads = threads;
    if (!covered) return 0;
    std::copy(tier->plan, tier->plan + PLAN_SIZE, plan);
    Py_INCREF(*shape = tier->shape);
    return 1;
}

// Whether `owner.<name>` is the function `own` (the class's, not replaced): 1, 0, -1
int owns(PyObject *owner, PyObject *name, PyObject *own) {
    PyObject *bound = PyObject_GetAttr(owner, name);
    if (bound == nullptr) return -1;
    int r = PyMethod_Check(bound) && PyMethod_GET_FUNCTION(bound) == own;
    Py_DECREF(bound);
    return r;
}

// RowBuffers.take(lender, shape)'s common case, a free buffer of that shape, run here (a
// new reference; nullptr: none free, no error, or an error)
PyObject *loaned(PyObject *lender, PyObject *shape) {
    PyObject *free = PyObject_GetAttr(lender, s_free);
    PyObject *kept = free == nullptr || !PyDict_Check(free)
                         ? nullptr : PyDict_GetItemWithError(free, shape);  // (borrowed)
    PyObject *rows = nullptr;
    if (kept != nullptr && PyList_Check(kept) && PyList_GET_SIZE(kept) > 0) {
        Py_ssize_t n = PyList_GET_SIZE(kept);
        rows = Py_NewRef(PyList_GET_ITEM(kept, n - 1));
        PyObject *lent = PyList_SetSlice(kept, n - 1, n, nullptr) == 0
                             ? PyObject_GetAttr(lender, s_lent) : nullptr;
        if (lent == nullptr || !PyList_Check(lent) || PyList_Append(lent, rows) < 0) {
            if (lent != nullptr && !PyErr_Occurred())
                PyErr_SetString(PyExc_TypeError, "lane: the lender's loans are no list");
            Py_CLEAR(rows);
        }
        Py_XDECREF(lent);
    }
    Py_XDECREF(free);
    return rows;
}

// take(shape), a buffer (a new reference) or nullptr: where `take` is RowBuffers.take
// itself (not replaced) its common case runs here, with no Python frame
PyObject *borrowed_buffer(PyObject *take, PyObject *shape) {
    PyObject *rows = nullptr;
    if (PyMethod_Check(take) && PyMethod_GET_FUNCTION(take) == f_take) {
        rows = loaned(PyMethod_GET_SELF(take), shape);
        if (rows != nullptr || PyErr_Occurred()) return rows;
    }
    rows = PyObject_CallOneArg(take, shape);
    if (rows != nullptr && !THPVariable_Check(rows)) {
        Py_DECREF(rows);
        PyErr_SetString(PyExc_TypeError, "lane: the lender gave no tensor");
        return nullptr;
    }
    return rows;
}

// runtime.accumulator.<method>(rows) (rows of `n` tokens: Accumulator.stage's and
// .stage_grad's count): where the method is the class's own (`own`, not replaced), its
// body runs here (the rows appended to `list`, the tokens counted, a commit past the
// cap), with no Python frame: 0, or -1 an error
int staged(PyObject *runtime, PyObject *method, PyObject *own, PyObject *list,
           PyObject *rows, int64_t n) {
    PyObject *accumulator = PyObject_GetAttr(runtime, s_accumulator);
    if (accumulator == nullptr) return -1;
    int t = owns(accumulator, method, own);
    PyObject *r = nullptr;
    if (t == 0) {
        r = PyObject_CallMethodOneArg(accumulator, method, rows);
    } else if (t == 1) {
        PyObject *queue = PyObject_GetAttr(accumulator, list);
        int64_t tokens = 0, cap = 0;
        if (queue != nullptr && !PyList_Check(queue))
            PyErr_SetString(PyExc_TypeError, "lane: the accumulator's queue is no list");
        else if (queue != nullptr && PyList_Append(queue, rows) == 0 &&
                 (tokens = integer(accumulator, s_staged_tokens)) >= 0 &&
                 (cap = integer(accumulator, s_max_staged)) >= 0 &&
                 add(accumulator, s_staged_tokens, n) == 0)
            r = tokens + n >= cap ? PyObject_CallMethodNoArgs(accumulator, s_commit)
                                  : Py_NewRef(Py_None);
        Py_XDECREF(queue);
    }
    Py_DECREF(accumulator);
    if (r == nullptr) return -1;
    Py_DECREF(r);
    return 0;
}

int full_tail(Lane *lane, PyObject *layer, PyObject *module, PyObject *args, PyObject *kwargs,
              PyObject *xo, PyObject *yo, const at::Tensor &x, const at::Tensor &y);

// The lane: 1 measured, 0 not taken (the Python hook measures it), -1 an error
int measured(Lane *lane, PyObject *layer, PyObject *module, PyObject *args, PyObject *kwargs,
             PyObject *output) {
    if (!PyTuple_Check(args) || PyTuple_GET_SIZE(args) < 1) return 0;
    PyObject *xo = PyTuple_GET_ITEM(args, 0);
    if (!THPVariable_CheckExact(xo) || !THPVariable_CheckExact(output)) return 0;
    PyObject *rt = lane->runtime, *c = lane->counts;
    int t;
    if ((t = truth(rt, s_paused)) != 0) return t < 0 ? -1 : 0;
    int full = truth(rt, s_full_stats);
    if (full < 0) return -1;
    PyObject *kernel = PyObject_GetAttr(rt, s_kernel);
    if (kernel == nullptr) return -1;
    t = PyUnicode_Check(kernel) && PyUnicode_Compare(kernel, s_auto) == 0;
    Py_DECREF(kernel);
    if (!t) return PyErr_Occurred() ? -1 : 0;
    int64_t calls = integer(c, s_calls);
    if (calls < 0) return calls == -1 && PyErr_Occurred() ? -1 : 0;
    if ((t = truth(rt, s_check_outputs)) != 0) {  // the interval's output check pending
        if (t < 0) return -1;
        if ((t = truth(c, s_output_checked)) != 1) return t;
    }
    if ((t = truth(module, s_training)) != 1) return t;
    if (!at::GradMode::is_enabled() || torch::autograd::get_current_graph_task_id() != -1)
        return 0;
    const at::Tensor &x = THPVariable_Unpack(xo);
    const at::Tensor &y = THPVariable_Unpack(output);
    if (x.dim() == 0 || x.size(-1) != lane->width || y.numel() == 0 || !readable(x) ||
        !readable(y) || !x.sizes().equals(y.sizes()))
        return 0;
    int64_t plan[PLAN_SIZE];
    PyObject *shape;
    if ((t = planned(lane, full, xo, output, x, y, plan, &shape)) != 1) return t;
    PyObject *buffer = borrowed_buffer(lane->take, shape);
    Py_DECREF(shape);
    if (buffer == nullptr) return -1;
    if (rows_planned(x.const_data_ptr(), y.const_data_ptr(),
                     THPVariable_Unpack(buffer).mutable_data_ptr<float>(), plan) != 0) {
        Py_DECREF(buffer);
        PyErr_SetString(PyExc_RuntimeError, "lane: the C reader refused the call");
        return -1;
    }
    int64_t step = integer(rt, s_step), at = step == -1 && PyErr_Occurred()
                                                  ? -1 : integer(rt, s_calls_this_step);
    if (at == -1 && PyErr_Occurred()) {
        Py_DECREF(buffer);
        return -1;
    }
    int64_t tokens = x.numel() / lane->width;
    PyObject *key = PyFloat_FromDouble((double)(step * lane->key_stride + at));
    PyObject *width = PyLong_FromLongLong(lane->width), *count = PyLong_FromLongLong(tokens);
    auto *type = reinterpret_cast<PyTypeObject *>(lane->call_type);
    PyObject *call = key && width && count ? type->tp_alloc(type, 11) : nullptr;
    if (call == nullptr) {
        for (PyObject *o : {key, width, count, buffer}) Py_XDECREF(o);
        return -1;
    }
    // CallRows(row, key, width, eps, v, n, lined_up, full, fused, centred, out)
    PyObject *borrowed[11] = {lane->row, nullptr, nullptr, lane->eps, nullptr, nullptr,
                              Py_True, full ? Py_True : Py_False, Py_False, lane->centred,
                              Py_None};
    PyObject *owned[11] = {nullptr, key, width, nullptr, buffer, count};
    for (int i = 0; i < 11; i++) {
        PyObject *v = owned[i] ? owned[i] : borrowed[i];
        if (!owned[i]) Py_INCREF(v);
        PyTuple_SET_ITEM(call, i, v);
    }
    int r = staged(rt, s_stage, f_stage, s_staged_calls, call, tokens);
    Py_DECREF(call);
    if (r < 0) return -1;
    PyObject *size = PyObject_GetAttr(xo, s_shape);
    if (size == nullptr || add(rt, s_calls_this_step, 1) < 0 || add(c, s_calls, 1) < 0 ||
        add(c, s_tokens, tokens) < 0 || PyObject_SetAttr(c, s_input_shape, size) < 0) {
        Py_XDECREF(size);
        return -1;
    }
    Py_DECREF(size);
    if (!full && calls > 0) return 1;
    if (full && calls > 0 && (t = full_tail(lane, layer, module, args, kwargs, xo, output,
                                            x, y)) != 0)
        return t;
    // the rest of a full-tier or first call: the gradients hooked (full), the dtypes and
    // the place in the forward order noted (LayerHook._tail)
    PyObject *rest[6] = {layer, module, args, kwargs, output, full ? Py_True : Py_False};
    PyObject *done = PyObject_VectorcallMethod(s_tail, rest, 6, nullptr);
    if (done == nullptr) return -1;
    Py_DECREF(done);
    return 1;
}

// Hand the pending error, an Exception, to owner._fail (the error taken; `owner` null:
// dropped): 0, or -1 with _fail's own error set
int hand_to_fail(PyObject *owner) {
    PyObject *type, *value, *trace;
    PyErr_Fetch(&type, &value, &trace);
    PyErr_NormalizeException(&type, &value, &trace);
    if (trace != nullptr && value != nullptr) PyException_SetTraceback(value, trace);
    PyObject *r = owner != nullptr && value != nullptr
                      ? PyObject_CallMethodOneArg(owner, s_fail, value) : Py_NewRef(Py_None);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(trace);
    if (r == nullptr) return -1;
    Py_DECREF(r);
    return 0;
}

// Disable `layer` as its own hook does (an Exception; anything else goes on up)
PyObject *failed(PyObject *layer) {
    if (!PyErr_ExceptionMatches(PyExc_Exception)) return nullptr;
    if (hand_to_fail(layer) < 0) return nullptr;
    Py_RETURN_NONE;
}

// Whether Dynamo compiles the Python frames run now (an eager stretch of a compiled
// function, after a graph break): 1, 0, or -1 an error
int compiling_frames() {
    PyObject *callback = PyObject_CallNoArgs(dynamo_callback);
    if (callback == nullptr) return -1;
    int on = callback != Py_None && callback != Py_False;  // (False: cached code only)
    Py_DECREF(callback);
    return on;
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
    PyObject *state = PyObject_GetAttr(layer, s_lane);  // a fastlane.State, or None
    if (state == nullptr) return failed(layer);
    PyObject *capsule = state;  // (None: the reference moves)
    if (state != Py_None) {
        capsule = PyObject_GetAttr(state, s_capsule);
        Py_DECREF(state);
    }
    if (capsule == nullptr) return failed(layer);
    Lane *lane = capsule == Py_None ? nullptr
                 : static_cast<Lane *>(PyCapsule_GetPointer(capsule, "normwatch.lane"));
    int r = 0;
    if (lane != nullptr) {
        try {
            r = measured(lane, layer, a[1], a[2], a[3], a[4]);
        } catch (const std::exception &e) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, e.what());
            r = -1;
        }
    } else if (PyErr_Occurred()) {
        r = -1;
    }
    Py_DECREF(capsule);
    if (r == 1) Py_RETURN_NONE;
    if (r < 0) return failed(layer);
    return PyObject_Vectorcall(layer, a + 1, 4, nullptr);  // the Python hook
}

// pre(path_pre, module, args, kwargs): a layer's forward pre-hook, registered as
// functools.partial(pre, CompiledPath.pre), which does something only in compiled code
// (it hooks a compiled call's hidden state): in eager code it returns here, with no Python
// frame; where Dynamo compiles the frames run (an eager stretch of a compiled function)
// it calls the Python pre-hook, whose frame Dynamo compiles as before. While Dynamo
// traces, a Python stand-in calls it (fastlane._stand_in).
PyObject *pre(PyObject *, PyObject *const *a, Py_ssize_t n) {
    if (n != 4) {
        PyErr_SetString(PyExc_TypeError, "pre(path_pre, module, args, kwargs)");
        return nullptr;
    }
    int dynamo = compiling_frames();
    if (dynamo < 0) PyErr_Clear();  // (never seen: then the Python pre-hook decides)
    if (dynamo != 0) return PyObject_Vectorcall(a[0], a + 1, 3, nullptr);
    Py_RETURN_NONE;
}

// lane(runtime, counts, take, planner (native.row_plan), CallRows, row, width, eps, centred,
// key_stride, moments (the full tier's, native.MOMENTS' name)):
// one layer's lane, as a capsule for LayerHook's `_lane_state`
PyObject *lane(PyObject *, PyObject *args) {
    PyObject *rt, *counts, *take, *planner, *call_type, *row, *eps, *centred, *moments;
    long long width, key_stride;
    if (!PyArg_ParseTuple(args, "OOOOOOLOOLO", &rt, &counts, &take, &planner, &call_type,
                          &row, &width, &eps, &centred, &key_stride, &moments))
        return nullptr;
    if (!PyType_Check(call_type) ||
        !PyType_IsSubtype(reinterpret_cast<PyTypeObject *>(call_type), &PyTuple_Type))
        return PyErr_Format(PyExc_TypeError, "lane: call type: a tuple's subclass");
    auto *state = new Lane{rt, counts, take, planner, call_type, row, eps, centred, moments,
                           width, key_stride};
    for (PyObject *o : {rt, counts, take, planner, call_type, row, eps, centred, moments})
        Py_INCREF(o);
    PyObject *capsule = PyCapsule_New(state, "normwatch.lane", drop);
    if (capsule == nullptr) {  // (its references with it)
        for (PyObject *o : {rt, counts, take, planner, call_type, row, eps, centred, moments})
            Py_DECREF(o);
        delete state;
    }
    return capsule;
}

// setup(addresses of normwatch_rows_planned, normwatch_grad_rows_planned, normwatch_through,
// torch._C._dynamo.eval_frame.get_eval_frame_callback)
PyObject *setup(PyObject *, PyObject *args) {
    PyObject *a, *b, *c, *callback;
    if (!PyArg_ParseTuple(args, "OOOO", &a, &b, &c, &callback)) return nullptr;
    if (!PyCallable_Check(callback)) return PyErr_Format(PyExc_TypeError, "setup: callable");
    void *p[3] = {PyLong_AsVoidPtr(a), PyLong_AsVoidPtr(b), PyLong_AsVoidPtr(c)};
    for (void *q : p)
        if (q == nullptr) return PyErr_Occurred() ? nullptr
                                                  : PyErr_Format(PyExc_ValueError, "setup: null");
    rows_planned = reinterpret_cast<RowsFn>(p[0]);
    grad_rows_planned = reinterpret_cast<RowsFn>(p[1]);
    through = reinterpret_cast<ThroughFn>(p[2]);
    Py_INCREF(callback);
    Py_XSETREF(dynamo_callback, callback);
    Py_RETURN_NONE;
}

// ---- The gradients' hooks in C++ ----------------------------------------------------
//
// On a full-tier step the CPU hooks of GradHooks (normwatch.measure.gradients): a node's
// pre-hook per site (hook_site, the hidden state's or the output's gradient), the output
// node's pre-hook that also computes the gradient through the norm (hook_out), the
// weight's tensor hook (hook_weight). Each reads as the Python hook does (the same C
// readers, plans, lender and GradRows staged) with no Python frame of its own; any case
// that is not the plain one calls the Python hook's method (GradHooks._node, ._both,
// ._weight_grad), which measures it as before. An error disables the layer through
// GradHooks._fail. Registered with no RemovableHandle (a node's hooks go with its graph).

// gradients.SITES order, then WEIGHT
constexpr int SITE_OUT = 0, SITE_IN = 1, SITE_HIDDEN = 2, SITE_WEIGHT = 3;

// A layout's plan (asked of a Python planner on a new layout)
struct GradPlan {
    std::vector<int64_t> sizes;
    at::ScalarType dtype = at::ScalarType::Undefined;
    int threads = -1;
    bool planned = false;
    std::vector<int64_t> args;
};

// One layer's gradient side. Its Python references are the capsule's (dropped, under the
// GIL, when it goes or closes); the hooks share the rest and check `open` under the GIL.
struct Grads {
    PyObject *owner = nullptr;  // a weakref to the GradHooks (its fallbacks, _fail)
    PyObject *runtime = nullptr, *take = nullptr, *rows_type = nullptr, *row = nullptr,
             *site_planner = nullptr, *through_planner = nullptr;
    int64_t width = 0;
    double eps = 0;
    bool open = true;
    GradPlan plans[4];  // per site: OUT, IN (unused), HIDDEN, WEIGHT
    GradPlan through_plan;  // the output's gradient with the gradient through the norm

    void close() {
        open = false;
        for (PyObject **o : {&owner, &runtime, &take, &rows_type, &row, &site_planner,
                             &through_planner})
            Py_CLEAR(*o);
    }
};

using Shared = std::shared_ptr<Grads>;

void drop_grads(PyObject *capsule) {
    auto *held = static_cast<Shared *>(PyCapsule_GetPointer(capsule, "normwatch.grads"));
    if (held == nullptr) return;
    (*held)->close();
    delete held;
}

Shared *held_grads(PyObject *capsule) {
    return static_cast<Shared *>(PyCapsule_GetPointer(capsule, "normwatch.grads"));
}

// Whether this step's backward is measured: Runtime.grads_now, read as its parts (its
// property's frame costs more inside a backward); -1 an error
int grads_now(PyObject *rt) {
    int t;
    if ((t = truth(rt, s_gradients)) != 1 || (t = truth(rt, s_full_stats)) != 1) return t;
    t = truth(rt, s_paused);
    return t < 0 ? -1 : !t;
}

// `g`'s plan (planner(g) on a new layout; `whole`: the planner's whole-tensor flag, -1:
// none to pass): 1 planned (plan.args), 0 not covered, -1 an error
int grad_plan(GradPlan &plan, PyObject *planner, const at::Tensor &g, int whole) {
    int threads = at::get_num_threads();
    if (plan.threads == threads && plan.dtype == g.scalar_type() &&
        g.sizes().equals(plan.sizes))
        return plan.planned;
    plan.threads = -1;
    PyObject *go = THPVariable_Wrap(g);
    if (go == nullptr) return -1;
    PyObject *got = whole < 0 ? PyObject_CallOneArg(planner, go)
                              : PyObject_CallFunctionObjArgs(planner, go, Py_None,
                                                             whole ? Py_True : Py_False,
                                                             nullptr);
    Py_DECREF(go);
    if (got == nullptr) return -1;
    plan.args.clear();
    if (got != Py_None) {  // a ctypes array of int64
        Py_ssize_t n = PySequence_Size(got);
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *v = PySequence_GetItem(got, i);
            int64_t a = v == nullptr ? -1 : PyLong_AsLongLong(v);
            Py_XDECREF(v);
            if (a == -1 && PyErr_Occurred()) {
                Py_DECREF(got);
                return -1;
            }
            plan.args.push_back(a);
        }
        if (n < 0) {
            Py_DECREF(got);
            return -1;
        }
    }
    plan.planned = got != Py_None;
    Py_DECREF(got);
    plan.sizes.assign(g.sizes().begin(), g.sizes().end());
    plan.dtype = g.scalar_type();
    plan.threads = threads;
    return plan.planned;
}

// A buffer of `count` float32 from the lender (a new reference), or nullptr
PyObject *lent(Grads &gr, int64_t count) {
    PyObject *shape = Py_BuildValue("(L)", (long long)count);
    if (shape == nullptr) return nullptr;
    PyObject *buffer = borrowed_buffer(gr.take, shape);
    Py_DECREF(shape);
    return buffer;
}

// Stage GradRows(buffer, None, None, row, site, width); takes `buffer`'s reference: 0 or -1
int stage(Grads &gr, PyObject *buffer, int site, int64_t width) {
    int64_t count = THPVariable_Unpack(buffer).numel();  // (GradRows.norms' tokens)
    auto *type = reinterpret_cast<PyTypeObject *>(gr.rows_type);
    PyObject *s = PyLong_FromLong(site), *w = PyLong_FromLongLong(width);
    PyObject *rows = s && w ? type->tp_alloc(type, 6) : nullptr;
    if (rows == nullptr) {
        for (PyObject *o : {s, w, buffer}) Py_XDECREF(o);
        return -1;
    }
    PyObject *items[6] = {buffer, Py_None, Py_None, gr.row, s, w};
    for (int i = 0; i < 6; i++) {
        if (i == 1 || i == 2 || i == 3) Py_INCREF(items[i]);
        PyTuple_SET_ITEM(rows, i, items[i]);
    }
    int r = staged(gr.runtime, s_stage_grad, f_stage_grad, s_staged_grads, rows, count);
    Py_DECREF(rows);
    return r;
}

// The GradHooks (a new reference; nullptr: gone, no error)
PyObject *owner(Grads &gr) {
#if PY_VERSION_HEX >= 0x030D0000
    PyObject *o = nullptr;
    if (PyWeakref_GetRef(gr.owner, &o) < 0) PyErr_Clear();
    return o;
#else
    PyObject *o = PyWeakref_GetObject(gr.owner);  // (borrowed)
    if (o == nullptr || o == Py_None) return nullptr;
    Py_INCREF(o);
    return o;
#endif
}

// Disable the layer as its Python hook would (GradHooks._fail), the error cleared
void grad_failed(Grads &gr) {
    if (!PyErr_Occurred()) return;
    PyObject *hooks = PyErr_ExceptionMatches(PyExc_Exception) && gr.open ? owner(gr) : nullptr;
    hand_to_fail(hooks);
    Py_XDECREF(hooks);
    PyErr_Clear();  // (never into the autograd engine)
}

// GradHooks.<name> (a new reference; nullptr: the layer is gone or closed, no error)
PyObject *method_of(Grads &gr, PyObject *name) {
    PyObject *hooks = gr.open ? owner(gr) : nullptr;
    PyObject *method = hooks ? PyObject_GetAttr(hooks, name) : nullptr;
    Py_XDECREF(hooks);
    return method;
}

// Call GradHooks.<name>(*args) (a fallback: the Python hook's own method): 0 or -1
int fallback(Grads &gr, PyObject *name, PyObject *args) {
    PyObject *method = method_of(gr, name);
    if (method == nullptr) return PyErr_Occurred() ? -1 : 0;
    PyObject *r = PyObject_CallObject(method, args);
    Py_DECREF(method);
    if (r == nullptr) return -1;
    Py_DECREF(r);
    return 0;
}

PyObject *wrapped(const at::Tensor &t) {  // (None for an undefined tensor)
    if (!t.defined()) Py_RETURN_NONE;
    return THPVariable_Wrap(t);
}

// `g`'s rows (GradReader's read: `whole`, one row) staged at `site` with `width`: 1 read
// here, 0 not planned, -1 an error
int read_rows(Grads &gr, int site, const at::Tensor &g, int whole, int64_t width) {
    GradPlan &plan = gr.plans[site];
    int t = grad_plan(plan, gr.site_planner, g, whole);
    if (t != 1) return t;
    PyObject *buffer = lent(gr, plan.args[1] + 2);
    if (buffer == nullptr) return -1;
    if (grad_rows_planned(g.const_data_ptr(), nullptr,
                          THPVariable_Unpack(buffer).mutable_data_ptr<float>(),
                          plan.args.data())) {
        Py_DECREF(buffer);
        PyErr_SetString(PyExc_RuntimeError, "grads: the C reader refused the gradient");
        return -1;
    }
    return stage(gr, buffer, site, width) < 0 ? -1 : 1;
}

// A gradient `g` at `site` (not the weight): 1 read here, 0 not the plain case, -1 an error
int read_site(Grads &gr, int site, const at::Tensor &g) {
    if (!plain(g) || g.dim() == 0 || g.size(-1) != gr.width) return 0;
    return read_rows(gr, site, g, 0, g.size(-1));
}

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

// Compiled autograd traces a node's hooks as Python: hand it the Python hook this one
// stands for, GradHooks.<name>(*bound(), grads) (nothing where the layer is gone)
template <class Bound>
void python_twin(const Shared &gr, PyObject *name, Bound bound,
                 torch::dynamo::autograd::CompiledNodeArgs &compiled) {
    PyGILState_STATE gil = PyGILState_Ensure();
    PyObject *method = method_of(*gr, name);
    PyObject *args = method ? bound() : nullptr;
    PyObject *partial = nullptr;
    if (method != nullptr && args != nullptr) {
        PyObject *functools = PyImport_ImportModule("functools");
        PyObject *make = functools ? PyObject_GetAttrString(functools, "partial") : nullptr;
        PyObject *first = make ? PyTuple_Pack(1, method) : nullptr;
        PyObject *all = first ? PySequence_Concat(first, args) : nullptr;
        partial = all ? PyObject_CallObject(make, all) : nullptr;
        for (PyObject *o : {functools, make, first, all}) Py_XDECREF(o);
    }
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
        python_twin(gr, s_node, [&] { return Py_BuildValue("(in)", site, (Py_ssize_t)k); },
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
            t = args && fallback(*gr, s_node, args) == 0 ? 1 : -1;
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
        python_twin(gr, s_both, [&] {
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
            t = args && fallback(*gr, s_both, args) == 0 ? 1 : -1;
            Py_XDECREF(args);
            return t;
        });
        return grads;
    }
    // 1 read here, 0 not the plain case, -1 an error
    int read(const at::Tensor &g, const at::Tensor &xs, const at::Tensor &ws) {
        Grads &r = *gr;
        if (xs._version() != version || !plain(g) || g.scalar_type() != at::kFloat ||
            !g.sizes().equals(xs.sizes()) ||
            (ws.defined() && ws.storage().nbytes() == 0))  // (FSDP2's, resharded)
            return 0;
        int t = grad_plan(r.through_plan, r.through_planner, g, -1);
        if (t != 1) return t;
        const int64_t *args = r.through_plan.args.data();
        PyObject *dg = lent(r, args[0] + 2);
        PyObject *din = dg ? lent(r, args[0] + 2) : nullptr;
        if (din == nullptr) {
            Py_XDECREF(dg);
            return -1;
        }
        if (through(g.const_data_ptr<float>(), xs.const_data_ptr<float>(),
                    ws.defined() ? ws.const_data_ptr<float>() : nullptr,
                    THPVariable_Unpack(dg).mutable_data_ptr<float>(),
                    THPVariable_Unpack(din).mutable_data_ptr<float>(), args, r.eps)) {
            Py_DECREF(dg);
            Py_DECREF(din);
            PyErr_SetString(PyExc_RuntimeError, "grads: the C kernel refused the gradient");
            return -1;
        }
        int64_t width = g.size(-1);
        if (stage(r, dg, SITE_OUT, width) < 0) {
            Py_DECREF(din);
            return -1;
        }
        return stage(r, din, SITE_IN, width) < 0 ? -1 : 1;
    }
};

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
        PyObject *method = method_of(*gr, s_weight_grad);
        PyErr_Clear();
        if (method != nullptr)
            args.add_tensor_pre_hook(c10::SafePyObject(method, getPyInterpreter()), 0);
        PyGILState_Release(gil);
    }
};

// The weight's gradient read: 1 (here or by the Python hook's method) or -1 an error
int weight_read(Grads &r, const at::Tensor &g) {
    int t = plain(g) && g.numel() ? read_rows(r, SITE_WEIGHT, g, 1, 1) : 0;
    if (t == 0) {
        PyObject *go = wrapped(g);
        PyObject *args = go ? Py_BuildValue("(N)", go) : nullptr;
        t = args && fallback(r, s_weight_grad, args) == 0 ? 1 : -1;
        Py_XDECREF(args);
    }
    return t;
}

// grads(owner weakref, runtime, take, GradRows, row, width, eps, site planner (native.
// grad_read_plan), through planner (ThroughReader.plan)): a layer's capsule
PyObject *grads(PyObject *, PyObject *args) {
    PyObject *o[7];
    long long width;
    double eps;
    if (!PyArg_ParseTuple(args, "OOOOOLdOO", &o[0], &o[1], &o[2], &o[3], &o[4], &width, &eps,
                          &o[5], &o[6]))
        return nullptr;
    if (!PyWeakref_CheckRef(o[0])) return PyErr_Format(PyExc_TypeError, "grads: a weakref");
    if (!PyType_Check(o[3]) ||
        !PyType_IsSubtype(reinterpret_cast<PyTypeObject *>(o[3]), &PyTuple_Type))
        return PyErr_Format(PyExc_TypeError, "grads: rows type: a tuple's subclass");
    auto shared = std::make_shared<Grads>();
    PyObject **slots[7] = {&shared->owner, &shared->runtime, &shared->take, &shared->rows_type,
                           &shared->row, &shared->site_planner, &shared->through_planner};
    for (int i = 0; i < 7; i++) {
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

// The rest of a full-tier call that is not the interval's first (LayerHook._tail's work),
// its common case here: x the call's only argument, both float32 with autograd nodes, the
// gradient through the norm computed (GradHooks.computes: no saved-tensor hooks, a
// float32 weight of one element per x's, or none, already hooked), the layer's C++
// gradient hooks placed as GradHooks.watch_call places them (the hidden state's on x's
// node, then the output's with the one through the norm on y's), then the dtypes noted
// where they changed since this lane last noted them (LayerHook.record_dtypes, called).
// 1 done, 0 not that case (nothing done: the Python _tail does it), -1 an error.
int full_tail(Lane *lane, PyObject *layer, PyObject *module, PyObject *args, PyObject *kwargs,
              PyObject *xo, PyObject *yo, const at::Tensor &x, const at::Tensor &y) {
    if (PyTuple_GET_SIZE(args) != 1 ||
        (kwargs != nullptr && kwargs != Py_None &&
         (!PyDict_Check(kwargs) || PyDict_GET_SIZE(kwargs) != 0)))
        return 0;
    if (through == nullptr || x.scalar_type() != at::kFloat || y.scalar_type() != at::kFloat ||
        !x.requires_grad() || !y.requires_grad() || !x.grad_fn() || !y.grad_fn() ||
        at::SavedTensorDefaultHooks::get_hooks(false).has_value())
        return 0;
    int t = grads_now(lane->runtime);
    if (t != 1) return t;
    Owned weight(PyObject_GetAttr(module, s_weight));  // getattr(module, "weight", None)
    if (weight.p == nullptr) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return -1;
        PyErr_Clear();
        weight.p = Py_NewRef(Py_None);
    }
    at::Tensor w;
    if (weight.p != Py_None) {
        if (!THPVariable_Check(weight.p)) return 0;
        w = THPVariable_Unpack(weight.p);
        if (w.scalar_type() != at::kFloat || !plain(w) || w.numel() != x.size(-1)) return 0;
    }
    Owned grads(PyObject_GetAttr(layer, s_grads));
    if (grads.p == nullptr) return -1;
    if (grads.p == Py_None) return 0;
    PyObject *names[TAIL_METHODS] = {s_tail, s_watch_grads, s_record_dtypes, s_watch_call,
                                     s_computes, s_watch_weight};
    for (int i = 0; i < TAIL_METHODS; i++)  // (the Python's, where any is replaced)
        if ((t = owns(i < 3 ? layer : grads.p, names[i], f_tail[i])) != 1) return t;
    Owned computed(PyObject_GetAttr(grads.p, s_computed)),
        hooked(computed.p ? PyObject_GetAttr(grads.p, s_hooked_weight) : nullptr),
        gradlane(hooked.p ? PyObject_GetAttr(grads.p, s_grad_lane) : nullptr);
    if (gradlane.p == nullptr) return -1;
    if (computed.p == Py_None || gradlane.p == Py_None ||
        (w.defined() && w.requires_grad() && weight.p != hooked.p))  // (watch_weight's to do)
        return 0;
    Owned capsule(PyObject_GetAttr(gradlane.p, s_capsule));
    Shared *held = capsule.p ? held_grads(capsule.p) : nullptr;
    if (held == nullptr) return -1;
    x.grad_fn()->add_pre_hook(std::make_unique<SiteHook>(*held, SITE_HIDDEN, x.output_nr()));
    y.grad_fn()->add_pre_hook(std::make_unique<OutHook>(*held, y.output_nr(), x, w));
    // LayerHook.record_dtypes where anything its signature is made of changed
    int64_t dtypes[4] = {(int64_t)x.scalar_type(), w.defined() ? (int64_t)w.scalar_type() : -1,
                         (int64_t)y.scalar_type(),
                         at::autocast::is_autocast_enabled(at::kCPU)
                             ? (int64_t)at::autocast::get_autocast_dtype(at::kCPU) : -1};
    std::string op = y.grad_fn()->name();
    Owned signature(PyObject_GetAttr(layer, s_signature));
    if (signature.p == nullptr) return -1;
    if (signature.p == lane->signature && std::equal(dtypes, dtypes + 4, lane->dtypes) &&
        op == lane->op)
        return 1;
    PyObject *call[4] = {layer, module, xo, yo};
    Owned done(PyObject_VectorcallMethod(s_record_dtypes, call, 4, nullptr));
    Owned noted(done.p ? PyObject_GetAttr(layer, s_signature) : nullptr);
    if (noted.p == nullptr) return -1;
    Py_XSETREF(lane->signature, Py_NewRef(noted.p));
    std::copy(dtypes, dtypes + 4, lane->dtypes);
    lane->op = std::move(op);
    return 1;
}

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

PyObject *hook_weight(PyObject *, PyObject *args) {
    PyObject *capsule, *wo;
    if (!PyArg_ParseTuple(args, "OO", &capsule, &wo)) return nullptr;
    at::Tensor w;
    Shared *held = unpack(capsule, wo, w);
    if (held == nullptr) return nullptr;
    if (!w.requires_grad()) return PyErr_Format(PyExc_ValueError, "hook_weight: no grad");
    auto hook = std::make_unique<WeightHook>(*held);
    void *handle = hook.get();
    torch::autograd::impl::add_hook(w, std::move(hook));
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

// own(RowBuffers.take, Accumulator.stage, Accumulator.stage_grad, then LayerHook._tail,
// ._watch_grads, .record_dtypes, GradHooks.watch_call, .computes, .watch_weight), as their
// classes define them: where an object's method is still one of these, its common case
// runs here (borrowed_buffer, staged, full_tail)
PyObject *own(PyObject *, PyObject *args) {
    constexpr Py_ssize_t n = 3 + TAIL_METHODS;
    if (!PyTuple_Check(args) || PyTuple_GET_SIZE(args) != n)
        return PyErr_Format(PyExc_TypeError, "own: %zd functions", n);
    PyObject **slots[n] = {&f_take, &f_stage, &f_stage_grad};
    for (int i = 0; i < TAIL_METHODS; i++) slots[3 + i] = &f_tail[i];
    for (Py_ssize_t i = 0; i < n; i++)
        Py_XSETREF(*slots[i], Py_NewRef(PyTuple_GET_ITEM(args, i)));
    Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"hook", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(hook)),
     METH_FASTCALL, "hook(layer, module, args, kwargs, output): the forward hook"},
    {"pre", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(pre)),
     METH_FASTCALL, "pre(path_pre, module, args, kwargs): the forward pre-hook"},
    {"lane", lane, METH_VARARGS, "one layer's lane (a capsule)"},
    {"grads", grads, METH_VARARGS, "one layer's gradient hooks (a capsule)"},
    {"close", close, METH_O, "close(capsule): its hooks do nothing from now on"},
    {"hook_site", hook_site, METH_VARARGS, "hook_site(capsule, t, site): t's node's pre-hook"},
    {"hook_out", hook_out, METH_VARARGS,
     "hook_out(capsule, y, x, weight): y's node's pre-hook, with the gradient through"},
    {"hook_weight", hook_weight, METH_VARARGS, "hook_weight(capsule, w): w's hook's handle"},
    {"unhook", unhook, METH_VARARGS, "unhook(w, handle)"},
    {"setup", setup, METH_VARARGS, "setup(addresses of the C readers)"},
    {"own", own, METH_VARARGS, "own(take, stage, stage_grad, *tail): the classes' own methods"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef definition = {PyModuleDef_HEAD_INIT, "normwatch_lane", nullptr, -1, methods};

}  // namespace

extern PyMethodDef normwatch_sampler_methods[];  // sampler.cpp's, in the same module

PyMODINIT_FUNC PyInit_normwatch_lane() {
    struct {
        PyObject **slot;
        const char *name;
    } names[] = {{&s_paused, "paused"}, {&s_full_stats, "full_stats"}, {&s_kernel, "kernel"},
                 {&s_check_outputs, "check_outputs"}, {&s_output_checked, "output_checked"},
                 {&s_calls, "calls"}, {&s_training, "training"}, {&s_step, "step"},
                 {&s_calls_this_step, "calls_this_step"}, {&s_tokens, "tokens"},
                 {&s_input_shape, "input_shape"}, {&s_auto, "auto"},
                 {&s_lane, "_lane_state"}, {&s_fail, "_fail"},
                 {&s_accumulator, "accumulator"}, {&s_stage, "stage"}, {&s_shape, "shape"},
                 {&s_capsule, "capsule"}, {&s_gradients, "gradients"},
                 {&s_stage_grad, "stage_grad"}, {&s_both, "_both"}, {&s_node, "_node"},
                 {&s_weight_grad, "_weight_grad"}, {&s_tail, "_tail"}, {&s_free, "_free"},
                 {&s_lent, "_lent"}, {&s_staged_calls, "_staged"},
                 {&s_staged_grads, "_staged_grads"}, {&s_staged_tokens, "_staged_tokens"},
                 {&s_max_staged, "max_staged_tokens"}, {&s_commit, "commit"},
                 {&s_grads, "grads"}, {&s_grad_lane, "_lane"}, {&s_computed, "_computed"},
                 {&s_hooked_weight, "_weight"}, {&s_weight, "weight"},
                 {&s_signature, "_signature"}, {&s_record_dtypes, "record_dtypes"},
                 {&s_watch_grads, "_watch_grads"}, {&s_watch_call, "watch_call"},
                 {&s_computes, "computes"}, {&s_watch_weight, "watch_weight"}};
    for (auto &n : names)
        if ((*n.slot = PyUnicode_InternFromString(n.name)) == nullptr) return nullptr;
    PyObject *m = PyModule_Create(&definition);
    if (m != nullptr && PyModule_AddFunctions(m, normwatch_sampler_methods) < 0) Py_CLEAR(m);
    return m;
}
