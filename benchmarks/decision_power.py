"""How often does ``xfw converge`` decide right, decide wrong, or say undecided, and how many seeds
does it spend? (issue 39; the A/B and bisect parts are benchmarks/decision_power_builds.py)::

    python benchmarks/decision_power.py --seeds 4 --steps 60 --eval-every 30 --out results/cpu/decisions

Real part: the ordinary CLI on the tiny LLaVA recipe, Paddle against PyTorch, two scenarios, each one
``xfw converge --seeds N``, then ``--seeds auto --max-seeds N`` and ``--direction torch-worse`` on the
same directory (every seed's runs are kept, so the sequential decision replays the looks on the same
real curves and says how many seeds it needed). The scenarios share one directory, as the contract test
does: the second runs with ``--force``, and the Paddle runs, whose spec is the same, are kept.

* ``fp32``: both sides fp32 — the truth is "the same" (they differ by rounding, ~1e-6);
* ``bf16-no-master``: PyTorch alone in bf16 O2 without master weights (``backends.torch.override``):
  a real one-sided precision loss — the truth is "torch worse".

Simulation part (labelled as such in the output): the real per-seed paired log ratios' spread, with
planted relative differences of 0, 1%, 3%, 5% and 7% on the side asked about, drawn ``--trials`` times
(normal, the measured standard deviation) and decided sequentially exactly as ``--seeds auto`` does
(xfw.report.decision.decide, start 2, at most ``--seeds``, alpha spent across the looks). Right: "same"
for a difference inside the margin (for 1%, "worse" is also right: it is worse, by less than δ); "worse"
for one of at least the margin; wrong: the other decided answer (a false "same" or a false "worse").
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from xfw.contract.atomic import read_json_object, write_json_atomic, write_text_atomic  # noqa: E402
from xfw.report.decision import decide, log_ratios  # noqa: E402

RECIPE = "recipes/tiny/llava_json_sft.yaml"
SCENARIOS = {
    "fp32": ([], "same"),
    "bf16-no-master": (["--set", "backends.torch.override.precision.dtype=bf16",
                        "--set", "backends.torch.override.precision.amp_level=O2",
                        "--set", "backends.torch.override.precision.master_weights=false"], "worse"),
}
PLANTED = (0.0, 0.01, 0.03, 0.05, 0.07)


def converge(out: Path, seeds: list[str], args, extra: list[str]) -> tuple[dict, float, str]:
    xfw = ROOT / ".venv" / "torch" / "bin" / "xfw"
    cmd = [str(xfw), "converge", RECIPE, "--backends", "paddle,torch", *seeds, "--steps", str(args.steps),
           "--eval-every", str(args.eval_every), "--margin", str(args.margin), "--set", f"optimizer.lr={args.lr}",
           *extra, "--out", str(out)]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    took = time.perf_counter() - t0
    report = read_json_object(out / "converge.json") if (out / "converge.json").exists() else {}
    if done.returncode not in (0, 1) or not report:
        raise SystemExit(f"{' '.join(cmd)}: exit {done.returncode}\n{done.stderr[-2000:]}")
    return report, took, " ".join(cmd[1:])


def per_seed(report: dict) -> list[dict]:
    """Each seed's final eval loss on both sides and the paired log ratio ln(torch / paddle)."""
    rows = []
    for seed, run in sorted(report["curves"]["torch"].items(), key=lambda kv: int(kv[0])):
        other = report["curves"]["paddle"][seed]
        finals = [next((v for s, _, v in reversed(r["eval"]) if s == report["steps"]), None) for r in (other, run)]
        ratio = log_ratios([finals[0]], [finals[1]])[0]
        rows.append({"seed": int(seed), "paddle": finals[0], "torch": finals[1],
                     "log_ratio_torch_over_paddle": ratio if math.isfinite(ratio) else None})
    return rows


