"""Does ``--explain`` change what a compare measures? The same recipe compared with and without it,
alternated (ABBA: plain, explain, explain, plain, ...), each backend's throughput read from its run's
``summary.json``::

    python benchmarks/explain_overhead.py --pairs 3 --out results/cpu/explain-overhead

Explain profiles in a process of its own after the measured run has ended, so the measured windows
should not differ beyond the host's noise. Per backend: every leg's ips, the median of the
per-pair ratios (with explain / without), and each leg's explain wall time. Writes
``OUT/explain_overhead.json`` (legs, environment, command) and ``OUT/README.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]
BACKENDS = ("paddle", "torch")


def leg(recipe: str, explain: bool, work: Path, index: int, overrides: list[str]) -> dict:
    out = work / f"leg{index}"
    cmd = [str(ROOT / ".venv" / "torch" / "bin" / "python"), "-m", "xfw.cli", "compare", recipe,
           "--backends", ",".join(BACKENDS), "--out", str(out)] + (["--explain"] if explain else [])
    cmd += [a for o in overrides for a in ("--set", o)]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"leg {index} failed ({done.returncode}): {done.stderr[-2000:]}")
    name = next(p for p in out.iterdir() if p.is_dir()).name
    measured = {b: json.loads((out / name / b / "summary.json").read_text())["measurement"] for b in BACKENDS}
    ips = {b: m["ips"] for b, m in measured.items()}
    # each leg's spread: its measured step's p10/median/p90; on an explain leg, the explain process's plain,
    # hooked and profiled steps (p25/median/p75 over its steps): the profiler's cost, with its noise
    spread = {b: {"measured_s": [m.get("step_time_p10_s"), m.get("step_time_median_s"), m.get("step_time_p90_s")]}
              for b, m in measured.items()}
    if explain:
        from xfw.report.explain import quartiles

        for b in BACKENDS:
            e = json.loads((out / name / b / "explain.json").read_text())
            for kind in ("plain", "hooked", "profiler"):
                spread[b][f"{kind}_s"] = list(quartiles(e.get(f"{kind}_steps_s") or [e[f"{kind}_step_s"]]))
    return {"explain": explain, "ips": ips, "wall_s": wall, "spread": spread}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="recipes/tiny/llava_sft.yaml")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "cpu" / "explain-overhead")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="passed to every compare (a longer window: --set measure.steps=150)")
    args = parser.parse_args()
    from xfw.contract.atomic import write_json_atomic, write_text_atomic
    from xfw.contract.env import host_env

    env = {**host_env(), "load_average_start": os.getloadavg()}
    legs = []
    with tempfile.TemporaryDirectory() as tmp:
        for p in range(args.pairs):
            order = (False, True) if p % 2 == 0 else (True, False)
            pair = [leg(args.recipe, explain, Path(tmp), 2 * p + k, args.overrides) for k, explain in enumerate(order)]
            legs += [{**x, "pair": p} for x in pair]
            print(f"pair {p}: " + ", ".join(f"{'explain' if x['explain'] else 'plain'} "
                                            f"{x['ips']}" for x in pair), flush=True)
    env["load_average_end"] = os.getloadavg()
    summary = {}
    for b in BACKENDS:
        ratios = [next(x for x in legs if x["pair"] == p and x["explain"])["ips"][b]
                  / next(x for x in legs if x["pair"] == p and not x["explain"])["ips"][b] for p in range(args.pairs)]
        summary[b] = {"ratios": ratios, "median_ratio": statistics.median(ratios), "min_ratio": min(ratios),
                      "max_ratio": max(ratios),
                      "plain_ips": [x["ips"][b] for x in legs if not x["explain"]],
                      "explain_ips": [x["ips"][b] for x in legs if x["explain"]]}
    args.out.mkdir(parents=True, exist_ok=True)
    command = f"python benchmarks/explain_overhead.py --recipe {args.recipe} --pairs {args.pairs}" + \
        "".join(f" --set {o}" for o in args.overrides)
    write_json_atomic(args.out / "explain_overhead.json", {"command": command, "env": env, "legs": legs,
                                                           "summary": summary})
    lines = ["# Measured throughput with and without `--explain`", "",
             f"`{command}` — {args.recipe}, {args.pairs} pairs alternated (ABBA), both backends each leg.", "",
             "| Backend | ips without explain | ips with explain | median ratio (with / without) | ratio range |",
             "|---|---|---|---:|---:|"]
    for b, s in summary.items():
        lines.append(f"| {b} | {', '.join(f'{v:.1f}' for v in s['plain_ips'])} | "
                     f"{', '.join(f'{v:.1f}' for v in s['explain_ips'])} | {s['median_ratio']:.3f} | "
                     f"{s['min_ratio']:.3f}–{s['max_ratio']:.3f} |")
    lines += ["", "Each leg's measured step, median (p10–p90), ms; on the explain legs the explain process's plain, hooked "
              "and profiled steps, median (p25–p75), ms, and the profiler's cost (the profiled step's median over the measured "
              "one's, only when its p25 is above the measured p90):", "",
              "| Backend | leg | measured step | plain step (explain) | hooked step | profiled step | profiler's cost |",
              "|---|---|---:|---:|---:|---:|---:|"]

    def ms(q: list) -> str:
        lo, mid, hi = q
        return "–" if mid is None else f"{mid * 1e3:.1f} ({lo * 1e3:.1f}–{hi * 1e3:.1f})"
    for b in BACKENDS:
        for i, x in enumerate(legs):
            s = x["spread"][b]
            kinds = [ms(s[k]) if k in s else "" for k in ("plain_s", "hooked_s", "profiler_s")]
            ratio = ""
            if "profiler_s" in s and s["measured_s"][1]:  # a factor only above the measured spread (as the report)
                q1, q2, q3 = s["profiler_s"]
                lo, mid, hi = s["measured_s"]
                ratio = f"×{q2 / mid:.2f}" if q1 > (hi or mid) else \
                    "faster: another speed, no cost readable" if q3 < (lo or mid) else "within the noise"
            lines.append(f"| {b} | {i} ({'explain' if x['explain'] else 'plain'}) | {ms(s['measured_s'])} | "
                         + " | ".join(kinds) + f" | {ratio} |")
    walls = [x["wall_s"] for x in legs]
    lines += ["", f"Wall time per leg: {', '.join(f'{w:.0f} s' for w in walls)} (explain legs add the profiling "
              "after both runs).", "",
              f"Environment: {env['host']['cpu']}, {env['host']['num_cpus']} CPUs shared with other work, "
              f"xfw {env['xfw_git_sha']}, {env['date_utc']}, load average {env['load_average_start']} at the start, "
              f"{env['load_average_end']} at the end.", ""]
    write_text_atomic(args.out / "README.md", "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
