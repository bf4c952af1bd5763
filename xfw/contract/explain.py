"""``--explain FILE``: where one training step goes, per module and per kind of work, the same way
for every adapter. The adapter gives its session and its framework's hooks (:class:`Hooks`); this
module drives the steps, turns the hooks' clock readings into per-module times and reads the
framework profiler's Chrome trace into categories::

    python -m xfw_torch --explain run/explain.json --spec run/spec.json
    # run/explain.json  {"modules": {name: {"fwd_s", "bwd_s", "recompute_s"}}, "categories": {...},
    #                    "profiled_step_s", "plain_step_s", "trace": "trace.json", ...}
    # run/trace.json    the framework profiler's own Chrome trace of the profiled steps

Module names are canonical (the parity probe's): a module that owns parameters under its own
canonical name; a module that only holds such modules (an attention block, a decoder layer) under
the longest dotted prefix its parameter-owning modules share, so both frameworks' containers meet
under one name. Each row's time is *self* time: a span of the step belongs to the innermost module
running it (forward: the call stack; backward: the innermost open interval between a module's output
gradient arriving and its input and parameter gradients being done). Spans outside every module go
to ``loss`` (from the model's output to its first gradient: the loss, forward and backward) and
``(autograd, outside modules)``; the optimizer step is its own row. A child whose output is its parent's (an
output projection) keeps its own backward: the parent's interval begins with its child's, and at one start the
inner interval is the innermost. A forward hook that fires
during backward is recompute: its time counts in that module's backward and in ``recompute_s``.

It runs after the measured window, in its own process (``xfw.run.explain``): never inside a
measurement.
"""

from __future__ import annotations

import json
import re
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from xfw.contract.atomic import write_json_atomic

LOSS, OUTSIDE, OPTIMIZER = "loss", "(autograd, outside modules)", "optimizer"
CATEGORIES = ("matmul", "convolution", "attention", "normalisation", "elementwise/activation", "loss", "optimizer",
              "communication", "copies", "other")
"""Kinds of work, by what an operation does (never by what its kernel is called), the same on both sides."""
_CATEGORY_WORDS = (  # first match wins; on the name lower-cased, backward nodes read as their forward op
    ("communication", ("nccl", "gloo", "c10d::", "record_param_comms", "all_reduce", "allreduce", "all_gather",
                       "allgather", "reduce_scatter", "reducescatter", "alltoall", "all_to_all", "c_broadcast",
                       "c_allreduce", "c_allgather", "c_reducescatter", "send_v2", "recv_v2", "barrier")),
    ("optimizer", ("adam", "_foreach", "multi_tensor", "sgd", "lamb", "vector_norm", "squared_l2_norm")),
    ("loss", ("cross_entropy", "crossentropy", "log_softmax", "logsoftmax", "nll_loss", "nllloss", "mse_loss",
              "mseloss", "l1_loss", "smooth_l1", "huber")),
    ("attention", ("attention", "sdpa", "flash", "softmax", "fmha", "memory_efficient")),
    ("convolution", ("conv1d", "conv2d", "conv3d", "convolution", "conv_transpose", "depthwise_conv")),
    ("matmul", ("matmul", "addmm", "bmm", "linear", "gemm", "einsum", "baddbmm", "fused_gemm")),
    ("normalisation", ("layer_norm", "layernorm", "rms_norm", "rmsnorm", "group_norm", "groupnorm", "batch_norm",
                       "batchnorm", "native_norm", "_norm")),
    ("elementwise/activation", ("gelu", "silu", "swiglu", "geglu", "glu", "relu", "tanh", "sigmoid", "softplus",
                                "swish", "mish", "erf", "dropout")),
    ("copies", ("copy", "_to_copy", "contiguous", "memcpy", "cast", "clone", "concat", "stack", "transpose",
                "permute", "index", "gather", "scatter", "embedding", "lookup_table", "slice", "split", "pad",
                "expand", "tile", "where", "roll", "flip", "repeat", "chunk", "unbind", "masked_select", "nonzero",
                "assign", "share_data", "unfold", "interpolate", "upsample", "nearest", "bilinear")),
    ("elementwise/activation", ("add", "mul", "sub", "div", "exp", "pow", "sqrt", "rsqrt", "neg", "mean", "sum",
                                "fill", "zero", "full", "ones", "scale", "sin", "cos", "clamp", "clip", "max", "min",
                                "log", "abs", "lerp", "square", "reciprocal", "sign", "floor", "ceil", "round",
                                "maximum", "minimum", "logical", "equal", "greater", "less", "not_equal", "bitwise",
                                "arange", "linspace", "cumsum", "rand", "uniform", "gaussian", "normal", "bernoulli",
                                "triu", "tril", "accumulategrad", "accumulation", "increment")),
)
_EXACT = {  # whole (normalised) names: too short to look for inside others
    "mm": "matmul", "mv": "matmul", "dot": "matmul", "t": "copies", "to": "copies", "view": "copies",
    "reshape": "copies", "_reshape_alias": "copies", "as_strided": "copies", "unsqueeze": "copies",
    "squeeze": "copies", "flatten": "copies", "unflatten": "copies", "narrow": "copies", "select": "copies",
    "detach": "copies", "alias": "copies", "_unsafe_view": "copies", "unsafe_view": "copies", "cat": "copies", "empty": "copies", "empty_like": "copies",
    "empty_strided": "copies", "resize_": "copies", "item": "copies", "_local_scalar_dense": "copies",
    "lift_fresh": "copies", "numel": "copies", "transdata": "copies", "reshape2": "copies", "eq": "elementwise/activation",
    "ne": "elementwise/activation", "gt": "elementwise/activation", "lt": "elementwise/activation",
    "ge": "elementwise/activation", "le": "elementwise/activation", "any": "elementwise/activation",
    "all": "elementwise/activation", "masked_fill": "copies", "masked_fill_": "copies", "where": "copies",
}
_MATMULS = ("matmul", "bmm", "baddbmm", "mm")
"""A product of two activations (both operands with a batch of matrices: rank 3 or more) is attention's QK or PV,
whatever the kernel is called; a product with a weight (rank 2) is a matmul."""


