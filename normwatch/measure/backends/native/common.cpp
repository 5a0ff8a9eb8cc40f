// The lanes' shared helpers (lane.h declares them): the attribute names by role, taken
// from contract.NAMES at setup; reading and writing Python attributes; lending a buffer
// and staging rows as RowBuffers.take and Accumulator.stage do; handing an error to a
// layer's _fail.
#include "lane.h"

#include <ATen/Parallel.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

namespace normwatch {

Names names;
RowsFn rows_planned = nullptr, grad_rows_planned = nullptr;
ThroughFn through = nullptr;
PyObject *dynamo_callback = nullptr;  // torch._C._dynamo.eval_frame.get_eval_frame_callback

int set_names(PyObject *dict) {
    struct {
        PyObject **slot;
        const char *role;
    } roles[] = {
        {&names.paused, "paused"}, {&names.full_stats, "full_stats"},
        {&names.check_outputs, "check_outputs"}, {&names.gradients, "gradients"},
        {&names.step, "step"}, {&names.calls_this_step, "calls_this_step"},
        {&names.accumulator, "accumulator"}, {&names.calls, "calls"},
        {&names.tokens, "tokens"}, {&names.input_shape, "input_shape"},
        {&names.output_checked, "output_checked"}, {&names.training, "training"},
        {&names.weight, "weight"}, {&names.staged_calls, "staged_calls"},
        {&names.staged_grads, "staged_grads"}, {&names.staged_tokens, "staged_tokens"},
        {&names.max_staged, "max_staged"}, {&names.commit, "commit"}, {&names.free, "free"},
        {&names.lent, "lent"}, {&names.take, "take"}, {&names.lane_state, "lane_state"},
        {&names.capsule, "capsule"}, {&names.tail, "tail"}, {&names.fail, "fail"},
        {&names.python_call, "python_call"},
        {&names.python_grad, "python_grad"}, {&names.recorder, "recorder"},
        {&names.grads, "grads"}, {&names.module, "module"}, {&names.signature, "signature"},
        {&names.record_dtypes, "record_dtypes"}, {&names.after, "after"},
        {&names.computed, "computed"}, {&names.hooked_weight, "hooked_weight"},
        {&names.grad_lane, "grad_lane"}, {&names.node, "node"}, {&names.both, "both"},
        {&names.weight_grad, "weight_grad"}, {&names.through, "through"},
        {&names.gather, "gather"}, {&names.pack_kind, "pack_kind"},
        {&names.pack_kept, "pack_kept"}, {&names.pack_split, "pack_split"},
        {&names.pack_blocks, "pack_blocks"}, {&names.pack_width, "pack_width"},
        {&names.pack_stride, "pack_stride"}, {&names.pack_scale, "pack_scale"},
        {&names.pack_params, "pack_params"}};
    if (!PyDict_Check(dict)) {
        PyErr_SetString(PyExc_TypeError, "names: a dict of role -> name");
        return -1;
    }
    for (auto &r : roles) {
        PyObject *name = PyDict_GetItemString(dict, r.role);  // (borrowed)
        if (name == nullptr || !PyUnicode_Check(name)) {
            PyErr_Format(PyExc_KeyError, "names: no name for the role %s", r.role);
            return -1;
        }
        Py_INCREF(name);
        PyUnicode_InternInPlace(&name);
        Py_XSETREF(*r.slot, name);
    }
    return 0;
}

template <class T>
T attribute(PyObject *owner, PyObject *name, T (*read)(PyObject *), T bad) {
    PyObject *v = PyObject_GetAttr(owner, name);
    if (v == nullptr) return bad;
    T got = read(v);
    Py_DECREF(v);
    return got;
}

int truth(PyObject *owner, PyObject *name) {
    return attribute<int>(owner, name, PyObject_IsTrue, -1);
}

int64_t integer(PyObject *owner, PyObject *name) {
    return attribute<long long>(owner, name, PyLong_AsLongLong, -1);
}

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

bool lined(const at::Tensor &t) {
    return t.layout() == at::kStrided && t.is_contiguous() && !t.key_set().has_any(WRAPPERS);
}

bool readable(const at::Tensor &t) { return t.is_cpu() && lined(t); }

bool launchable(const at::Tensor &x, const at::Tensor &y) {
    return lined(x) && lined(y) && x.device() == y.device();
}

bool own(const at::Tensor &t) {
    return lined(t) && !t.key_set().has(c10::DispatchKey::Python);
}

bool plain(const at::Tensor &t) { return t.defined() && t.is_cpu() && own(t); }

bool c_through(const at::Tensor &x, const at::Tensor &w) {
    return plain(x) && x.scalar_type() == at::kFloat && x.dim() > 0 &&
           (!w.defined() ||
            (plain(w) && w.scalar_type() == at::kFloat && w.numel() == x.size(-1)));
}

PyObject *lend(PyObject *lender, PyObject *shape, PyObject *key, PyObject *device) {
    Owned free(PyObject_GetAttr(lender, names.free));
    PyObject *kept = free.p == nullptr || !PyDict_Check(free.p) ? nullptr
                     : PyDict_GetItemWithError(free.p, key ? key : shape);  // (borrowed)
    if (PyErr_Occurred()) return nullptr;
    if (kept != nullptr && PyList_Check(kept) && PyList_GET_SIZE(kept) > 0) {
        Py_ssize_t n = PyList_GET_SIZE(kept);
        PyObject *rows = Py_NewRef(PyList_GET_ITEM(kept, n - 1));
        Owned lent(PyList_SetSlice(kept, n - 1, n, nullptr) == 0
                       ? PyObject_GetAttr(lender, names.lent) : nullptr);
        if (lent.p == nullptr || !PyList_Check(lent.p) || PyList_Append(lent.p, rows) < 0) {
            if (lent.p != nullptr && !PyErr_Occurred())
                PyErr_SetString(PyExc_TypeError, "lane: the lender's loans are no list");
            Py_DECREF(rows);
            return nullptr;
        }
        return rows;
    }
    PyObject *take[3] = {lender, shape, device};  // none free
    PyObject *rows = PyObject_VectorcallMethod(names.take, take, device ? 3 : 2, nullptr);
    if (rows != nullptr && !THPVariable_Check(rows)) {
        Py_DECREF(rows);
        PyErr_SetString(PyExc_TypeError, "lane: the lender gave no tensor");
        return nullptr;
    }
    return rows;
}

PyObject *lend_launch(PyObject *lender, Plan &plan) {
    if (plan.where == nullptr) {
        plan.threads = -1;  // (asked again)
        PyErr_SetString(PyExc_TypeError, "lane: a launch plan: (shape, key, device)");
        return nullptr;
    }
    // held: the lender's Python may let another thread in, whose call may plan anew
    Owned shape(Py_NewRef(plan.shape)), key(Py_NewRef(plan.key)), where(Py_NewRef(plan.where));
    return lend(lender, shape.p, key.p, where.p);
}

int stage(PyObject *runtime, PyObject *queue, PyObject *rows, int64_t n) {
    Owned accumulator(PyObject_GetAttr(runtime, names.accumulator));
    if (accumulator.p == nullptr) return -1;
    Owned list(PyObject_GetAttr(accumulator.p, queue));
    if (list.p == nullptr) return -1;
    if (!PyList_Check(list.p)) {
        PyErr_SetString(PyExc_TypeError, "lane: the accumulator's queue is no list");
        return -1;
    }
    int64_t tokens, cap;
    if (PyList_Append(list.p, rows) < 0 ||
        ((tokens = integer(accumulator.p, names.staged_tokens)) == -1 && PyErr_Occurred()) ||
        ((cap = integer(accumulator.p, names.max_staged)) == -1 && PyErr_Occurred()) ||
        add(accumulator.p, names.staged_tokens, n) < 0)
        return -1;
    if (tokens + n < cap) return 0;
    Owned done(PyObject_CallMethodNoArgs(accumulator.p, names.commit));
    return done.p == nullptr ? -1 : 0;
}

void release(Plan &plan) {
    for (PyObject **o : {&plan.shape, &plan.key, &plan.where, &plan.native}) Py_CLEAR(*o);
}

int launch_native(Plan &plan, int part, std::initializer_list<const at::Tensor *> tensors) {
    PyObject *spec = plan.native;
    if (spec != nullptr && part >= 0)  // (a pair's item)
        spec = PyTuple_Check(spec) && PyTuple_GET_SIZE(spec) == 2 ? PyTuple_GET_ITEM(spec, part)
                                                                  : nullptr;
    if (spec == nullptr || spec == Py_None || plan.refused & (1 << (part + 1))) return 0;
    PyObject *head, *kept, *at;
    if (!PyTuple_Check(spec) || PyTuple_GET_SIZE(spec) != 5 ||
        !PyTuple_Check(head = PyTuple_GET_ITEM(spec, 1)) ||
        !PyTuple_Check(kept = PyTuple_GET_ITEM(spec, 2)) ||
        !PyTuple_Check(at = PyTuple_GET_ITEM(spec, 3)) ||
        PyTuple_GET_SIZE(at) < (Py_ssize_t)tensors.size()) {
        PyErr_SetString(PyExc_TypeError,
                        "lane: a static launch: (launcher, head, args, places, stream)");
        return -1;
    }
    for (const at::Tensor *t : tensors)  // (as compiled: Triton's aligned pointers)
        if (reinterpret_cast<uintptr_t>(t->const_data_ptr()) % 16) return 0;
    const c10::Device device = tensors.begin()[0]->device();
    if (device.is_cuda() && c10::impl::getDeviceGuardImpl(device.type())->getDevice() != device)
        return 0;  // (its kernel is loaded in its device's context: Triton's launch serves)
    Py_ssize_t n = PyTuple_GET_SIZE(kept), h = PyTuple_GET_SIZE(head), k = 0;
    Owned args(PyTuple_New(n));
    if (args.p == nullptr) return -1;
    for (Py_ssize_t i = 0; i < n; i++)
        PyTuple_SET_ITEM(args.p, i, Py_NewRef(PyTuple_GET_ITEM(kept, i)));
    for (const at::Tensor *t : tensors) {
        Py_ssize_t i = PyLong_AsSsize_t(PyTuple_GET_ITEM(at, k++));
        if (i < 0 || i >= n) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_IndexError, "lane: a pointer's index");
            return -1;
        }
        PyObject *p = PyLong_FromVoidPtr(const_cast<void *>(t->const_data_ptr()));
        if (p == nullptr || PyTuple_SetItem(args.p, i, p) < 0) return -1;
    }
    PyObject *streams = PyTuple_GET_ITEM(spec, 4), *stream;  // (the device's current one)
    if (streams == Py_None) {
        stream = PyLong_FromLong(0);
    } else {
        Owned index(PyLong_FromLong(device.index()));
        stream = index.p ? PyObject_CallOneArg(streams, index.p) : nullptr;
    }
    if (stream == nullptr) return -1;
    Owned call(PyTuple_New(h + 2));
    if (call.p == nullptr) {
        Py_DECREF(stream);
        return -1;
    }
    PyTuple_SET_ITEM(call.p, h + 1, stream);
    for (Py_ssize_t i = 0; i < h; i++)
        PyTuple_SET_ITEM(call.p, i, Py_NewRef(PyTuple_GET_ITEM(head, i)));
    PyTuple_SET_ITEM(call.p, h, args.p);
    args.p = nullptr;
    Owned done(PyObject_Call(PyTuple_GET_ITEM(spec, 0), call.p, nullptr));
    if (done.p != nullptr) return 1;
    PyErr_Clear();  // (a launcher that refuses: Triton's launch serves from now on)
    plan.refused |= 1 << (part + 1);
    return 0;
}

