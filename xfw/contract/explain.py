"""``--explain FILE``: where one training step goes, per module and per kind of work, the same way
for every adapter. The adapter gives its session and its framework's hooks (:class:`Hooks`); this
module drives the steps and turns the hooks' clock readings into per-module times; the framework
profiler's Chrome trace is read into categories by ``xfw.contract.explain_categories`` (re-exported here)::

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

It runs after the measured window, in its own process (``xfw.run.commands.explain``): never inside a
measurement.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from xfw.contract.atomic import write_json_atomic
from xfw.contract.explain_categories import (CATEGORIES, category_of, category_ops, category_rules,  # noqa: F401
                                             normalise, top_ops, trace_categories)

LOSS, OUTSIDE, OPTIMIZER = "loss", "(autograd, outside modules)", "optimizer"


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


class Hooks(Protocol):
    """What an adapter gives :func:`run_explain` (its framework's hooks and profiler)."""

    def install(self, timeline: Timeline) -> Callable[[], None]:
        """Module hooks (forward enter/exit, gradient arrivals) reporting to ``timeline``; returns
        their remover."""
    def profile(self, run: Callable[[], None], steps: int, trace_path: str) -> dict[str, float]:
        """``run`` ``steps`` times under the framework's profiler, its Chrome trace written to
        ``trace_path``; returns seconds per category over those steps (:func:`trace_categories`'s result, whose
        ``ops`` spare reading the trace back)."""


EXPLAIN_STEPS = 7
"""Steps of each kind (plain, hooked, profiled): every row gets a median and an interquartile range."""
MIN_EXPLAIN_STEPS = 3
"""The fewest steps of each kind: a median that one stalled step cannot decide."""


def explain_steps(spec: dict) -> int:
    """Steps of each kind for this run: :data:`EXPLAIN_STEPS`, or the run's own ``measure.steps`` when it
    measured fewer (a run cut short to look quickly is explained as quickly), never under
    :data:`MIN_EXPLAIN_STEPS`."""
    measured = spec.get("measure", {}).get("steps")
    if not isinstance(measured, int) or isinstance(measured, bool):
        return EXPLAIN_STEPS
    return max(MIN_EXPLAIN_STEPS, min(EXPLAIN_STEPS, measured))


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


def run_explain(spec: dict, session: Any, hooks: Hooks, path: str, *, steps: int | None = None) -> dict:
    """The spec's warm-up steps, then ``steps`` plain steps (timed, synchronised), ``steps`` steps
    under the module hooks and ``steps`` under the framework's profiler (default :func:`explain_steps`),
    each on the run's own batches in the run's order; ``path`` and its sibling ``trace.json`` written.
    One process."""
    from pathlib import Path

    from xfw.contract.stepping import Steps

    refuse_many(spec)
    steps = explain_steps(spec) if steps is None else steps
    state: dict = {"data": Steps(spec, session), "step": 0, "hashes": []}

    def one(timeline: Timeline | None = None) -> None:
        try:
            micro_batches, described = state["data"].next(state["step"])
        except StopIteration:  # prepared data ran out: start over, as a new epoch would
            state["data"], state["step"] = Steps(spec, session), 0
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
    ops = top_ops(categories.ops) if hasattr(categories, "ops") else category_ops(str(trace))  # read once
    result = {
        "schema": 1, "backend": spec.get("backend", ""), "steps": steps, "plain_step_s": statistics.median(plain),
        "hooked_step_s": hooked, "profiler_step_s": statistics.median(profiled), "modules": rows,
        "plain_steps_s": plain, "hooked_steps_s": spans, "profiler_steps_s": profiled,
        "module_steps": {n: [[r[n]["fwd_s"], r[n]["bwd_s"]] if n in r else [0.0, 0.0] for r in per_step]
                         for n in names},  # each hooked step's [fwd_s, bwd_s] per row: its spread
        "categories": {k: v / steps for k, v in categories.items()}, "trace": trace.name,
        "category_ops": {c: {op: s / steps for op, s in v.items()} for c, v in ops.items()},
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