def normalise(name: str) -> str:
    """An operator's name as the category words read it: lower-case, without the profiler's wrappers
    (``autograd::engine::evaluate_function:``, ``aten::``, Paddle's ``Global_``/``Local_``, `` dygraph``,
    `` kernel launch``) and with a backward node read as its forward operation (``AddmmBackward0`` is
    ``addmm``, ``Global_MatmulGradNode`` is ``matmul``, ``conv2d_grad`` is ``conv2d``)."""
    name = re.sub(r"\[[\d.]+ [mun]?s\]$", "", name).strip()
    name = re.sub(r"^autograd::engine::evaluate_function:\s*", "", name)
    name = re.sub(r"^(Global_|Local_)", "", name)
    name = re.sub(r" (dygraph|pybind_imperative_func|pybind_patch_func|kernel launch|compute|infer_meta|"
                  r"node_creation)$", "", name)
    back = re.fullmatch(r"(?:torch::autograd::)?([A-Za-z0-9]+?)(?:Backward\d*|GradNode(?:Final|Compat)?)", name)
    if back:  # CamelCase forward op of a backward node: AddmmBackward0 -> addmm, NativeLayerNorm -> native_layer_norm
        name = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", back.group(1))
    name = name.lower()
    name = re.sub(r"^__r?([a-z_]+?)__.*$", r"\1", name)  # Paddle's patched operators: __mul__, __radd__
    name = re.sub(r"^(aten|c10d_functional|_c_ops|torch_ipex)::", "", name)
    return re.sub(r"(_grad|_double_grad|_backward(_data|_input|_weight)?)$", "", name)


def category_of(name: str, shapes: list | None = None) -> str:
    """The category of one operator by what it does; ``shapes``: its inputs' shapes when the trace has
    them (a product of two batched activations is attention)."""
    low = normalise(name)
    found = _EXACT.get(low)
    if found is None:
        found = next((c for c, words in _CATEGORY_WORDS if any(w in low for w in words)), "other")
    if found == "matmul" and shapes and low in _MATMULS:
        ranks = [len(s) for s in shapes if isinstance(s, (list, tuple))]
        if len(ranks) >= 2 and min(ranks[:2]) >= 3:
            return "attention"
    return found