bool same_layout(const Plan &plan, const at::Tensor &x, at::ScalarType dy) {
    return plan.threads == at::get_num_threads() && plan.dx == x.scalar_type() &&
           plan.dy == dy && plan.device == x.device() && x.sizes().equals(plan.sizes);
}

int take_plan(Plan &plan, PyObject *got, const at::Tensor &x, at::ScalarType dy) {
    plan.threads = -1;  // (until the new plan is read whole)
    plan.args.clear();
    PyObject *args = got, *shape = nullptr, *key = nullptr, *where = nullptr, *native = nullptr;
    Py_ssize_t parts = PyTuple_Check(got) ? PyTuple_GET_SIZE(got) : 0;
    if (parts >= 2 && parts <= 4) {  // a readers.RowPlan, or a launcher's lane_plan
        shape = PyTuple_GET_ITEM(got, 0);
        args = parts == 2 ? PyTuple_GET_ITEM(got, 1) : nullptr;
        if (parts >= 3) {
            key = PyTuple_GET_ITEM(got, 1);
            where = PyTuple_GET_ITEM(got, 2);
        }
        if (parts == 4) native = PyTuple_GET_ITEM(got, 3);
    }
    if (args != nullptr && got != Py_None) {
        Py_ssize_t n = PySequence_Size(args);
        for (Py_ssize_t i = 0; i < n; i++) {
            Owned v(PySequence_GetItem(args, i));
            int64_t a = v.p == nullptr ? -1 : PyLong_AsLongLong(v.p);
            if (a == -1 && PyErr_Occurred()) return -1;
            plan.args.push_back(a);
        }
        if (n < 0) return -1;
    }
    Py_XSETREF(plan.shape, Py_XNewRef(shape));
    Py_XSETREF(plan.key, Py_XNewRef(key));
    Py_XSETREF(plan.where, Py_XNewRef(where));
    Py_XSETREF(plan.native, Py_XNewRef(native));
    plan.refused = 0;
    plan.device = x.device();
    plan.sizes.assign(x.sizes().begin(), x.sizes().end());
    plan.dx = x.scalar_type();
    plan.dy = dy;
    plan.planned = got != Py_None;
    plan.threads = at::get_num_threads();
    return plan.planned;
}

