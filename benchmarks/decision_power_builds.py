"""How often ``--ab`` and ``xfw bisect`` decide right, wrong or undecided, and the runs they spend, for
planted slowdowns of 0-50% (issue 39). A SIMULATION over real measured noise: every pair's noise is
drawn from the log ratios of real alternated pairs of one build against itself
(results/cpu/ab/false-positives: torch, recipes/tiny/llava_sft.yaml, a 2-core VM at load 3-7, the
loaded machine), and the real decision code decides (xfw.report.ab.ab_test, xfw.run.commands.bisect.search)::

    python benchmarks/decision_power_builds.py --trials 400 --out results/cpu/decisions/builds-simulated.md

Each run's noise is a measured pair's log ratio divided by sqrt(2) (a pair's difference holds two runs'
noise), drawn with replacement; ``--scale`` multiplies it (0.5: a quieter machine than the one measured).
A/B: ``--repeat auto --max-pairs 12`` (3 pairs, then 3 more per look). Bisect: 8 builds, the change at
the 6th, ``--repeat auto --max-pairs 12``, margin 5%.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from xfw.report.ab import MARGIN, ab_test  # noqa: E402
from xfw.run.commands import bisect as bs  # noqa: E402

SIZES = (0.0, 0.05, 0.10, 0.20, 0.30, 0.50)


def measured_pool() -> list[float]:
    pool = []
    for path in sorted((ROOT / "results/cpu/ab/false-positives").glob("trial-*/ab.json")):
        for v in json.loads(path.read_text())["verdicts"]:
            pool += [math.log(r) for r in v["ratios"]]
    return pool


def run_noise(rng, pool, scale):
    return scale * rng.choice(pool) / math.sqrt(2)


def ab_trial(rng, pool, size, scale, start=3, step=3, max_pairs=12):
    looks = 1 + math.ceil((max_pairs - start) / step)
    pairs = []
    for look in range(1, looks + 1):
        for _ in range(start if look == 1 else step):
            a = 100 * math.exp(run_noise(rng, pool, scale))
            b = 100 * (1 - size) * math.exp(run_noise(rng, pool, scale))
            pairs.append((b, a))
        found = ab_test("new", "old", pairs, look=look, max_looks=looks)
        if found.verdict != "undecided":
            break
    return found.verdict, 2 * len(pairs)


def ab_score(verdict, size):
    if size == 0:
        return {"same": "right", "undecided": "undecided"}.get(verdict, "wrong")
    if verdict == "slower":
        return "right"
    return "undecided" if verdict == "undecided" else "wrong"  # "same" at a planted 5%+ change is a false same


def bisect_trial(rng, pool, size, scale, builds=8, change=5, max_pairs=12):
    names = [f"fw@{i}" for i in range(builds)]
    truth = {n: (math.log(1 - size) if i >= change else 0.0) for i, n in enumerate(names)}
    runs = [0]
    store = {}

    def measure(name, refs, look):
        key = (name, refs)
        got = store.setdefault(key, {r: [] for r in refs})
        while len(got[refs[0]]) < (3 * look):
            own = truth[name] + run_noise(rng, pool, scale)
            runs[0] += 1 + len(refs)
            for r in refs:
                got[r].append(own - (truth[r] + run_noise(rng, pool, scale)))
        return {r: list(v) for r, v in got.items()}

    result = bs.search(names, names[0], names[-1], measure, bs.Plan(start=3, max_pairs=max_pairs, step=3,
                                                                     margin=MARGIN))
    pos = {n: i for i, n in enumerate(names)}
    if result.outcome == "found":
        score = "right" if pos[result.first_bad] == change else "wrong culprit"
    elif result.outcome == "range":
        score = ("honest range" if pos[result.last_good] < change <= pos[result.first_bad] else "wrong range")
    elif result.outcome == "same":
        score = "right" if size == 0 else "wrong (same)"
    else:
        score = "undecided"
    if size == 0 and result.outcome in ("found", "range"):
        score = "wrong (change)"
    return score, runs[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=400)
    parser.add_argument("--seed", type=int, default=39)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    pool = measured_pool()
    rng = random.Random(args.seed)
    lines = [f"# --ab and bisect against planted slowdowns: a SIMULATION over real measured pair noise",
             "", f"`python benchmarks/decision_power_builds.py --trials {args.trials} --seed {args.seed}`", "",
             f"Noise: {len(pool)} real same-build pair log ratios (results/cpu/ab/false-positives, loaded 2-core VM), "
             f"sd {statistics_sd(pool):.3f}; each run draws one / sqrt(2), times the scale. Margin ±{100 * MARGIN:g}%. "
             "Simulated: the decisions are xfw's own code, the runs are drawn, not launched.", ""]
    for scale, label in ((1.0, "loaded (as measured)"), (0.5, "quieter (noise halved)")):
        lines += [f"## A/B, --repeat auto --max-pairs 12, {label}", "",
                  "| Planted slowdown | Right | Wrong | Undecided | Runs spent (mean) |", "|---:|---:|---:|---:|---:|"]
        for size in SIZES:
            counts, runs = {"right": 0, "wrong": 0, "undecided": 0}, 0
            for _ in range(args.trials):
                verdict, spent = ab_trial(rng, pool, size, scale)
                counts[ab_score(verdict, size)] += 1
                runs += spent
            lines.append(f"| {100 * size:.0f}% | {_p(counts['right'], args.trials)} | {_p(counts['wrong'], args.trials)} "
                         f"| {_p(counts['undecided'], args.trials)} | {runs / args.trials:.1f} |")
        lines += ["", f"## Bisect of 8 builds, change at the 6th, --repeat auto --max-pairs 12, {label}", "",
                  "| Planted slowdown | Right culprit | Honest range | Undecided | Wrong culprit | Wrong range / same "
                  "| Runs spent (mean) |", "|---:|---:|---:|---:|---:|---:|---:|"]
        for size in SIZES:
            counts, runs = {}, 0
            trials = max(args.trials // 4, 20)
            for _ in range(trials):
                score, spent = bisect_trial(rng, pool, size, scale)
                counts[score] = counts.get(score, 0) + 1
                runs += spent
            wrong = sum(v for k, v in counts.items() if k.startswith("wrong") and k != "wrong culprit")
            lines.append(f"| {100 * size:.0f}% | {_p(counts.get('right', 0), trials)} | "
                         f"{_p(counts.get('honest range', 0), trials)} | {_p(counts.get('undecided', 0), trials)} | "
                         f"{_p(counts.get('wrong culprit', 0), trials)} | {_p(wrong, trials)} | {runs / trials:.0f} |")
        lines.append("")
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


def statistics_sd(xs):
    import statistics

    return statistics.stdev(xs)


def _p(k, n):
    return f"{k}/{n} ({100 * k / n:.0f}%)"


if __name__ == "__main__":
    main()
