"""How often does ``xfw compare --ab`` call one build against itself a change? Its designed false-positive
rate is the test's alpha (5%, xfw.report.ab); this measures it on real runs::

    python benchmarks/ab_false_positives.py --backend torch --trials 12 --pairs 4 --out results/cpu/ab/false-positives

Each trial is one ordinary ``xfw compare RECIPE --backends B@same=PYTHON,B --ab --repeat PAIRS``: two
instances of one build (the same interpreter under two names), alternated A B B A, on the tiny LLaVA recipe.
Every trial's verdict, ratio, interval and smallest detectable change go to ``OUT/trials.json`` with the
environment; ``OUT/README.md`` gives the count of "changed" verdicts with its exact (Clopper-Pearson) 95%
interval. A planted difference (``--plant-env VAR=VALUE`` set on the first instance through
``backends.<instance>.env``) turns the same script into a power check.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from xfw.contract.atomic import write_json_atomic, write_text_atomic  # noqa: E402


def clopper_pearson(k: int, n: int, level: float = 0.95) -> tuple[float, float]:
    from scipy import stats

    a = (1 - level) / 2
    low = 0.0 if k == 0 else float(stats.beta.ppf(a, k, n - k + 1))
    high = 1.0 if k == n else float(stats.beta.ppf(1 - a, k + 1, n - k))
    return low, high


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="torch")
    parser.add_argument("--recipe", default="recipes/tiny/llava_sft.yaml")
    parser.add_argument("--trials", type=int, default=12)
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--plant-env", default=None, metavar="VAR=VALUE")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    python = ROOT / ".venv" / args.backend / "bin" / "python"
    xfw = ROOT / ".venv" / "torch" / "bin" / "xfw"
    same = f"{args.backend}@same"
    overrides = list(args.overrides)
    if args.plant_env:
        var, _, value = args.plant_env.partition("=")
        overrides.append(f"backends.{same}.env.{var}={value}")
    trials, started = [], time.time()
    for trial in range(args.trials):
        out = args.out / f"trial-{trial:02d}"
        cmd = [str(xfw), "compare", args.recipe, "--backends", f"{same}={python},{args.backend}", "--ab",
               "--repeat", str(args.pairs), "--out", str(out), "--force",
               *(x for o in overrides for x in ("--set", o))]
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False)
        try:
            verdict = json.loads((out / "ab.json").read_text())["verdicts"][0]
        except (OSError, ValueError, KeyError, IndexError):
            verdict = {"verdict": "failed", "text": (done.stderr.strip().splitlines() or ["?"])[-1]}
        trials.append({"trial": trial, **{k: verdict.get(k) for k in ("verdict", "ratio", "low", "high", "p_value",
                                                                     "detectable", "pairs", "text")}})
        print(f"trial {trial + 1}/{args.trials}: {verdict.get('text', verdict['verdict'])}", flush=True)
    judged = [t for t in trials if t["verdict"] in ("no change", "slower", "faster")]
    changed = sum(t["verdict"] in ("slower", "faster") for t in judged)
    low, high = clopper_pearson(changed, len(judged)) if judged else (0.0, 1.0)
    env = {"python": platform.python_version(), "machine": platform.machine(), "node": platform.node(),
           "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "wall_s": round(time.time() - started),
           "command": " ".join(sys.argv)}
    write_json_atomic(args.out / "trials.json", {"trials": trials, "changed": changed, "judged": len(judged),
                                                 "rate_ci95": [low, high], "env": env, "plant_env": args.plant_env})
    detectable = sorted(t["detectable"] for t in judged if t.get("detectable") is not None)
    kind = f"planted ({args.plant_env} on {same})" if args.plant_env else "the same build under two names"
    write_text_atomic(args.out / "README.md", "\n".join([
        f"# A/B of {kind}: how often it says \"changed\"", "",
        f"`python {' '.join(sys.argv)}` on {env['date_utc']} ({env['node']}, {env['wall_s']} s).", "",
        f"{len(judged)} A/Bs of {args.pairs} pairs each ({args.backend}, {args.recipe}): **{changed} said changed** "
        f"({100 * changed / max(len(judged), 1):.0f}%, exact 95% interval {100 * low:.0f}–{100 * high:.0f}%); "
        f"the test's designed rate is 5% (paired t-test on log ratios, two-sided, alpha 0.05).",
        f"The smallest change these A/Bs could detect at 80% power: median {100 * detectable[len(detectable) // 2]:.0f}%"
        if detectable else "No A/B gave a verdict.", "",
        "| Trial | Verdict | Ratio | 95% CI | p | Detectable |", "|---|---|---:|---|---:|---:|",
        *(f"| {t['trial']} | {t['verdict']} | {t['ratio']:.3f} | {t['low']:.3f}–{t['high']:.3f} | {t['p_value']:.3g} | "
          f"{100 * t['detectable']:.0f}% |" if t.get("ratio") is not None else f"| {t['trial']} | {t['verdict']} | | | | |"
          for t in trials), ""]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
