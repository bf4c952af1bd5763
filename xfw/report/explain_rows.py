"""Explain's rows: one side's ``explain.json`` (or several, one per ``--repeat`` run) as rows under canonical
module names, and two sides' rows aligned, each difference with its noise::

    side = combine_runs([read_explain(p) for p in paths])   # one per repeat of the measured run
    rows = aligned(side_a, side_b, ("paddle", "torch"))     # findings first, largest difference first

A row's figure is the median of its per-run medians (each run's median over its hooked steps of fwd + bwd), and
the fwd / bwd shown beside it are that median step's, so they add up to it (:func:`median_index`); its spread is the
interquartile range of its hooked steps (one run) or the range (min–max) of its per-run medians (several runs), so
one run's host stall moves one run's median and cannot decide the row. The page around them is
``xfw.report.explain``.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

FLOOR = 0.01
"""A difference below this share of the slower side's hooked step is not ranked as a finding ("below the floor"):
on tiny models a hundred rows of microseconds each differ by a little (each operator's dispatch), beyond their
quartiles on a quiet host, and ranking them buries the rows that matter."""
_PEFT_PARTS = (".base_layer", ".lora_A", ".lora_B", ".lora_dropout")
ROOT = "(model, its own code)"
NOT_MODULES = ("loss", "(autograd, outside modules)", "optimizer")

TOP_LEVEL = ("", "model")
"""The model's own code, whichever class holds it: transformers splits it between the top class (``...For
ConditionalGeneration``: the head's call, the loss's) and its inner ``model`` (the image features' merge, the
positions), Paddle's families keep it in one top layer (canonically ``model`` when it holds only ``model.*``
parts, as Qwen2-VL's with a tied head, or ``""``). One row, so the same name is the same work."""


def _key(name: str) -> str:
    """One row per canonical module: peft's sub-layers folded into the layer they adapt (Paddle's LoRA
    layer is one layer), the top level (:data:`TOP_LEVEL`) under one readable name."""
    for part in _PEFT_PARTS:
        if part in name:
            name = name[:name.index(part)]
    return ROOT if name in TOP_LEVEL else name


