// What the C++ lanes share (lane.cpp: the forward lane; grads.cpp: the gradient hooks):
// the names of the Python attributes they touch (given at setup by contract.NAMES, by
// role: none is written here), reading and writing those attributes, lending a buffer
// and staging rows as RowBuffers and Accumulator do, handing an error to a layer's _fail.
#pragma once

#include <Python.h>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <initializer_list>
#include <vector>

namespace normwatch {

// The attribute names, by role (contract.NAMES' keys; interned strings)
struct Names {
    PyObject *paused, *full_stats, *check_outputs, *gradients, *step, *calls_this_step,
        *accumulator, *calls, *tokens, *input_shape, *output_checked, *training, *weight,
        *staged_calls, *staged_grads, *staged_tokens, *max_staged, *commit, *free, *lent,
        *take, *lane_state, *capsule, *tail, *fail, *python_call, *python_grad, *recorder,
        *grads, *module, *signature, *record_dtypes, *after, *computed, *hooked_weight,
        *grad_lane, *node, *both, *weight_grad, *through, *gather,
        *pack_kind, *pack_kept, *pack_split, *pack_blocks, *pack_width, *pack_stride,
        *pack_scale, *pack_params;
};
extern Names names;

// Fill `names` from a dict of role -> attribute name: 0, or -1 with an error
int set_names(PyObject *dict);

// The holder of a new reference (or nullptr)
struct Owned {
    PyObject *p;
    explicit Owned(PyObject *o) : p(o) {}
    Owned(const Owned &) = delete;
    Owned &operator=(const Owned &) = delete;
    ~Owned() { Py_XDECREF(p); }
};

// An attribute's truth (-1: an error)
int truth(PyObject *owner, PyObject *name);
// An integer attribute (-1 with an error set: an error)
int64_t integer(PyObject *owner, PyObject *name);
// Add `by` to an integer attribute (-1: an error)
int add(PyObject *owner, PyObject *name, int64_t by);

// A C reader's or a launcher's plan of the last layout met (its planner, Python's, asked
// on a new one)
struct Plan {
    std::vector<int64_t> sizes;  // the layout: the tensor's sizes, the dtypes, the device,
    at::ScalarType dx = at::ScalarType::Undefined, dy = at::ScalarType::Undefined;
    c10::Device device{c10::kCPU};
    int threads = -1;            // the threads
    bool planned = false;        // the planner covered that layout
    std::vector<int64_t> args;   // the reader's plan (its arguments)
    PyObject *shape = nullptr;   // the rows' shape, where the planner gives one (owned)
    PyObject *key = nullptr, *where = nullptr;  // a launcher's: the lender's key, device
    PyObject *native = nullptr;  // a launcher's static launch (triton_launch.Spec, or None;
                                 // a gradient's: a pair, without and with a second part)
    int refused = 0;             // the parts whose static launch failed (bits): not tried again
};

// Drop a plan's references
void release(Plan &plan);

// Whether `plan` was made for x's layout (and a second tensor's dtype `dy`)
bool same_layout(const Plan &plan, const at::Tensor &x, at::ScalarType dy);
// Take a planner's answer for x's layout into `plan`: None (not covered), a sequence of
// int64 (the reader's arguments), a pair (the rows' shape, the arguments) or a launcher's
// triple (the rows' shape, the lender's key, the device), or that and its static launch:
// 1 planned, 0 not covered, -1 an error
int take_plan(Plan &plan, PyObject *got, const at::Tensor &x, at::ScalarType dy);

// A contiguous strided tensor, no vmap or grad wrapper
bool lined(const at::Tensor &t);
// What the C readers take: lined, on the CPU
bool readable(const at::Tensor &t);
// What a launch lane's launcher takes: two lined tensors on one device
bool launchable(const at::Tensor &x, const at::Tensor &y);
// Lined, and no tensor subclass (a DTensor's gradient is Python's): what a launcher reads
bool own(const at::Tensor &t);
// A C reader's: defined, on the CPU, own
bool plain(const at::Tensor &t);
// Whether the C kernel computes the gradient through a norm of input `x` and weight `w`
// (undefined: none): both float32 and plain, the weight one element per x's last dim
bool c_through(const at::Tensor &x, const at::Tensor &w);

// Launch `plan`'s static launch (its native; a pair's item `part`) with the tensors'
// pointers (the kernel's leading arguments: put at the spec's first places) on the first
// one's device's current stream (the spec's stream getter's; none: 0): 1 launched, 0 not
// (no spec, a pointer off the 16-byte alignment the kernel was compiled for, a device not
// the current one, or a launch that failed, whose error is dropped and whose spec is not
// tried again: the launcher's Python launches it), -1 an error
int launch_native(Plan &plan, int part, std::initializer_list<const at::Tensor *> tensors);

// A buffer of a launcher's planned `plan` (its shape, the lender's key, the device) from
// `lender`: a new reference, or nullptr with an error (a plan that is not a launcher's)
PyObject *lend_launch(PyObject *lender, Plan &plan);
// A buffer of `shape` (a tuple) from `lender` (a RowBuffers), as its take lends it (on
// `device`, its free buffers under `key`: RowBuffers' for another device than the CPU): a
// new reference, or nullptr with an error
PyObject *lend(PyObject *lender, PyObject *shape, PyObject *key = nullptr,
               PyObject *device = nullptr);

// Stage `rows` (of `n` tokens) in `runtime`'s accumulator's queue `queue` (a role's
// name), as Accumulator.stage and .stage_grad do: 0, or -1 with an error
int stage(PyObject *runtime, PyObject *queue, PyObject *rows, int64_t n);

// Hand the pending error to owner._fail (the error taken; `owner` null: dropped): 0, or
// -1 with _fail's own error set
int hand_to_fail(PyObject *owner);

// Whether this step's backward is measured (Runtime.grads_now, read as its parts): 1, 0,
// -1 an error
int grads_now(PyObject *runtime);

// The gradient hooks of a full-tier call's common case (grads.cpp): the hidden state's
// on x's node, the output's with the gradient through the norm on y's, from the layer's
// gradient capsule `capsule`: 0, or -1 with an error
int hook_call_gradients(PyObject *capsule, const at::Tensor &x, const at::Tensor &y,
                        const at::Tensor &w);
// A launch lane's (grads.cpp): the hidden state's on x's node, the output's on y's, the
// gradient through the norm's on the norm's own nodes (found as GradHooks' through_nodes
// finds them, walking at most max_nodes): 0, or -1 with an error
int hook_launch_gradients(PyObject *capsule, const at::Tensor &x, const at::Tensor &y);
extern int64_t max_nodes;  // contract.MAX_NODES (set at setup)
// A compiled gradient on a measured step, from the layer's gradient capsule `capsule`
// (gradreads.cpp): g at `site`, with the norm's input x and weight w (or undefined): 1 read,
// 0 not the plain case (Python's), -1 an error
int compiled_gradient(PyObject *capsule, int site, const at::Tensor &g, const at::Tensor &x,
                      const at::Tensor &w);

// The C readers' entry points (native_rows.c), set at setup
using RowsFn = int (*)(const void *, const void *, float *, const int64_t *);
using ThroughFn = int (*)(const float *, const float *, const float *, float *, float *,
                          const int64_t *, double);
extern RowsFn rows_planned, grad_rows_planned;
extern ThroughFn through;

// Whether Dynamo compiles the Python frames run now (an eager stretch of a compiled
// function, after a graph break): 1, 0, or -1 an error
int compiling_frames();
// setup(names (contract.NAMES), addresses of normwatch_rows_planned,
// normwatch_grad_rows_planned, normwatch_through, torch._C._dynamo.eval_frame.
// get_eval_frame_callback, contract.MAX_NODES): the module's, once
PyObject *setup(PyObject *, PyObject *args);

}  // namespace normwatch

extern PyMethodDef normwatch_grads_methods[];    // grads.cpp's
extern PyMethodDef normwatch_sampler_methods[];  // sampler.cpp's