def category_rules() -> str:
    """The category map as text (``xfw explain --categories``)."""
    lines = ["Each profiled operator counts in one category, by what it does. An operator inside another that has a "
             "category (aten::linear's transpose and addmm, a backward node's own operators, everything inside "
             "scaled_dot_product_attention or the optimizer's step) counts in its outermost one. Backward nodes "
             "read as their forward operation (AddmmBackward0 as addmm, MatmulGradNode as matmul). A matrix "
             "product of two batched activations (both operands rank 3 or more: QK and PV) is attention.", ""]
    for category, words in _CATEGORY_WORDS:
        lines.append(f"{category}: names containing " + ", ".join(words))
    exact: dict[str, list[str]] = {}
    for name, category in _EXACT.items():
        exact.setdefault(category, []).append(name)
    for category, names in exact.items():
        lines.append(f"{category}: names equal to " + ", ".join(names))
    lines.append("other: everything else (the operators behind it: trace.json's xfwCategories, explain.json's "
                 "category_ops)")
    return "\n".join(lines)


def scope_names(modules: dict[str, str | None]) -> dict[str, str]:
    """Module path -> the name its row goes under: its canonical name when it owns parameters (the
    value), else the longest dotted prefix its parameter-owning descendants' canonical names share
    (paths without any are left out)."""
    prefix: dict[str, list[str]] = {}
    for path, canonical in modules.items():
        if canonical is None:
            continue
        parts = canonical.split(".") if canonical else []
        segments = path.split(".") if path else []
        for a in (".".join(segments[:k]) for k in range(len(segments))):
            if a in modules and modules[a] is None:
                have = prefix.get(a)
                prefix[a] = parts if have is None else have[:_shared(have, parts)]
    out = {p: c for p, c in modules.items() if c is not None}
    out.update({p: ".".join(parts) for p, parts in prefix.items()})
    return out