def quartiles(values: list[float]) -> tuple[float, float, float]:
    """(p25, median, p75) of ``values``; one value is all three."""
    if not values:
        return 0.0, 0.0, 0.0
    if len(values) == 1:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def median_index(values: list[float]) -> int:
    """The index of the median of ``values`` (the lower middle of an even count: always one of them). A row's
    figure is its median step's fwd + bwd and its fwd / bwd are that step's, so the parts a page shows add up
    to the figure its difference is taken of (a median of fwd plus a median of bwd need not: a stall in
    forward in some steps and in backward in others puts both medians low and their steps' sums high)."""
    return sorted(range(len(values)), key=lambda k: (values[k], k))[(len(values) - 1) // 2]


def _median_of(values: list[float], fallback: float = 0.0) -> float:
    return statistics.median(values) if values else fallback


_STEP_KINDS = ("plain", "hooked", "profiler")


def combine_runs(explains: list[dict]) -> dict:
    """One side's explain.jsons, one per repeat of the measured run, as one: ``repeats`` keeps each (its rows
    are combined per row by :func:`module_rows`), each kind of step (plain, hooked, profiled) pooled
    (``<kind>_steps_s``) with its per-run medians (``<kind>_run_medians_s``) and their median as the figure
    (``<kind>_step_s``); categories the median over the runs; the first run's path, trace and operators.
    One explain.json is returned as it is (``runs`` 1)."""
    if len(explains) == 1:
        return explains[0] | {"runs": 1}
    first = explains[0]
    out = dict(first)
    out["repeats"], out["runs"], out["paths"] = list(explains), len(explains), [e.get("path") for e in explains]
    for kind in _STEP_KINDS:
        per_run = [e.get(f"{kind}_steps_s") or [e[f"{kind}_step_s"]] for e in explains]
        out[f"{kind}_steps_s"] = [x for steps in per_run for x in steps]
        out[f"{kind}_run_medians_s"] = [statistics.median(steps) for steps in per_run]
        out[f"{kind}_step_s"] = statistics.median(out[f"{kind}_run_medians_s"])
    out["steps"] = len(out["hooked_steps_s"])
    names = sorted({n for e in explains for n in e["modules"]})
    out["modules"] = {n: {k: _median_of([e["modules"].get(n, {}).get(k, 0.0) for e in explains])
                          for k in ("fwd_s", "bwd_s", "recompute_s")} for n in names}
    steps_names = sorted({n for e in explains for n in (e.get("module_steps") or {})})
    out["module_steps"] = {n: [] for n in steps_names}  # the names only: module_rows reads each run's steps
    cats = sorted({c for e in explains for c in e.get("categories", {})})
    out["categories"] = {c: _median_of([e.get("categories", {}).get(c, 0.0) for e in explains]) for c in cats}
    return out


def runs_of(explain: dict) -> list[dict]:
    """The explain.jsons a side rests on: each repeat's (:func:`combine_runs`), or the one."""
    return explain.get("repeats") or [explain]


def _one_run_rows(explain: dict, fold: dict[str, str]) -> dict[str, dict]:
    rows: dict[str, dict] = {}
    per_step = explain.get("module_steps") or {}
    key = lambda name: fold.get(_key(name), _key(name))  # noqa: E731
    for name, row in explain["modules"].items():
        mine = rows.setdefault(key(name), {"fwd_s": 0.0, "bwd_s": 0.0, "recompute_s": 0.0, "pairs": None})
        for k in ("fwd_s", "bwd_s", "recompute_s"):
            mine[k] += row.get(k, 0.0)
    for name, pairs in per_step.items():
        if not isinstance(pairs, list) or not pairs:
            continue
        mine = rows.setdefault(key(name), {"fwd_s": 0.0, "bwd_s": 0.0, "recompute_s": 0.0, "pairs": None})
        have = mine["pairs"] or [[0.0, 0.0] for _ in pairs]
        mine["pairs"] = [[h[0] + p[0], h[1] + p[1]] for h, p in zip(have, pairs)]
    for row in rows.values():
        pairs = row.pop("pairs") or [[row["fwd_s"], row["bwd_s"]]]
        row["steps"] = [f + b for f, b in pairs]
        row["fwd_med_s"], row["bwd_med_s"] = pairs[median_index(row["steps"])]
        row["run_medians"] = [row["fwd_med_s"] + row["bwd_med_s"]]
    return rows


def module_rows(explain: dict, fold: dict[str, str] | None = None) -> dict[str, dict]:
    """{row: {"fwd_s", "bwd_s", "recompute_s", "steps": [each hooked step's fwd + bwd, every run's],
    "run_medians": [each run's median of those], "fwd_med_s", "bwd_med_s", "runs", "run_steps"}}: per run,
    peft's parts and the top level folded into their rows and ``fold``'s rows (row -> the row it counts in,
    :func:`folds`) into theirs; over several runs each figure is the median of the per-run medians, a row a run
    does not have counting 0 there (it took no time in that run's hooked steps). An explain.json without
    per-step rows gives its one step."""
    fold = fold or {}
    runs = [_one_run_rows(e, fold) for e in runs_of(explain)]
    lengths = [len(e.get("hooked_steps_s") or [0]) for e in runs_of(explain)]
    if len(runs) == 1:
        return {n: r | {"runs": 1, "run_steps": len(r["steps"])} for n, r in runs[0].items()}
    out: dict[str, dict] = {}
    for name in sorted({n for r in runs for n in r}):
        have = [(r.get(name), n) for r, n in zip(runs, lengths)]
        steps = [x for row, n in have for x in (row["steps"] if row else [0.0] * n)]
        medians = [row["run_medians"][0] if row else 0.0 for row, _ in have]
        middle = have[median_index(medians)][0] or {}  # the median run: its median step's fwd / bwd
        out[name] = {
            **{k: _median_of([row[k] if row else 0.0 for row, _ in have]) for k in ("fwd_s", "bwd_s", "recompute_s")},
            "fwd_med_s": middle.get("fwd_med_s", 0.0), "bwd_med_s": middle.get("bwd_med_s", 0.0),
            "steps": steps, "run_medians": medians, "runs": len(runs), "run_steps": len(steps)}
    return out


def folds(a: dict, b: dict) -> dict[str, str]:
    """{module row one side only has: the closest enclosing row both sides have}: one framework's module is the
    other's functional code (CLIP's position embedding called in transformers, its weight added directly in
    Paddle's embeddings layer; CLIP's encoder called in transformers, its layers looped over by Paddle's vision
    model), so the enclosing row holds the same work on both sides only with it folded in. A row with no such
    enclosing row stays one-sided."""
    ka, kb = (set(map(_key, [*e["modules"], *(e.get("module_steps") or {})])) for e in (a, b))
    both, out = ka & kb, {}
    for name in sorted((ka ^ kb) - set(NOT_MODULES) - {ROOT}):
        parts = name.split(".")
        target = next((p for p in (".".join(parts[:k]) for k in range(len(parts) - 1, 0, -1)) if p in both),
                      ROOT if ROOT in both else None)
        if target is not None:
            out[name] = target
    return out


@dataclass
class Aligned:
    """One canonical row of both sides."""

    name: str
    a: dict | None
    b: dict | None
    diff: float
    """median(a's per-run medians) − median(b's), seconds."""
    noise: bool
    """The difference is inside the row's own noise (:func:`spread` of the two sides overlap)."""
    only: str = ""
    """The side it exists on, when the other has no row of that name."""
    small: bool = False
    """The difference is below :data:`FLOOR` of the slower side's hooked step."""
    folded: tuple[str, ...] = ()
    """One side's rows counted in this one (:func:`folds`)."""

    @property
    def finding(self) -> bool:
        return not self.noise and not self.only and not self.small


def total(row: dict | None) -> float:
    """A row's figure: the median of its per-run medians (one run: the median of its hooked steps), the lower
    middle of an even count (:func:`median_index`), so it is always its shown fwd + bwd."""
    if row is None:
        return 0.0
    medians = row.get("run_medians") or [quartiles(row["steps"])[1]]
    return medians[median_index(medians)]


def spread(row: dict) -> tuple[float, float]:
    """A row's noise band: the interquartile range of its hooked steps (one run), or the range of its per-run
    medians (several runs: a stall in one run widens it and so cannot make the row a finding)."""
    medians = row.get("run_medians") or []
    if len(medians) >= 2:
        return min(medians), max(medians)
    q1, _, q3 = quartiles(row["steps"])
    return q1, q3


def aligned(a: dict, b: dict, names: tuple[str, str] = ("a", "b")) -> list[Aligned]:
    """Every canonical row of either side; ranked findings first (largest difference first), then the
    rows inside their noise or below the floor (:data:`FLOOR`), then the one-sided rows."""
    fold = folds(a, b)
    ra, rb = module_rows(a, fold), module_rows(b, fold)
    into: dict[str, list[str]] = {}
    for name, target in fold.items():
        into.setdefault(target, []).append(name)
    floor = FLOOR * max(a.get("hooked_step_s") or 0.0, b.get("hooked_step_s") or 0.0)
    out = []
    for n in set(ra) | set(rb):
        x, y = ra.get(n), rb.get(n)
        only = names[0] if y is None else names[1] if x is None else ""
        noise = True
        if x is not None and y is not None:
            (la, ha), (lb, hb) = spread(x), spread(y)
            noise = not (la > hb or lb > ha)
        diff = total(x) - total(y)
        out.append(Aligned(n, x, y, diff, noise, only, small=abs(diff) < floor, folded=tuple(into.get(n, ()))))
    return sorted(out, key=lambda r: (0 if r.finding else 1 if not r.only else 2, -abs(r.diff), r.name))


def coverage(explain: dict, step_s: float | None) -> float | None:
    parts = sum(r["fwd_s"] + r["bwd_s"] for r in explain["modules"].values())
    return parts / step_s if step_s else None


def step_noise(explain: dict) -> float:
    """Half the spread of a side's hooked step: its steps' p25–p75 (one run), its per-run medians' range (several)."""
    medians = explain.get("hooked_run_medians_s") or []
    if len(medians) >= 2:
        return (max(medians) - min(medians)) / 2
    q1, _, q3 = quartiles(explain.get("hooked_steps_s") or [explain["hooked_step_s"]])
    return (q3 - q1) / 2


def rests_on(explain: dict) -> str:
    """How many runs and hooked steps a side's rows rest on, in words."""
    runs = runs_of(explain)
    steps = [len(e.get("hooked_steps_s") or [0]) for e in runs]
    if len(runs) == 1:
        return f"1 run, {steps[0]} hooked steps"
    return f"{len(runs)} runs × {'/'.join(map(str, sorted(set(steps))))} hooked steps ({sum(steps)})"