def simulate(sd: float, planted: float, most: int, margin: float, trials: int, rng) -> dict:
    """--seeds auto replayed on drawn log ratios: start at 2, one more at a time, at most ``most``."""
    counts = {"same": 0, "worse": 0, "better": 0, "undecided": 0}
    spent = []
    looks = most - 2 + 1
    for _ in range(trials):
        draws = list(rng.normal(math.log1p(planted), sd, most))
        for n in range(2, most + 1):
            d = decide(draws[:n], margin=margin, higher_is_worse=True, direction="one-sided", look=n - 1,
                       max_looks=looks)
            if d.decided or n == most:
                counts[d.outcome] += 1
                spent.append(n)
                break
    right = counts["same"] + (counts["worse"] if planted > 0 else 0) if planted < margin else counts["worse"]
    wrong = (counts["worse"] if planted == 0 else 0) if planted < margin else counts["same"]
    return {"planted": planted, "trials": trials, **counts, "right": right, "wrong": wrong,
            "undecided_share": counts["undecided"] / trials, "wrong_share": wrong / trials,
            "mean_seeds": statistics.fmean(spent)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--eval-every", type=int, default=30)
    parser.add_argument("--lr", default="3.0e-4")
    parser.add_argument("--margin", type=float, default=0.02)
    parser.add_argument("--trials", type=int, default=2000)
    parser.add_argument("--runs", type=Path, default=Path("/tmp/xfw-decision-power"))
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "cpu" / "decisions")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    args = parser.parse_args()
    import numpy as np

    out = {"recipe": RECIPE, "steps": args.steps, "eval_every": args.eval_every, "lr": args.lr,
           "margin": args.margin, "seeds": args.seeds, "host": platform.node(), "python": platform.python_version(),
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "real": {}, "simulation": []}
    sds = []
    for i, name in enumerate(args.scenarios.split(",")):
        extra, truth = SCENARIOS[name]
        where = args.runs
        fixed, took, cmd = converge(where, ["--seeds", str(args.seeds), *(["--force"] if i else [])], args, extra)
        auto, took_auto, cmd_auto = converge(where, ["--seeds", "auto", "--max-seeds", str(args.seeds)], args, extra)
        asked, _, _ = converge(where, ["--seeds", str(args.seeds), "--direction", "torch-worse"], args, extra)
        rows = per_seed(fixed)
        finite = [r["log_ratio_torch_over_paddle"] for r in rows if r["log_ratio_torch_over_paddle"] is not None]
        if len(finite) >= 2:
            sds.append((name, statistics.stdev(finite)))
        out["real"][name] = {
            "truth": truth, "command": cmd, "seconds": round(took, 1),
            "fixed": {"headline": fixed["headline"], "decision": fixed["points"][-1]["decision"]},
            "auto": {"command": cmd_auto, "seconds": round(took_auto, 1), "headline": auto["headline"],
                     "decision": auto["points"][-1]["decision"], "seeds_spent": auto["points"][-1]["decision"]["n"]},
            "one_sided_torch_worse": {"headline": asked["headline"], "decision": asked["points"][-1]["decision"]},
            "per_seed": rows}
        print(f"{name}: {fixed['headline'][1]}\n  auto: {auto['headline'][1]}\n  one-sided: {asked['headline'][1]}",
              flush=True)
    # Simulation over the measured spread: the larger of the two scenarios' per-seed sd (the harder case).
    sd = max(s for _, s in sds) if sds else 0.01
    rng = np.random.default_rng(39)
    out["simulation_sd"] = {"value": sd, "from": dict(sds), "note": "SIMULATION: normal draws with the measured sd"}
    for planted in PLANTED:
        out["simulation"].append(simulate(sd, planted, args.seeds, args.margin, args.trials, rng))
    args.out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(args.out / "converge_power.json", out)
    lines = ["| planted (torch worse by) | right | wrong | undecided | mean seeds spent |", "|---:|---:|---:|---:|---:|"]
    for s in out["simulation"]:
        lines.append(f"| {s['planted']:.0%} | {s['right']} | {s['wrong']} | {s['undecided']} | {s['mean_seeds']:.2f} |")
    write_text_atomic(args.out / "converge_power_simulation.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