int hand_to_fail(PyObject *owner) {
    PyObject *type, *value, *trace;
    PyErr_Fetch(&type, &value, &trace);
    PyErr_NormalizeException(&type, &value, &trace);
    if (trace != nullptr && value != nullptr) PyException_SetTraceback(value, trace);
    PyObject *r = owner != nullptr && value != nullptr
                      ? PyObject_CallMethodOneArg(owner, names.fail, value) : Py_NewRef(Py_None);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(trace);
    if (r == nullptr) return -1;
    Py_DECREF(r);
    return 0;
}

int grads_now(PyObject *rt) {
    int t;
    if ((t = truth(rt, names.gradients)) != 1 || (t = truth(rt, names.full_stats)) != 1)
        return t;
    t = truth(rt, names.paused);
    return t < 0 ? -1 : !t;
}

}  // namespace normwatch

int normwatch::compiling_frames() {
    PyObject *callback = PyObject_CallNoArgs(dynamo_callback);
    if (callback == nullptr) return -1;
    int on = callback != Py_None && callback != Py_False;  // (False: cached code only)
    Py_DECREF(callback);
    return on;
}

// setup(names (contract.NAMES), addresses of normwatch_rows_planned,
// normwatch_grad_rows_planned, normwatch_through, torch._C._dynamo.eval_frame.
// get_eval_frame_callback, contract.MAX_NODES)
PyObject *normwatch::setup(PyObject *, PyObject *args) {
    PyObject *dict, *a, *b, *c, *callback;
    long long walk;
    if (!PyArg_ParseTuple(args, "OOOOOL", &dict, &a, &b, &c, &callback, &walk)) return nullptr;
    max_nodes = walk;
    if (!PyCallable_Check(callback)) return PyErr_Format(PyExc_TypeError, "setup: callable");
    if (set_names(dict) < 0) return nullptr;
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
