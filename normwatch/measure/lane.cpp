// The forward hook's sentinel lane in C++ (normwatch.measure.fastlane builds and loads
// it; compiled against torch's headers).
//
// hook(layer, module, args, kwargs, output) is registered with torch as
// functools.partial(hook, layer): torch's hook loop calls it with no Python frame. A
// sentinel-tier training call of the common CPU case (what LayerHook._lane takes, in the
// sentinel tier) is measured here as _lane measures it: the same C kernel
// (normwatch_rows_planned), the same buffer lender, the same CallRows staged, the same
// counts. Any other call, and every call while Dynamo traces (a Python stand-in), goes
// to the Python LayerHook. An error here disables the hook as the Python hook's would
// (LayerHook._fail): training goes on.
#include <Python.h>

#include <ATen/Parallel.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

using RowsFn = int (*)(const void *, const void *, float *, const int64_t *);
RowsFn rows_planned = nullptr;

constexpr int PLAN_SIZE = 9;   // normwatch_rows_planned's plan (native.row_plan's args)

// One layer's lane: what LayerHook hands over once (owned references), and the plan of
// the last layout met
struct Lane {
    PyObject *runtime, *counts, *take, *planner, *call_type, *row, *eps, *centred;
    int64_t width, key_stride;
    std::vector<int64_t> sizes;  // the last layout: x's sizes, dtypes, torch's threads
    at::ScalarType dx = at::ScalarType::Undefined, dy = at::ScalarType::Undefined;
    int threads = -1;
    bool planned = false;  // the planner covered that layout
    PyObject *shape = nullptr;  // the rows' shape (a tuple), where planned
    int64_t plan[PLAN_SIZE] = {0};
};

PyObject *s_paused, *s_full_stats, *s_kernel, *s_check_outputs, *s_output_checked, *s_calls,
    *s_training, *s_step, *s_calls_this_step, *s_tokens, *s_input_shape, *s_auto, *s_lane,
    *s_fail, *s_accumulator, *s_stage, *s_shape, *s_capsule;

void drop(PyObject *capsule) {
    auto *lane = static_cast<Lane *>(PyCapsule_GetPointer(capsule, "normwatch.lane"));
    if (lane == nullptr) return;
    for (PyObject *o : {lane->runtime, lane->counts, lane->take, lane->planner,
                        lane->call_type, lane->row, lane->eps, lane->centred, lane->shape})
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

// The plan for x and y's layout (asked of the planner on a new one), copied into `plan`
// and `shape` (a new reference) where planned: 1 planned, 0 not covered, -1 an error.
// (Copied while the GIL is held throughout: the lender's Python after it may let another
// thread in, whose call of this layer may plan another layout.)
int planned(Lane *lane, PyObject *xo, PyObject *yo, const at::Tensor &x, const at::Tensor &y,
            int64_t *plan, PyObject **shape) {
    int threads = at::get_num_threads();
    auto sizes = x.sizes();
    if (lane->threads == threads && lane->dx == x.scalar_type() && lane->dy == y.scalar_type() &&
        sizes.equals(lane->sizes)) {
        if (!lane->planned) return 0;
        std::copy(lane->plan, lane->plan + PLAN_SIZE, plan);
        Py_INCREF(*shape = lane->shape);
        return 1;
    }
    lane->threads = -1;  // (until the new plan is read whole)
    PyObject *got = PyObject_CallFunctionObjArgs(lane->planner, xo, yo, nullptr);
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
            lane->plan[i] = v == nullptr ? -1 : PyLong_AsLongLong(v);
            Py_XDECREF(v);
            if (lane->plan[i] == -1 && PyErr_Occurred()) {
                Py_DECREF(got);
                return -1;
            }
        }
        PyObject *shape = PyTuple_GetItem(got, 0);
        Py_XINCREF(shape);
        Py_XSETREF(lane->shape, shape);
    }
    Py_DECREF(got);
    lane->sizes.assign(sizes.begin(), sizes.end());
    lane->dx = x.scalar_type();
    lane->dy = y.scalar_type();
    lane->planned = covered;
    lane->threads = threads;
    if (!covered) return 0;
    std::copy(lane->plan, lane->plan + PLAN_SIZE, plan);
    Py_INCREF(*shape = lane->shape);
    return 1;
}

