"""What does xfw's harness cost? Its measured throughput against a bare hand-written loop on the same
model, optimizer and batches, alternated in one process, for every tiny family on each backend::

    python benchmarks/harness_overhead.py --backends torch,paddle --pairs 30 --out results/cpu/harness-overhead

Each backend runs in its own interpreter (``.venv/<backend>/bin/python``, started by this script with
``--backend``) with one host thread (``OMP_NUM_THREADS=MKL_NUM_THREADS=1``: a steady CPU), builds
the adapter's own session for each recipe, and then repeats pairs of legs in ABBA order (bare,
harness, harness, bare, ...) so that drift and order hit both alike:

* bare: nanoGPT-bench style, the family's loss, backward, optimizer step, zero grad, timed with the
  clock around N steps (synchronised on a GPU) after one untimed step;
* harness: ``xfw.contract.harness.run_training`` for one warm-up step and N measured steps, its
  throughput as the report computes it (``xfw.report.measure.summarize``), on the bare loop's own
  converted batches (:class:`Marked`).

The untimed step before each leg's clock is what every real measured window has (the recipe's
warm-up): without it, the harness's set-up before its window (synthetic batches made and hashed,
the record file opened) leaves the caches cold for its first measured step, which a short leg
charges to the harness (about 1% at three steps per leg, measured), though no real run pays it.

Garbage collection never runs inside a leg (as ``timeit``); a full collection (about 0.2 s in a
process holding torch and transformers, ten times a tiny step) runs every COLLECT_EVERY pairs,
between pairs, an odd number so it precedes each loop equally often. Legs can be one step long
(``--leg-s 0``): the two loops then alternate step by step, so both see the same load, which on a
shared host moves from one second to the next; a one-step window also charges the harness's fixed
per-window work to a single step (an overestimate).

Per pair the ratio harness ips / bare ips, twice: by the wall clock (the harness's ips as reported,
from its measured window) and by the process's CPU time over the same window (read where the
harness synchronises; unlike the wall clock, blind to other processes taking the CPU, which on a
shared host is most of the noise). Reported for each: the median of
the ratios, its 95% confidence interval (distribution-free, from order statistics), the 10th-90th
percentile spread of single ratios, and the number of pairs. The harness's cost is shown within
1% where the whole interval lies within [0.99, 1.01]. Writes ``OUT/<backend>.json`` (every leg, the
environment, the command) and ``OUT/README.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# This checkout's xfw and adapters, whatever the environments have installed.
sys.path[:0] = [str(ROOT), str(ROOT / "adapters" / "torch"), str(ROOT / "adapters" / "paddle")]
RECIPES = ["recipes/tiny/llava_sft.yaml", "recipes/tiny/llava_next_sft.yaml", "recipes/tiny/qwen2vl_sft.yaml",
           "recipes/tiny/sd15_pretrain.yaml", "recipes/tiny/sd3_dreambooth.yaml"]
THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
CLOCKS = ("cpu_fastest_step", "cpu_median_step", "cpu", "wall")
UNTIMED = 1  # steps each leg takes before its clock starts (the harness: its warm-up step)


# --- statistics ------------------------------------------------------------------------------------

def median_ci(values: list[float], confidence: float = 0.95) -> tuple[float, float]:
    """A distribution-free confidence interval of the median: order statistics k and n + 1 - k, k the
    largest with P(Binomial(n, 1/2) < k) <= (1 - confidence) / 2."""
    xs, n = sorted(values), len(values)
    tail, k, cumulative = (1 - confidence) / 2, 0, 0.0
    while k < n and cumulative + math.comb(n, k) / 2 ** n <= tail:
        cumulative += math.comb(n, k) / 2 ** n
        k += 1
    k = max(k, 1)
    return xs[k - 1], xs[n - k]


def summarize_pairs(bare: list[float], harnessed: list[float]) -> dict:
    ratios = [h / b for b, h in zip(bare, harnessed)]
    lo, hi = median_ci(ratios)
    deciles = statistics.quantiles(ratios, n=10)
    return {"pairs": len(ratios), "median_ratio": statistics.median(ratios), "ci95": [lo, hi],
            "ci95_half_width": (hi - lo) / 2, "p10_p90": [deciles[0], deciles[-1]],
            "within_1_percent": 0.99 <= lo and hi <= 1.01, "ratios": ratios}


# --- one backend, in its own interpreter -------------------------------------------------------------

def _marks() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def _bare_loop(one_step, sync):
    """The bare loop around a backend's hand-written optimizer step: ``UNTIMED`` steps, then the
    clocks at the (synchronised) start and after each of ``steps`` steps, the last synchronised
    (on a GPU per-step marks say little; the window's ends are what count)."""

    def bare(pool: list, accum: int, steps: int) -> list[tuple[float, float]]:
        marks = []
        for step in range(UNTIMED + steps):
            if step == UNTIMED:
                sync()
                marks.append(_marks())
            one_step([pool[(step * accum + i) % len(pool)] for i in range(accum)])
            if step >= UNTIMED:
                marks.append(_marks())
        sync()
        marks[-1] = _marks()
        return marks

    return bare


def _torch_loop(spec: dict):
    import torch

    from xfw_torch.families import family_module
    from xfw_torch.session import build_session

    session = build_session(spec)
    loss_fn = family_module(spec["model"]["family"]).loss_fn
    model, optimizer = session.model, session.optimizer

    def one_step(micro_batches: list) -> None:
        for batch in micro_batches:
            with session._autocast():  # the recipe's precision (O0: none), as the session's step
                loss = loss_fn(model, batch) / len(micro_batches)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    sync = torch.cuda.synchronize if session.cuda else (lambda: None)
    versions = {"torch": torch.__version__, "threads": torch.get_num_threads()}
    return session, _bare_loop(one_step, sync), versions


def _paddle_loop(spec: dict):
    import paddle

    from xfw_paddle.families import family_module
    from xfw_paddle.session import build_session

    session = build_session(spec)
    loss_fn = family_module(spec["model"]["family"]).loss_fn
    model, optimizer = session.model, session.optimizer

    def one_step(micro_batches: list) -> None:
        for batch in micro_batches:
            loss = loss_fn(model, batch, session._autocast) / len(micro_batches)
            loss.backward()
        optimizer.step()
        optimizer.clear_grad(set_to_zero=False)

    sync = paddle.device.cuda.synchronize if session.gpu else (lambda: None)
    return session, _bare_loop(one_step, sync), {"paddle": paddle.__version__}


class Marked:
    """The session as the harness sees it, noting both clocks at each of its timestamps (the window's
    start, then the end of every step) and at each synchronisation (after every warm-up step, then
    the window's two ends). With ``pool``, the batches the harness converts are the bare loop's,
    already on the device: the same tensors, as warm in the caches."""

    def __init__(self, session, pool: list | None = None):
        self._session, self.marks, self.syncs = session, [], []
        self._pool, self._next = pool, 0

    def to_device(self, batch):
        if self._pool is None:
            return self._session.to_device(batch)
        self._next += 1
        return self._pool[self._next - 1]

    def timestamp(self):
        stamp = self._session.timestamp()
        self.marks.append(_marks())
        return stamp

    def synchronize(self) -> None:
        self._session.synchronize()
        self.syncs.append(_marks())

    def __getattr__(self, name):
        return getattr(self._session, name)


def harness_leg(spec: dict, session, steps: int, pool: list | None = None) -> tuple[float, list[tuple[float, float]]]:
    """(ips as the report computes it, the clocks at the window's start, after every step and at its end)."""
    from xfw.contract import harness
    from xfw.contract.records import RecordWriter, load_records
    from xfw.report.measure import summarize

    run_spec = {**spec, "measure": {**spec["measure"], "warmup_steps": UNTIMED, "steps": steps}}
    marked = Marked(session, pool)
    with tempfile.TemporaryDirectory() as tmp:
        writer = RecordWriter(Path(tmp) / "steps.jsonl", 0)
        with _quiet_gc():
            harness.run_training(run_spec, writer, marked)
        writer.close()
        syncs = marked.syncs
        assert len(syncs) == UNTIMED + 2 and len(marked.marks) == steps + 1, (syncs, len(marked.marks))
        return summarize(load_records(Path(tmp) / "steps.jsonl")).ips, [syncs[-2], *marked.marks[1:-1], syncs[-1]]


COLLECT_EVERY = 25


@contextlib.contextmanager
def _quiet_gc():
    """No garbage collection inside a leg (as timeit); :func:`measure_recipe` collects between pairs."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def leg_stats(marks: list[tuple[float, float]], samples: int) -> dict:
    """A leg's throughput three ways: wall clock over the window, CPU time over the window, and the
    median step's CPU time (robust to another process's burst; misses the rare record write, which
    :func:`harness_alone` prices)."""
    steps = len(marks) - 1
    cpu_steps = [b[1] - a[1] for a, b in zip(marks, marks[1:])]
    return {"wall": steps * samples / (marks[-1][0] - marks[0][0]),
            "cpu": steps * samples / (marks[-1][1] - marks[0][1]),
            "cpu_median_step": samples / statistics.median(cpu_steps),
            "cpu_fastest_step": samples / min(cpu_steps)}


def harness_alone(spec: dict, session, steps: int = 20000) -> dict:
    """The harness's own cost with a step that costs nothing: per step inside the measured window
    (timestamps, loss tokens, the drain check), and per record written (once a second inside the
    window: the adapter's memory reading, the resident set, json, flush)."""
    from xfw.contract import harness, rss
    from xfw.contract.records import RecordWriter

    run_spec = {**spec, "measure": {**spec["measure"], "warmup_steps": 0, "steps": steps},
                "derived": {**spec["derived"], "grad_accum_steps": 1}}
    from harness_bookkeeping import NoopSession  # a session whose step costs nothing

    marked = Marked(NoopSession())
    with tempfile.TemporaryDirectory() as tmp:
        writer = RecordWriter(Path(tmp) / "steps.jsonl", 0)
        harness.run_training(run_spec, writer, marked)
        t0 = time.perf_counter()
        for _ in range(1000):  # what the harness's write_step does: memory readings, then one record
            alloc, reserved = session.memory_peaks()
            writer.write("step", step=0, phase="measure", step_time_s=0.01, samples=1, tokens=1, loss=1.0,
                         mem_alloc_peak_bytes=alloc, mem_reserved_peak_bytes=reserved, rss_peak_bytes=rss.peak_bytes())
        record_s = (time.perf_counter() - t0) / 1000
        writer.close()
    window_s = marked.syncs[1][0] - marked.syncs[0][0]
    # The window's records are written after it here (a null step never reaches the drain interval
    # inside it), so its time is the per-step work alone.
    return {"per_step_s": window_s / steps, "per_record_s": record_s, "steps": steps}


def measure_recipe(backend: str, recipe: str, pairs: int, leg_s: float) -> dict:
    from xfw.contract.synthetic import make_pool
    from xfw.recipe import load_recipe
    from xfw.recipe.spec import resolve_spec

    spec = resolve_spec(load_recipe(ROOT / recipe, []), backend=backend, run_id="overhead")
    if spec["precision"]["amp_level"] == "O2" or spec["derived"]["num_processes"] != 1:
        raise SystemExit(f"{recipe}: the bare loop is written for one process at O0/O1 (no master weights)")
    session, bare, versions = (_torch_loop if backend == "torch" else _paddle_loop)(spec)
    accum, samples = spec["derived"]["grad_accum_steps"], spec["batch"]["micro"] * spec["derived"]["grad_accum_steps"]
    pool = [session.to_device(b) for b in make_pool(spec, 0)]
    warm = bare(pool, accum, 5)  # warm (kernels, allocator) and calibrate
    step_s = (warm[-1][1] - warm[0][1]) / 5
    harness_leg(spec, session, 3)
    steps = max(1, round(leg_s / step_s)) if leg_s else 1
    legs: dict[str, list[dict]] = {"bare": [], "harness": []}
    reported = []
    for i in range(pairs):
        if i % COLLECT_EVERY == 0:
            gc.collect()
        for leg in (("bare", "harness") if i % 2 == 0 else ("harness", "bare")):  # ABBA
            if leg == "bare":
                with _quiet_gc():
                    marks = bare(pool, accum, steps)
                legs["bare"].append(leg_stats(marks, samples))
            else:
                ips, marks = harness_leg(spec, session, steps, pool)
                legs["harness"].append(leg_stats(marks, samples))
                reported.append(ips)
    out = {"recipe": recipe, "family": spec["model"]["family"], "steps_per_leg": steps, "samples_per_step": samples,
           "harness_reported_ips": reported, "versions": versions}
    for clock in CLOCKS:
        b, h = [x[clock] for x in legs["bare"]], [x[clock] for x in legs["harness"]]
        out[clock] = {"bare_ips": b, "harness_ips": h, **summarize_pairs(b, h)}
    alone = harness_alone(spec, session)
    median_step_s = samples / statistics.median(out["cpu_median_step"]["bare_ips"])
    out["harness_alone"] = {**alone, "bare_step_s": median_step_s,
                            "per_step_fraction": alone["per_step_s"] / median_step_s,
                            "records_fraction": alone["per_record_s"] / harness_drain_interval_s()}
    return out


def harness_drain_interval_s() -> float:
    from xfw.contract.harness import DRAIN_INTERVAL_S

    return DRAIN_INTERVAL_S


def run_backend(args) -> None:
    from xfw.contract.env import host_env

    results = [measure_recipe(args.backend, r, args.pairs, args.leg_s) for r in args.recipes]
    env = {**host_env(), "threads_env": {k: os.environ.get(k) for k in THREADS}, "load_average": os.getloadavg()}
    out = {"backend": args.backend, "command": args.command, "pairs": args.pairs, "leg_s": args.leg_s,
           "env": env, "results": results}
    path = Path(args.out) / f"{args.backend}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(out, indent=1) + "\n")
    tmp.replace(path)


# --- the driver ------------------------------------------------------------------------------------

def pooled_claim(backend: str, results: list[tuple[str, dict]]) -> str:
    """One sentence on every pair of every recipe of one backend, on the CPU clock over the window
    (each backend's session steps differently, so backends are never pooled into one claim)."""
    ratios = [x for b, r in results if b == backend for x in r["cpu"]["ratios"]]
    lo, hi = median_ci(ratios)
    return (f"{backend} {statistics.median(ratios):.4f} over {len(ratios)} pairs, 95% interval [{lo:.4f}, {hi:.4f}]"
            + (" (within 1%)" if 0.99 <= lo and hi <= 1.01 else " (not wholly within 1%)"))


def readme(out_dir: Path, backends: list[str]) -> str:
    """OUT/README.md from the JSON files: the summary, the pairs, the harness alone, the environment."""
    data = {b: json.loads((out_dir / f"{b}.json").read_text()) for b in backends}
    results = [(b, r) for b in backends for r in data[b]["results"]]
    measures = [r[c] for _, r in results for c in CLOCKS]
    widest = max(measures, key=lambda c: c["ci95_half_width"])
    shown = sum(c["within_1_percent"] for c in measures)
    worst_step = max((r["harness_alone"]["per_step_fraction"], b, r["recipe"]) for b, r in results)
    worst_record = max((r["harness_alone"]["records_fraction"], b, r["recipe"]) for b, r in results)
    lines = ["# Harness overhead (CPU, one thread)", "",
             "Harness throughput over a bare hand-written loop, same model, optimizer and batches, alternated in "
             "one process (ABBA pairs; `benchmarks/harness_overhead.py`, whose docstring defines each measure). "
             "Every leg, the environment and the command are in the JSON files beside this one.", "",
             "**Summary.** Median ratios (harness / bare) from "
             f"{min(c['median_ratio'] for c in measures):.3f} to {max(c['median_ratio'] for c in measures):.3f}; "
             f"the 95% interval of the median lies within [0.99, 1.01] for {shown} of {len(measures)} measures, "
             f"the widest being ±{widest['ci95_half_width']:.1%}. Pooled over the families (below), the median "
             "ratio on the CPU clock over the window: "
             f"{'; '.join(pooled_claim(b, results) for b in backends)}. The harness alone costs at most "
             f"{worst_step[0]:.3%} of a step ({worst_step[1]}, {worst_step[2]}) and its records at most "
             f"{worst_record[0]:.4%} of a second ({worst_record[1]}, {worst_record[2]}).", "",
             "| backend | recipe | pairs | steps/leg | measure | median ratio | 95% CI of the median "
             "| p10–p90 of single ratios | within 1% |", "|---|---|---:|---:|---|---:|---|---|---|"]
    alone = ["", "The harness alone (a step that costs nothing): its work per step inside the window, and per "
                 "record (written once a second inside the window), against the bare loop's median step:", "",
             "| backend | recipe | bare step (ms, CPU) | harness per step (µs) | share of a step "
             "| per record (µs) | share of a second |", "|---|---|---:|---:|---:|---:|---:|"]
    pooled = ["", "Pooled over the five tiny families (every pair of every recipe: the harness's relative cost "
                  "is one property of the harness, and each recipe alone has too few pairs on a noisy host to "
                  "bound it within 1%):", "",
              "| backend | measure | pairs | median ratio | 95% CI of the median | within 1% |",
              "|---|---|---:|---:|---|---|"]
    for scope in [[b] for b in backends]:
        for clock in CLOCKS:
            ratios = [x for b, r in results if b in scope for x in r[clock]["ratios"]]
            lo, hi = median_ci(ratios)
            pooled.append(f"| {' + '.join(scope)} | {clock} | {len(ratios)} | {statistics.median(ratios):.4f} "
                          f"| [{lo:.4f}, {hi:.4f}] | {'yes' if 0.99 <= lo and hi <= 1.01 else 'no'} |")
    envs = ["", "Environment:", ""]
    for backend, r in results:
        for clock in CLOCKS:
            c = r[clock]
            lines.append(f"| {backend} | {r['recipe']} | {c['pairs']} | {r['steps_per_leg']} | {clock} "
                         f"| {c['median_ratio']:.4f} | [{c['ci95'][0]:.4f}, {c['ci95'][1]:.4f}] "
                         f"| [{c['p10_p90'][0]:.3f}, {c['p10_p90'][1]:.3f}] | {'yes' if c['within_1_percent'] else 'no'} |")
        a = r["harness_alone"]
        alone.append(f"| {backend} | {r['recipe']} | {a['bare_step_s'] * 1e3:.2f} | {a['per_step_s'] * 1e6:.1f} "
                     f"| {a['per_step_fraction']:.3%} | {a['per_record_s'] * 1e6:.1f} | {a['records_fraction']:.4%} |")
    for backend in backends:
        env, versions = data[backend]["env"], data[backend]["results"][0]["versions"]
        envs.append(f"- {backend}: {env['host']['cpu']}, {env['host']['num_cpus']} CPUs, Python {env['python']}, "
                    f"{', '.join(f'{k} {v}' for k, v in versions.items())}, xfw {env['xfw_git_sha']}, "
                    f"{env['date_utc']}, threads {env['threads_env']}, load average at the start "
                    f"{env.get('load_average', '?')}.")
    commands = list(dict.fromkeys(data[b]["command"] for b in backends))
    return "\n".join(lines + pooled + alone + envs) + "\n\n" + "\n".join(f"Command: `{c}`  " for c in commands) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", default="torch,paddle", help="backends to measure, each in its own interpreter")
    parser.add_argument("--backend", help=argparse.SUPPRESS)  # set by the driver: measure in this interpreter
    parser.add_argument("--recipes", nargs="+", default=RECIPES)
    parser.add_argument("--pairs", type=int, default=30, help="(bare, harness) pairs per recipe")
    parser.add_argument("--leg-s", type=float, default=1.5, help="target seconds per leg (sets the steps per leg)")
    parser.add_argument("--out", required=True, help="directory for <backend>.json and README.md")
    parser.add_argument("--command", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--readme-only", action="store_true", help="rewrite OUT/README.md from OUT/<backend>.json")
    args = parser.parse_args()
    if args.backend:
        run_backend(args)
        return
    if args.readme_only:
        backends = [b for b in args.backends.split(",") if (Path(args.out) / f"{b}.json").exists()]
        (Path(args.out) / "README.md").write_text(readme(Path(args.out), backends))
        return
    command = " ".join(["python", "benchmarks/harness_overhead.py", *sys.argv[1:]])
    backends = [b for b in args.backends.split(",") if b]
    for backend in backends:
        python = ROOT / ".venv" / backend / "bin" / "python"
        subprocess.run([str(python), __file__, "--backend", backend, "--recipes", *args.recipes, "--pairs",
                        str(args.pairs), "--leg-s", str(args.leg_s), "--out", args.out, "--command", command],
                       check=True, env={**os.environ, **THREADS})
    (Path(args.out) / "README.md").write_text(readme(Path(args.out), backends))
    print((Path(args.out) / "README.md").read_text())


if __name__ == "__main__":
    main()
