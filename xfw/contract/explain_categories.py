"""Explain's category map and trace reading: each profiled operator in one kind of work, by what it does (never by
what its kernel is called), the same on both sides; a framework profiler's Chrome trace read into seconds per
category (host operators' self time, or device kernels), written back with each counted event's category::

    category_of("AddmmBackward0")                     # "matmul"
    trace_categories("run/trace.json", op_cats=("cpu_op",), optimizer_marks=("Optimizer.step",))
    print(category_rules())                           # xfw explain --categories

Used by ``xfw.contract.explain`` (which drives the steps) and each adapter's explain hooks.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from xfw.contract.atomic import write_json_atomic

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


@functools.lru_cache(maxsize=None)  # a trace names a few hundred operators in tens of thousands of events
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
    found = _by_name(low)
    if found == "matmul" and shapes and low in _MATMULS:
        ranks = [len(s) for s in shapes if isinstance(s, (list, tuple))]
        if len(ranks) >= 2 and min(ranks[:2]) >= 3:
            return "attention"
    return found


@functools.lru_cache(maxsize=None)
def _by_name(low: str) -> str:
    """A normalised name's category by its words (the shapes aside)."""
    if low in _EXACT:
        return _EXACT[low]
    return next((c for c, words in _CATEGORY_WORDS if any(w in low for w in words)), "other")


def category_rules() -> str:
    """The category map as text (``xfw explain --categories``)."""
    lines = ["Each profiled operator counts in one category, by what it does. An operator inside another that has a "
             "category (aten::linear's transpose and addmm, a backward node's own operators, everything inside "
             "scaled_dot_product_attention or the optimizer's step) counts in its outermost one. Backward nodes "
             "read as their forward operation (AddmmBackward0 as addmm, MatmulGradNode as matmul). A matrix "
             "product of two batched activations (both operands rank 3 or more: QK and PV) is attention; in a trace "
             "without shapes (Paddle's), a product whose innermost layer is an attention layer, and its gradient "
             "node. An operator that ends inside a loss an adapter marked (the events 'xfw loss', 'xfw loss "
             "backward begins' / 'ends': Paddle's mse_loss, written as subtract, square and mean) is loss.", ""]
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
    of the next backward (backward runs the products in reverse; counts that differ pair nothing). Only the
    forward products that made a gradient node (a ``node_creation`` event inside them, where the trace has any)
    are paired: a frozen tower's products, or any product run without gradients, have none in backward."""
    import bisect

    found: set[int] = set()
    creations = sorted(o["ts"] for o in ops if _name(o).endswith(" node_creation"))

    def made_a_node(e: dict) -> bool:
        if not creations:
            return True
        k = bisect.bisect_left(creations, e["ts"])
        return k < len(creations) and creations[k] <= e["ts"] + e["dur"]

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
        if made_a_node(e):
            forward.append((e, attn))
    settle()
    return found


LOSS_MARK = "xfw loss"
"""A user event an adapter puts around a loss its framework computes as separate elementwise operators (Paddle's
``mse_loss``: subtract, square, mean), and two instant markers (:data:`LOSS_BACKWARD_BEGINS`, ``..._ENDS``) its
gradient hooks put where that loss's backward begins and ends: every operator that ends inside one of these spans
(on the same thread) is the loss, as PyTorch's one ``aten::mse_loss`` and its ``MseLossBackward0`` are."""
LOSS_BACKWARD_BEGINS, LOSS_BACKWARD_ENDS = f"{LOSS_MARK} backward begins", f"{LOSS_MARK} backward ends"


def _thread(event: dict) -> str:
    """The thread an event ran on (Paddle names one thread ``6047(Python)`` and ``6047(C++)``)."""
    tid = str(event.get("tid", ""))
    found = re.match(r"\d+", tid)
    return found.group(0) if found else tid


def loss_spans(events: list[dict]) -> dict[str, list[tuple[float, float]]]:
    """{thread: [(start, end) of a loss's forward or backward]} from :data:`LOSS_MARK`'s events."""
    spans: dict[str, list[tuple[float, float]]] = {}
    begun: dict[str, float] = {}
    for e in sorted(events, key=lambda e: e["ts"]):
        name, thread = _name(e), _thread(e)
        if name == LOSS_MARK:
            spans.setdefault(thread, []).append((e["ts"], e["ts"] + e["dur"]))
        elif name == LOSS_BACKWARD_BEGINS:
            begun.setdefault(thread, e["ts"])
        elif name == LOSS_BACKWARD_ENDS and thread in begun:
            spans.setdefault(thread, []).append((begun.pop(thread), e["ts"]))
    return spans


class CategorySeconds(dict):
    """Seconds per category (:func:`trace_categories`), with ``ops``: {category: {operator: seconds}}, all of
    them, largest first (what the annotated trace's ``xfwCategories`` holds), so the caller need not read the
    trace back."""

    def __init__(self, seconds: dict[str, float], ops: dict[str, dict[str, float]]):
        super().__init__(seconds)
        self.ops = ops


def trace_categories(path: str, *, op_cats: tuple[str, ...], optimizer_marks: tuple[str, ...],
                     kernel_cats: tuple[str, ...] = (), layer_cats: tuple[str, ...] = (),
                     annotate: bool = True) -> CategorySeconds:
    """Seconds per category in a Chrome trace: device kernels (``kernel_cats``) when it has any,
    else the host operators' self time (``op_cats``, nesting removed per thread), each operator in the
    category of its outermost enclosing operator that has one (:func:`category_rules`; ``layer_cats``: the
    trace's layer-forward events, for attention's products without shapes); an operator inside
    an event whose name starts with one of ``optimizer_marks`` counts as optimizer, one that ends inside a loss's
    span (:data:`LOSS_MARK`) as loss. ``annotate``: the
    trace is written back with each counted event's category in its ``args`` ("xfw category") and the
    operators behind each category (``xfwCategories``: {category: {operator: seconds}}), read back by
    :func:`category_ops` (and returned as the result's ``ops``). Written compact: tens of MB indented took
    seconds to write, and no viewer needs the indentation."""
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
        losses = loss_spans(events)
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
                    end = e["ts"] + e["dur"]
                    in_loss = any(a <= end <= b for a, b in losses.get(_thread(e), ()))
                    own = "loss" if in_loss else "attention" if id(e) in attention else category_of(_name(e), _shapes(e))
                    open_.append([e["ts"] + e["dur"], e, 0.0, outer or own])
    behind = {c: dict(sorted(v.items(), key=lambda kv: -kv[1])) for c, v in ops.items() if v}
    if annotate:
        if isinstance(data, dict):
            data["xfwCategories"] = behind
        write_json_atomic(path, data, compact=True)
    return CategorySeconds(out, behind)


def top_ops(ops: dict[str, dict[str, float]], top: int = 8) -> dict[str, dict[str, float]]:
    """The ``top`` largest operators per category of ``ops`` (largest first: :class:`CategorySeconds`'s)."""
    return {c: dict(list(v.items())[:top]) for c, v in ops.items() if isinstance(v, dict)}


def category_ops(path: str, top: int = 8) -> dict[str, dict[str, float]]:
    """The operators behind each category in an annotated trace (:func:`trace_categories`), the ``top``
    largest per category (seconds over the profiled steps); {} for a trace without them."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    found = data.get("xfwCategories") if isinstance(data, dict) else None
    return top_ops(found, top) if isinstance(found, dict) else {}


def _name(event: dict) -> str:
    return re.sub(r"\[[\d.]+ [mun]?s\]$", "", str(event.get("name", "")))