// The lane: 1 measured, 0 not taken (the Python hook measures it), -1 an error
int measured(Lane *lane, PyObject *module, PyObject *args, PyObject *output) {
    if (!PyTuple_Check(args) || PyTuple_GET_SIZE(args) < 1) return 0;
    PyObject *xo = PyTuple_GET_ITEM(args, 0);
    if (!THPVariable_CheckExact(xo) || !THPVariable_CheckExact(output)) return 0;
    PyObject *rt = lane->runtime, *c = lane->counts;
    int t;
    if ((t = truth(rt, s_paused)) != 0 || (t = truth(rt, s_full_stats)) != 0)
        return t < 0 ? -1 : 0;  // (the full tier: the Python hook)
    PyObject *kernel = PyObject_GetAttr(rt, s_kernel);
    if (kernel == nullptr) return -1;
    t = PyUnicode_Check(kernel) && PyUnicode_Compare(kernel, s_auto) == 0;
    Py_DECREF(kernel);
    if (!t) return PyErr_Occurred() ? -1 : 0;
    int64_t calls = integer(c, s_calls);
    if (calls <= 0) return calls == -1 && PyErr_Occurred() ? -1 : 0;
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
    if ((t = planned(lane, xo, output, x, y, plan, &shape)) != 1) return t;
    PyObject *buffer = PyObject_CallOneArg(lane->take, shape);
    Py_DECREF(shape);
    if (buffer == nullptr) return -1;
    if (!THPVariable_Check(buffer)) {
        Py_DECREF(buffer);
        PyErr_SetString(PyExc_TypeError, "lane: the lender gave no tensor");
        return -1;
    }
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
                              Py_True, Py_False, Py_False, lane->centred, Py_None};
    PyObject *owned[11] = {nullptr, key, width, nullptr, buffer, count};
    for (int i = 0; i < 11; i++) {
        PyObject *v = owned[i] ? owned[i] : borrowed[i];
        if (!owned[i]) Py_INCREF(v);
        PyTuple_SET_ITEM(call, i, v);
    }
    PyObject *accumulator = PyObject_GetAttr(rt, s_accumulator);
    PyObject *staged = accumulator ? PyObject_CallMethodOneArg(accumulator, s_stage, call)
                                   : nullptr;
    Py_XDECREF(accumulator);
    Py_DECREF(call);
    if (staged == nullptr) return -1;
    Py_DECREF(staged);
    PyObject *size = PyObject_GetAttr(xo, s_shape);
    if (size == nullptr || add(rt, s_calls_this_step, 1) < 0 || add(c, s_calls, 1) < 0 ||
        add(c, s_tokens, tokens) < 0 || PyObject_SetAttr(c, s_input_shape, size) < 0) {
        Py_XDECREF(size);
        return -1;
    }
    Py_DECREF(size);
    return 1;
}

// Disable `layer` as its own hook does (an Exception; anything else goes on up)
PyObject *failed(PyObject *layer) {
    if (!PyErr_ExceptionMatches(PyExc_Exception)) return nullptr;
    PyObject *type, *value, *trace;
    PyErr_Fetch(&type, &value, &trace);
    PyErr_NormalizeException(&type, &value, &trace);
    if (trace != nullptr) PyException_SetTraceback(value, trace);
    PyObject *r = PyObject_CallMethodOneArg(layer, s_fail, value);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(trace);
    if (r == nullptr) return nullptr;
    Py_DECREF(r);
    Py_RETURN_NONE;
}

PyObject *hook(PyObject *, PyObject *const *a, Py_ssize_t n) {
    if (n != 5) {
        PyErr_SetString(PyExc_TypeError, "hook(layer, module, args, kwargs, output)");
        return nullptr;
    }
    PyObject *layer = a[0];
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
            r = measured(lane, a[1], a[2], a[4]);
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

// lane(runtime, counts, take, planner (native.row_plan), CallRows, row, width, eps, centred,
// key_stride):
// one layer's lane, as a capsule for LayerHook's `_lane_state`
PyObject *lane(PyObject *, PyObject *args) {
    PyObject *rt, *counts, *take, *planner, *call_type, *row, *eps, *centred;
    long long width, key_stride;
    if (!PyArg_ParseTuple(args, "OOOOOOLOOL", &rt, &counts, &take, &planner, &call_type,
                          &row, &width, &eps, &centred, &key_stride))
        return nullptr;
    if (!PyType_Check(call_type) ||
        !PyType_IsSubtype(reinterpret_cast<PyTypeObject *>(call_type), &PyTuple_Type))
        return PyErr_Format(PyExc_TypeError, "lane: call type: a tuple's subclass");
    auto *state = new Lane{rt, counts, take, planner, call_type, row, eps, centred, width,
                           key_stride};
    for (PyObject *o : {rt, counts, take, planner, call_type, row, eps, centred})
        Py_INCREF(o);
    PyObject *capsule = PyCapsule_New(state, "normwatch.lane", drop);
    if (capsule == nullptr) {  // (its references with it)
        for (PyObject *o : {rt, counts, take, planner, call_type, row, eps, centred})
            Py_DECREF(o);
        delete state;
    }
    return capsule;
}

// setup(address of normwatch_rows_planned)
PyObject *setup(PyObject *, PyObject *address) {
    void *p = PyLong_AsVoidPtr(address);
    if (p == nullptr) return PyErr_Occurred() ? nullptr
                                              : PyErr_Format(PyExc_ValueError, "setup: null");
    rows_planned = reinterpret_cast<RowsFn>(p);
    Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"hook", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(hook)),
     METH_FASTCALL, "hook(layer, module, args, kwargs, output): the forward hook"},
    {"lane", lane, METH_VARARGS, "one layer's lane (a capsule)"},
    {"setup", setup, METH_O, "setup(address of normwatch_rows_planned)"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef definition = {PyModuleDef_HEAD_INIT, "normwatch_lane", nullptr, -1, methods};

}  // namespace

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
                 {&s_capsule, "capsule"}};
    for (auto &n : names)
        if ((*n.slot = PyUnicode_InternFromString(n.name)) == nullptr) return nullptr;
    return PyModule_Create(&definition);
}