def _shared(a: list[str], b: list[str]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@dataclass
class Timeline:
    """Clock readings from the hooks of the profiled steps; :meth:`attribute` turns them into rows."""

    clock: Callable[[], float] = time.perf_counter
    events: list[tuple] = field(default_factory=list)
    calls: list[dict] = field(default_factory=list)
    stack: list[int] = field(default_factory=list)
    in_forward: bool = False

    # forward (and recompute): a module call enters and exits
    def enter(self, name: str, root: bool = False) -> int:
        t = self.clock()
        if root:
            self.in_forward = True
        call = len(self.calls)
        self.calls.append({"name": name, "parent": self.stack[-1] if self.stack else None, "start": None, "end": None,
                           "recompute": not self.in_forward})
        self.stack.append(call)
        self.events.append((t, "enter", call))
        return call

    def exit(self, call: int, root: bool = False) -> None:
        self.events.append((self.clock(), "exit", call))
        if self.stack and self.stack[-1] == call:
            self.stack.pop()
        if root:
            self.in_forward = False

    # backward: a call's output gradient arrives (start) / an input or parameter gradient is done (end)
    def grad_in(self, call: int) -> None:
        t = self.clock()
        c = self.calls[call]
        c["start"] = t if c["start"] is None else min(c["start"], t)

    def grad_out(self, call: int) -> None:
        t = self.clock()
        c = self.calls[call]
        c["end"] = t if c["end"] is None else max(c["end"], t)

    def mark(self, what: str) -> None:
        """``step``, ``optimizer`` (the optimizer step begins) or ``end`` (the step is over)."""
        self.events.append((self.clock(), what, None))

    def attribute(self) -> tuple[dict[str, dict[str, float]], float]:
        """({row name: {"fwd_s", "bwd_s", "recompute_s"}}, step seconds) of the median step (``step`` to
        ``end`` marks, by its length): an outlier step does not decide the table, and its rows add up to
        it. (Per-row medians would not: a span that one step gives to a module's interval and another to
        its neighbour's drops out of both, a quarter of the step on a loaded host; :meth:`attribute_steps`
        gives every step's rows, for each row's spread.)"""
        per_step, spans = self.attribute_steps()
        if not spans:
            return {}, 0.0
        middle = sorted(range(len(spans)), key=spans.__getitem__)[(len(spans) - 1) // 2]
        return per_step[middle], spans[middle]

    def attribute_steps(self) -> tuple[list[dict[str, dict[str, float]]], list[float]]:
        """Every hooked step's rows and its length, in order (([], []) when the marks do not pair up)."""
        per_step: list[dict[str, dict[str, float]]] = []  # each step's rows

        def add(name: str, key: str, seconds: float) -> None:
            row = per_step[-1].setdefault(name, {"fwd_s": 0.0, "bwd_s": 0.0, "recompute_s": 0.0})
            row[key] += seconds

        children: dict[int, list[int]] = {}
        for i, c in enumerate(self.calls):
            if c["parent"] is not None:
                children.setdefault(c["parent"], []).append(i)
        depth = [0] * len(self.calls)
        for i, c in enumerate(self.calls):
            depth[i] = 0 if c["parent"] is None else depth[c["parent"]] + 1
        for i in reversed(range(len(self.calls))):  # a parent's backward spans its children's
            c = self.calls[i]
            for k in children.get(i, ()):
                kid = self.calls[k]
                # A child's output gradient cannot arrive before its parent's, unless the child's output is the
                # parent's (an output projection, the LM head): their hooks fire in turn on the same tensor, the
                # parent's last, and the parent's interval would take the child's backward.
                if kid["start"] is not None and (c["start"] is None or kid["start"] < c["start"]):
                    c["start"] = kid["start"]
                if kid["end"] is not None and (c["end"] is None or kid["end"] > c["end"]):
                    c["end"] = kid["end"]
        # in order of their start, and at one start the outer before the inner: the inner is the innermost open
        intervals = sorted((c["start"], depth[i], c["end"] if c["end"] is not None else c["start"], i)
                           for i, c in enumerate(self.calls) if c["start"] is not None and not c["recompute"])
        intervals = [(s, e, i) for s, _, e, i in intervals]
        bounds = sorted({t for t, _, _ in self.events} | {t for iv in intervals for t in iv[:2]})
        stack: list[int] = []
        active: list[tuple] = []  # backward intervals begun, in order of their start
        phase, seen_grad, nxt = "idle", False, 0
        marks = sorted((t, kind) for t, kind, _ in self.events if kind in ("step", "end"))
        spans = [b - a for (a, k1), (b, k2) in zip(marks, marks[1:]) if k1 == "step" and k2 == "end"]
        events = sorted(self.events, key=lambda e: e[0])
        e = 0
        for t0, t1 in zip(bounds, bounds[1:]):
            while e < len(events) and events[e][0] <= t0:
                _, kind, call = events[e]
                e += 1
                if kind == "enter":
                    if self.calls[call]["parent"] is None and not self.calls[call]["recompute"]:
                        stack, phase, seen_grad = [], "forward", False  # a recompute left unclosed ends here
                    stack.append(call)
                elif kind == "exit":
                    if call in stack:
                        stack.remove(call)
                    if not stack and phase == "forward":
                        phase = "after"
                elif kind == "step":
                    phase = "idle"
                    per_step.append({})
                elif kind in ("optimizer", "end"):
                    phase = "optimizer" if kind == "optimizer" else "idle"
            while nxt < len(intervals) and intervals[nxt][0] <= t0:
                active.append(intervals[nxt])
                nxt += 1
            active = [iv for iv in active if iv[1] >= t1]
            span = t1 - t0
            if phase == "forward" and stack:
                add(self.calls[stack[-1]]["name"], "fwd_s", span)
            elif phase == "after" and stack:  # recompute: a forward inside backward
                add(self.calls[stack[-1]]["name"], "bwd_s", span)
                add(self.calls[stack[-1]]["name"], "recompute_s", span)
            elif phase == "after" and active:
                seen_grad = True
                add(self.calls[active[-1][2]]["name"], "bwd_s", span)
            elif phase == "after":
                add(OUTSIDE if seen_grad else LOSS, "bwd_s", span)
            elif phase == "optimizer":
                add(OPTIMIZER, "bwd_s", span)
        if not spans or len(spans) != len(per_step):
            return [], []
        return per_step, spans


def _shapes(event: dict) -> list | None:
    """An operator's input shapes when the profiler recorded them (PyTorch's ``Input Dims``, Paddle's
    ``input_shapes``: ``{name: [shape, ...]}``)."""
    args = event.get("args") or {}
    dims = args.get("Input Dims")
    if isinstance(dims, list):
        return dims
    named = args.get("input_shapes")
    if isinstance(named, dict) and named:
        return [shape for shapes in named.values() if isinstance(shapes, list) for shape in shapes[:1]]
    return None


ATTENTION_LAYERS = re.compile(r"attention|attn", re.I)
"""A layer (module) whose own matrix products are attention's QK and PV (its projections are layers of their own)."""


def _outermost(ops: list[dict]) -> list[tuple[dict, dict | None]]:
    """(event, its outermost enclosing event of another operation or None), ops of one thread in order."""
    out, open_ = [], []
    for e in sorted(ops, key=lambda e: (e["ts"], -e["dur"])):
        while open_ and e["ts"] >= open_[-1]["ts"] + open_[-1]["dur"]:
            open_.pop()
        outer = next((o for o in open_ if category_of(_name(o)) != "other"), None)
        out.append((e, outer))
        open_.append(e)
    return out


def _attention_products(ops: list[dict], layers: list[dict]) -> set[int]:
    """ids of the matmul events (forward and their gradient nodes) that are attention's own products, where
    the trace has no shapes but has each layer's forward (Paddle's ``Forward`` events): a forward matmul
    whose innermost layer is an attention layer; its gradient node the one in the same position from the end
    of the next backward (backward runs the products in reverse; counts that differ pair nothing)."""
    found: set[int] = set()
    layers = sorted(layers, key=lambda e: (e["ts"], -e["dur"]))
    forward: list[tuple[dict, bool]] = []
    backward: list[dict] = []
    in_backward_until = -1.0
    stack, nxt = [], 0

    def settle() -> None:
        if backward and len(backward) == len(forward):
            for node, (_, attn) in zip(backward, reversed(forward)):
                if attn:
                    found.add(id(node))
        forward.clear()
        backward.clear()

    for e, outer in _outermost(ops):
        if outer is not None or normalise(_name(e)) != "matmul":
            if outer is None and normalise(_name(e)) == "backward":
                settle() if backward else None
                in_backward_until = e["ts"] + e["dur"]
            continue
        if e["ts"] < in_backward_until:
            backward.append(e)
            continue
        if backward:
            settle()
        while nxt < len(layers) and layers[nxt]["ts"] <= e["ts"]:
            stack.append(layers[nxt])
            nxt += 1
        stack = [x for x in stack if x["ts"] + x["dur"] > e["ts"]]
        attn = bool(stack) and bool(ATTENTION_LAYERS.search(_name(stack[-1])))
        if attn:
            found.add(id(e))
        forward.append((e, attn))
    settle()
    return found


def trace_categories(path: str, *, op_cats: tuple[str, ...], optimizer_marks: tuple[str, ...],
                     kernel_cats: tuple[str, ...] = (), layer_cats: tuple[str, ...] = (),
                     annotate: bool = True) -> dict[str, float]:
    """Seconds per category in a Chrome trace: device kernels (``kernel_cats``) when it has any,
    else the host operators' self time (``op_cats``, nesting removed per thread), each operator in the
    category of its outermost enclosing operator that has one (:func:`category_rules`; ``layer_cats``: the
    trace's layer-forward events, for attention's products without shapes); an operator inside
    an event whose name starts with one of ``optimizer_marks`` counts as optimizer. ``annotate``: the
    trace is written back with each counted event's category in its ``args`` ("xfw category") and the
    operators behind each category (``xfwCategories``: {category: {operator: seconds}}), read back by
    :func:`category_ops`."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    all_events = data["traceEvents"] if isinstance(data, dict) else data
    events = [e for e in all_events if e.get("ph") == "X" and isinstance(e.get("dur"), (int, float))]
    out = dict.fromkeys(CATEGORIES, 0.0)
    ops: dict[str, dict[str, float]] = {c: {} for c in CATEGORIES}

    def count(e: dict, category: str, seconds: float) -> None:
        out[category] += seconds
        name = normalise(_name(e))
        ops[category][name] = ops[category].get(name, 0.0) + seconds
        e.setdefault("args", {})["xfw category"] = category

    kernels = [e for e in events if e.get("cat") in kernel_cats]
    if kernels:
        for e in kernels:
            count(e, category_of(_name(e)), e["dur"] * 1e-6)
    else:
        optimizer_spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                                 if _name(e).startswith(optimizer_marks))
        by_thread: dict[Any, list[dict]] = {}
        for e in events:
            if e.get("cat") in op_cats:
                by_thread.setdefault(e.get("tid"), []).append(e)
        layers = [e for e in events if e.get("cat") in layer_cats]
        attention = set()
        if layers:
            for thread_ops in by_thread.values():
                attention |= _attention_products(thread_ops, layers)
        for thread_ops in by_thread.values():
            thread_ops.sort(key=lambda e: (e["ts"], -e["dur"]))
            open_: list[list] = []  # [end, event, child time, category it counts in]
            for e in thread_ops + [None]:
                while open_ and (e is None or e["ts"] >= open_[-1][0]):
                    end, op, inner, category = open_.pop()
                    in_opt = any(a <= op["ts"] < b for a, b in optimizer_spans)
                    count(op, "optimizer" if in_opt else category, max(op["dur"] - inner, 0.0) * 1e-6)
                    if open_:
                        open_[-1][2] += op["dur"]
                if e is not None:
                    outer = next((o[3] for o in open_ if o[3] != "other"), None)
                    own = "attention" if id(e) in attention else category_of(_name(e), _shapes(e))
                    open_.append([e["ts"] + e["dur"], e, 0.0, outer or own])
    if annotate:
        if isinstance(data, dict):
            data["xfwCategories"] = {c: dict(sorted(v.items(), key=lambda kv: -kv[1])) for c, v in ops.items() if v}
        write_json_atomic(path, data)
    return out


def category_ops(path: str, top: int = 8) -> dict[str, dict[str, float]]:
    """The operators behind each category in an annotated trace (:func:`trace_categories`), the ``top``
    largest per category (seconds over the profiled steps); {} for a trace without them."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    found = data.get("xfwCategories") if isinstance(data, dict) else None
    if not isinstance(found, dict):
        return {}
    return {c: dict(list(v.items())[:top]) for c, v in found.items() if isinstance(v, dict)}


def _name(event: dict) -> str:
    return re.sub(r"\[[\d.]+ [mun]?s\]$", "", str(event.get("name", "")))


class Hooks(Protocol):
    """What an adapter gives :func:`run_explain` (its framework's hooks and profiler)."""

    def install(self, timeline: Timeline) -> Callable[[], None]:
        """Module hooks (forward enter/exit, gradient arrivals) reporting to ``timeline``; returns
        their remover."""
    def profile(self, run: Callable[[], None], steps: int, trace_path: str) -> dict[str, float]:
        """``run`` ``steps`` times under the framework's profiler, its Chrome trace written to
        ``trace_path``; returns seconds per category (:func:`trace_categories`) over those steps."""


EXPLAIN_STEPS = 7
"""Steps of each kind (plain, hooked, profiled): every row gets a median and an interquartile range."""


def refuse_many(spec: dict) -> None:
    """Explain profiles one process: a spec that runs several is refused before anything is built."""
    from xfw.contract.harness import Unsupported

    n = spec.get("derived", {}).get("num_processes", 1)
    if n != 1:
        raise Unsupported(f"explain profiles one process; this run used {n} (its step breakdown is in steps.jsonl)")


def ran_with(spec: dict, first_hashes: list[str]) -> dict:
    """What this explain process runs: its interpreter, the backend's variables (``backends.<name>.env``)
    and the thread variables as this process sees them, the knobs and the data it trains on. The report
    holds it against the measured run's."""
    import os
    import sys

    names = sorted(set(spec.get("backend_env", {})) | {"OMP_NUM_THREADS", "MKL_NUM_THREADS"})
    return {"interpreter": sys.executable, "env": {k: os.environ.get(k) for k in names},
            "cpu_threads": spec.get("measure", {}).get("cpu_threads"), "knobs": spec.get("backend_knobs", {}),
            "data": {k: spec.get("data", {}).get(k) for k in ("kind", "fingerprint")},
            "first_batch_hashes": first_hashes}


def run_explain(spec: dict, session: Any, hooks: Hooks, path: str, *, steps: int = EXPLAIN_STEPS) -> dict:
    """The spec's warm-up steps, then ``steps`` plain steps (timed, synchronised), ``steps`` steps
    under the module hooks and ``steps`` under the framework's profiler, each on the run's own
    batches in the run's order; ``path`` and its sibling ``trace.json`` written. One process."""
    from pathlib import Path

    from xfw.contract.harness import _Steps

    refuse_many(spec)
    state: dict = {"data": _Steps(spec, session), "step": 0, "hashes": []}

    def one(timeline: Timeline | None = None) -> None:
        try:
            micro_batches, described = state["data"].next(state["step"])
        except StopIteration:  # prepared data ran out: start over, as a new epoch would
            state["data"], state["step"] = _Steps(spec, session), 0
            micro_batches, described = state["data"].next(0)
        if state["step"] == 0 and not state["hashes"]:
            state["hashes"] = [d[3] for d in described]
        state["step"] += 1
        if timeline is not None:
            timeline.mark("step")
        if hasattr(session, "forward_backward"):
            session.forward_backward(micro_batches)
            if timeline is not None:
                timeline.mark("optimizer")
            session.optimizer_step()
        else:
            session.train_step(micro_batches)
        session.synchronize()
        if timeline is not None:
            timeline.mark("end")

    for _ in range(max(spec["measure"]["warmup_steps"], 1)):
        one()

    def timed(times: list[float]) -> Callable[[], None]:
        def run() -> None:
            t0 = time.perf_counter()
            one()
            times.append(time.perf_counter() - t0)
        return run

    plain: list[float] = []
    for _ in range(steps):
        timed(plain)()

    def clock() -> float:
        session.synchronize()
        return time.perf_counter()

    timeline = Timeline(clock=clock)
    remove = hooks.install(timeline)
    try:
        for _ in range(steps):
            one(timeline)
    finally:
        remove()
    per_step, spans = timeline.attribute_steps()
    rows, hooked = timeline.attribute()
    names = sorted({n for r in per_step for n in r})
    trace = Path(path).with_name("trace.json")
    profiled: list[float] = []
    categories = hooks.profile(timed(profiled), steps, str(trace))
    result = {
        "schema": 1, "backend": spec.get("backend", ""), "steps": steps, "plain_step_s": statistics.median(plain),
        "hooked_step_s": hooked, "profiler_step_s": statistics.median(profiled), "modules": rows,
        "plain_steps_s": plain, "hooked_steps_s": spans, "profiler_steps_s": profiled,
        "module_steps": {n: [[r[n]["fwd_s"], r[n]["bwd_s"]] if n in r else [0.0, 0.0] for r in per_step]
                         for n in names},  # each hooked step's [fwd_s, bwd_s] per row: its spread
        "categories": {k: v / steps for k, v in categories.items()}, "trace": trace.name,
        "category_ops": {c: {op: s / steps for op, s in v.items()} for c, v in category_ops(str(trace)).items()},
        "recompute": bool(spec.get("recompute")), "ran_with": ran_with(spec, state["hashes"]),
    }
    write_json_atomic(path, result)
    return result


def read_explain(path: str) -> dict:
    """An ``explain.json`` (ValueError when it is not one)."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict) or data.get("schema") != 1 or not isinstance(data.get("modules"), dict):
        raise ValueError(f"{path}: not an explain.json")
    return data
