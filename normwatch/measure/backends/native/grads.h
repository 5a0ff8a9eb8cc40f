// The gradient hooks' state (grads.cpp: the hooks and their registration; gradreads.cpp:
// reading, lending, staging and the Python fallbacks they share).
#pragma once

#include "lane.h"

#include <memory>
#include <vector>

namespace normwatch::grads {

// contract.SITES: GradHooks' sites, then the weight
constexpr int SITE_OUT = 0, SITE_IN = 1, SITE_HIDDEN = 2, SITE_WEIGHT = 3;
constexpr int GRAD_ROWS_FIELDS = 6;  // GradRows' (contract.GRAD_ROWS_FIELDS)

// One layer's gradient side. Its Python references are the capsule's (dropped, under the
// GIL, when it goes or closes); the hooks share the rest and check `open` under the GIL.
struct Grads {
    PyObject *owner = nullptr;  // a weakref to the GradHooks (its fallbacks, _fail)
    PyObject *runtime = nullptr, *lender = nullptr, *rows_type = nullptr, *row = nullptr,
             *site_planner = nullptr, *through_planner = nullptr;
    PyObject *launcher = nullptr;  // a launch lane's read of a site (None: the C readers)
    int64_t width = 0;
    double eps = 0;
    bool open = true;
    Plan plans[4];  // per site: OUT, IN, HIDDEN, WEIGHT (a launch lane's: its
                    // launcher's, WEIGHT unused)
    Plan through_plan;  // the output's gradient with the gradient through the norm

    void close() {
        open = false;
        for (PyObject **o : {&owner, &runtime, &lender, &rows_type, &row, &site_planner,
                             &through_planner, &launcher})
            Py_CLEAR(*o);
        for (Plan &p : plans) release(p);
        release(through_plan);
    }
};

using Shared = std::shared_ptr<Grads>;

// The capsule's gradients (nullptr with an error set)
Shared *held_grads(PyObject *capsule);
// Drop a capsule's gradients (its destructor)
void drop_grads(PyObject *capsule);
// A buffer of `count` float32 from the lender (a new reference), or nullptr
PyObject *lent(Grads &gr, int64_t count);
// Stage GradRows(buffer, None, None, row, site, width); takes `buffer`'s reference: 0 or -1
int stage(Grads &gr, PyObject *buffer, int site, int64_t width);
// Stage a read of the output's gradient at OUT and of the gradient through the norm at IN
// (takes both buffers' references): 1, or -1 an error
int stage_through(Grads &gr, PyObject *out, PyObject *in, int64_t width);
// `g`'s plan (planner(g) on a new layout; `whole`: the planner's whole-tensor flag, -1:
// none to pass): 1 planned (plan.args), 0 not covered, -1 an error
int grad_plan(Plan &plan, PyObject *planner, const at::Tensor &g, int whole);
// The GradHooks (a new reference; nullptr: gone, no error)
PyObject *owner(Grads &gr);
// Disable the layer as its Python hook would (GradHooks._fail), the error cleared
void grad_failed(Grads &gr);
// GradHooks.<name> (a new reference; nullptr: the layer is gone or closed, no error)
PyObject *method_of(Grads &gr, PyObject *name);
// Call GradHooks.<name>(*args) (a fallback: the Python hook's own method): 0 or -1
int fallback(Grads &gr, PyObject *name, PyObject *args);
// A tensor for Python (None for an undefined tensor)
PyObject *wrapped(const at::Tensor &t);
// `g`'s rows (GradReader's read: `whole`, one row) staged at `site` with `width`: 1 read
// here, 0 not planned, -1 an error
int read_rows(Grads &gr, int site, const at::Tensor &g, int whole, int64_t width);
// A gradient `g` at `site` (not the weight; `part`: a second part of it, added as it is
// read, a launch lane's only): 1 read here, 0 not the plain case, -1 an error
int read_site(Grads &gr, int site, const at::Tensor &g, const at::Tensor *part = nullptr);
// The weight's gradient `g`: 1 read here, 0 not the plain case, -1 an error
int read_weight(Grads &gr, const at::Tensor &g);
// The gradient through the norm from the parts its nodes sent to x: read here (one part,
// or a launch lane's two alike), else by GradHooks._in(parts): 1, or -1 an error
int read_through(Grads &gr, const std::vector<at::Tensor> &parts);
// The output's gradient g and, from it, x and w (float32), the gradient through the norm,
// by the C kernel: 1 read here, 0 not the plain case, -1 an error
int read_out(Grads &r, const at::Tensor &g, const at::Tensor &xs, const at::Tensor &ws);
// The same by a launch lane's one static launch (its through planner's plan): 1 read
// here, 0 not (Python's), -1 an error
int launch_out(Grads &gr, const at::Tensor &g, const at::Tensor &x, const at::Tensor &w);

}  // namespace normwatch::grads
