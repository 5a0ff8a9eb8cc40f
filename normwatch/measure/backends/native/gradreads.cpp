// The gradient hooks' reading, lending, staging and Python fallbacks (grads.h), shared
// by the hooks (grads.cpp), and a compiled gradient's read (lane.cpp's observe_grad).
#include "grads.h"

#include <ATen/Parallel.h>
#include <torch/csrc/autograd/grad_mode.h>

namespace normwatch::grads {

void drop_grads(PyObject *capsule) {
    auto *held = static_cast<Shared *>(PyCapsule_GetPointer(capsule, "normwatch.grads"));
    if (held == nullptr) return;
    (*held)->close();
    delete held;
}

Shared *held_grads(PyObject *capsule) {
    return static_cast<Shared *>(PyCapsule_GetPointer(capsule, "normwatch.grads"));
}

// `g`'s plan (planner(g) on a new layout; `whole`: the planner's whole-tensor flag, -1:
// none to pass): 1 planned (plan.args), 0 not covered, -1 an error
int grad_plan(Plan &plan, PyObject *planner, const at::Tensor &g, int whole) {
    if (same_layout(plan, g, g.scalar_type())) return plan.planned;
    Owned go(THPVariable_Wrap(g));
    if (go.p == nullptr) return -1;
    Owned got(whole < 0 ? PyObject_CallOneArg(planner, go.p)
                        : PyObject_CallFunctionObjArgs(planner, go.p, Py_None,
                                                       whole ? Py_True : Py_False, nullptr));
    return got.p == nullptr ? -1 : take_plan(plan, got.p, g, g.scalar_type());
}

// A buffer of `count` float32 from the lender (a new reference), or nullptr
PyObject *lent(Grads &gr, int64_t count) {
    PyObject *shape = Py_BuildValue("(L)", (long long)count);
    if (shape == nullptr) return nullptr;
    PyObject *buffer = lend(gr.lender, shape);
    Py_DECREF(shape);
    return buffer;
}

// Stage GradRows(buffer, None, None, row, site, width); takes `buffer`'s reference: 0 or -1
int stage(Grads &gr, PyObject *buffer, int site, int64_t width) {
    int64_t count = THPVariable_Unpack(buffer).numel();  // (GradRows.norms' tokens)
    auto *type = reinterpret_cast<PyTypeObject *>(gr.rows_type);
    PyObject *s = PyLong_FromLong(site), *w = PyLong_FromLongLong(width);
    PyObject *rows = s && w ? type->tp_alloc(type, GRAD_ROWS_FIELDS) : nullptr;
    if (rows == nullptr) {
        for (PyObject *o : {s, w, buffer}) Py_XDECREF(o);
        return -1;
    }
    PyObject *items[GRAD_ROWS_FIELDS] = {buffer, Py_None, Py_None, gr.row, s, w};
    for (int i = 0; i < GRAD_ROWS_FIELDS; i++) {
        if (i == 1 || i == 2 || i == 3) Py_INCREF(items[i]);
        PyTuple_SET_ITEM(rows, i, items[i]);
    }
    int r = normwatch::stage(gr.runtime, names.staged_grads, rows, count);
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
    Plan &plan = gr.plans[site];
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

// A launch lane's read of `g` at `site`: a buffer of its launcher's plan from the lender,
// filled by one launch (the plan's static launch, from here; else the backend's
// lane_grad_launch), staged: 1 read here, 0 not planned, -1 an error
int launch_rows(Grads &gr, int site, const at::Tensor &g, const at::Tensor *part) {
    Plan &plan = gr.plans[site];
    int t = grad_plan(plan, gr.site_planner, g, -1);
    if (t != 1) return t;
    PyObject *buffer = lend_launch(gr.lender, plan);
    if (buffer == nullptr) return -1;
    int64_t width = g.size(-1);
    t = launch_native(plan, part != nullptr,  // (the pair's: without a part, with one)
                      {&g, part ? part : &g, &THPVariable_Unpack(buffer)});
    if (t != 0) {
        if (t < 0) {
            Py_DECREF(buffer);
            return -1;
        }
        return stage(gr, buffer, site, width) < 0 ? -1 : 1;
    }
    Owned go(THPVariable_Wrap(g)), po(part ? THPVariable_Wrap(*part) : Py_NewRef(Py_None)),
        n(PyLong_FromLongLong(g.numel() / width)), w(PyLong_FromLongLong(width));
    PyObject *run[5] = {go.p, po.p, buffer, n.p, w.p};
    Owned done(go.p && po.p && n.p && w.p ? PyObject_Vectorcall(gr.launcher, run, 5, nullptr)
                                          : nullptr);
    if (done.p == nullptr) {
        Py_DECREF(buffer);
        return -1;
    }
    return stage(gr, buffer, site, width) < 0 ? -1 : 1;
}

int read_site(Grads &gr, int site, const at::Tensor &g, const at::Tensor *part) {
    if (gr.launcher != Py_None) {
        if (!own(g) || g.dim() == 0 || g.size(-1) != gr.width ||
            (part && (!own(*part) || part->scalar_type() != g.scalar_type() ||
                      !part->sizes().equals(g.sizes()))))
            return 0;
        return launch_rows(gr, site, g, part);
    }
    if (part || !plain(g) || g.dim() == 0 || g.size(-1) != gr.width) return 0;
    return read_rows(gr, site, g, 0, g.size(-1));
}

int read_weight(Grads &gr, const at::Tensor &g) {
    if (gr.launcher == Py_None)
        return plain(g) && g.numel() ? read_rows(gr, SITE_WEIGHT, g, 1, 1) : 0;
    // a launch lane's: the whole gradient's norm, as the backend's grad_rows takes it
    // (torch's, no launcher: a scalar), in float32 for the half formats
    if (g.key_set().has(c10::DispatchKey::Python)) return 0;  // (a DTensor's: Python's)
    at::NoGradGuard no_graph;  // (create_graph=True: the norm is read, not differentiated)
    bool half = g.scalar_type() == at::kHalf || g.scalar_type() == at::kBFloat16;
    at::Tensor norm = at::linalg_vector_norm(g, 2, c10::nullopt, false,
                                             half ? std::optional<at::ScalarType>(at::kFloat)
                                                  : std::nullopt);
    PyObject *buffer = THPVariable_Wrap(norm);
    if (buffer == nullptr) return -1;
    return stage(gr, buffer, SITE_WEIGHT, 1) < 0 ? -1 : 1;
}

// The parts read (one, or a launch lane's two alike, here), else GradHooks._in(parts)
int read_through(Grads &gr, const std::vector<at::Tensor> &parts) {
    int t = 0;
    if (!parts[0].numel()) return 1;  // (as _measure: nothing to read)
    if (parts.size() <= 2)
        t = read_site(gr, SITE_IN, parts[0], parts.size() == 2 ? &parts[1] : nullptr);
    if (t != 0) return t;
    PyObject *list = PyList_New((Py_ssize_t)parts.size());
    for (size_t i = 0; list != nullptr && i < parts.size(); i++) {
        PyObject *p = wrapped(parts[i]);
        if (p == nullptr) Py_CLEAR(list);
        else PyList_SET_ITEM(list, (Py_ssize_t)i, p);
    }
    PyObject *args = list ? Py_BuildValue("(N)", list) : nullptr;
    t = args && fallback(gr, names.through, args) == 0 ? 1 : -1;
    Py_XDECREF(args);
    return t;
}

int stage_through(Grads &gr, PyObject *out, PyObject *in, int64_t width) {
    if (stage(gr, out, SITE_OUT, width) < 0) {
        Py_DECREF(in);
        return -1;
    }
    return stage(gr, in, SITE_IN, width) < 0 ? -1 : 1;
}

// The output's gradient g and, from it and the norm's input x and weight w, the gradient
// through the norm, read by the C kernel and staged (GradHooks._out_through's plain
// case): 1 read here, 0 not the plain case, -1 an error
int read_out(Grads &r, const at::Tensor &g, const at::Tensor &xs, const at::Tensor &ws) {
    if (!plain(g) || g.scalar_type() != at::kFloat || !g.sizes().equals(xs.sizes()) ||
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
    return stage_through(r, dg, din, g.size(-1));
}

// A launch lane's output gradient g and, from it and x and w (float32, or none), the
// gradient through the norm: one static launch of the plan its through planner made
// (the backend's lane_through_plan) into two lent buffers, staged at OUT and IN: 1 read
// here, 0 not (no plan or no static launch: Python's), -1 an error
int launch_out(Grads &gr, const at::Tensor &g, const at::Tensor &x, const at::Tensor &w) {
    if (!own(g) || !own(x) || g.dim() == 0 || g.size(-1) != gr.width ||
        g.scalar_type() != x.scalar_type() || !g.sizes().equals(x.sizes()) ||
        (w.defined() && (!own(w) || w.scalar_type() != at::kFloat)))
        return 0;
    Plan &plan = gr.through_plan;  // (its dy: whether a weight is read)
    at::ScalarType weighted = w.defined() ? at::kFloat : at::ScalarType::Undefined;
    if (!same_layout(plan, g, weighted)) {
        Owned go(THPVariable_Wrap(g)), xo(THPVariable_Wrap(x)),
            wo(w.defined() ? THPVariable_Wrap(w) : Py_NewRef(Py_None));
        Owned got(go.p && xo.p && wo.p ? PyObject_CallFunctionObjArgs(
                                             gr.through_planner, go.p, xo.p, wo.p, nullptr)
                                       : nullptr);
        if (got.p == nullptr || take_plan(plan, got.p, g, weighted) < 0) return -1;
    }
    if (!plan.planned || plan.native == nullptr || plan.native == Py_None) return 0;
    PyObject *out = lend_launch(gr.lender, plan);
    PyObject *in = out ? lend_launch(gr.lender, plan) : nullptr;
    if (in == nullptr) {
        Py_XDECREF(out);
        return -1;
    }
    int t = launch_native(plan, -1, {&g, &x, w.defined() ? &w : &x, &THPVariable_Unpack(out),
                                     &THPVariable_Unpack(in)});
    if (t != 1) {  // (not launched: the buffers stay lent until the fold, unused)
        Py_DECREF(out);
        Py_DECREF(in);
        return t;
    }
    return stage_through(gr, out, in, g.size(-1));
}

}  // namespace normwatch::grads

using namespace normwatch::grads;

// A compiled gradient on a measured step (lane.cpp's observe_grad): g at `site` (x
// defined: the output's, with the norm's input x and weight w, the gradient through the
// norm too), read as GradHooks.measure reads it: 1 read here, 0 not the plain case
// (Python's), -1 an error
int normwatch::compiled_gradient(PyObject *capsule, int site, const at::Tensor &g,
                                 const at::Tensor &x, const at::Tensor &w) {
    Shared *held = held_grads(capsule);
    if (held == nullptr) return -1;
    Grads &gr = **held;
    if (!gr.open || !g.numel()) return 0;
    if (site == SITE_WEIGHT) return read_weight(gr, g);
    if (!x.defined()) return read_site(gr, site, g, nullptr);
    // the gradient through the norm: the C kernel's (as full_tail's common case), a
    // launch lane's by one launch
    if (site != SITE_OUT) return 0;
    if (gr.launcher != Py_None) return launch_out(gr, g, x, w);
    if (!c_through(x, w) || x.size(-1) != gr.width) return 0;
    return read_out(gr, g, x, w);
}

