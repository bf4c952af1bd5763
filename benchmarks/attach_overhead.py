"""What does measuring an ordinary training script cost, and does it tell the same story as xfw's
own adapter? One `xfw compare`, its repeats alternating the sides (adapter, Trainer, loop, ...
then again), on the tiny-llava network (the same 190,656 parameters everywhere):

* ``torch`` / ``paddle``: xfw's adapters (the harness's loop over pre-made batches);
* ``*_trainer``: examples/attach/*_trainer.py, a transformers / PaddleNLP Trainer, under xfw's probe;
* ``*_loop``: examples/attach/*_loop.py, a hand-written loop with a DataLoader, under the probe;
* ``*_loop_log``: the same loop without the probe, its own printed step times parsed
  (``log_pattern``): what the script says about itself, next to what the probe measured.

The Trainers run without gradient clipping (``--max-grad-norm 0``) and constant batches, as the
adapters train; the scripts still load and collate their data every step, the adapters do not.

    python benchmarks/attach_overhead.py --repeat 3 --out results/cpu/attach-overhead

Writes OUT/recipe.yaml (what ran), OUT/compare/ (every run directory and xfw's report), and
OUT/result.json + OUT/README.md (medians, spreads, ratios against the adapter, the environment,
this command).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from xfw import workflow  # noqa: E402 - after the path above, so a checkout runs it as is
from xfw.contract.env import host_env  # noqa: E402
from xfw.report.measure import spread  # noqa: E402
from xfw.report.nodes import load_runs  # noqa: E402

FRAMEWORKS = ("torch", "paddle")
KINDS = ("", "_trainer", "_loop", "_loop_log")
ARGS = ["--max-steps", "100000", "--batch", "4", "--accum", "2"]


def recipe(out: Path, repeat: int, steps: int) -> dict:
    """The recipe, with paths relative to OUT/recipe.yaml (xfw resolves cwd against the recipe file)."""
    examples = os.path.relpath(ROOT / "examples" / "attach", out)
    backends: dict = {}
    for fw in FRAMEWORKS:
        python = os.path.relpath(ROOT / ".venv" / fw / "bin" / "python", ROOT / "examples" / "attach")
        backends[fw] = {}
        backends[f"{fw}_trainer"] = {"command": [python, f"{fw}_trainer.py", *ARGS, "--max-grad-norm", "0"],
                                     "cwd": examples}
        backends[f"{fw}_loop"] = {"command": [python, f"{fw}_loop.py", *ARGS], "cwd": examples}
        backends[f"{fw}_loop_log"] = {"command": [python, f"{fw}_loop.py", *ARGS, "--print-step-times"],
                                      "cwd": examples, "log_pattern": {"step_time_s": r"^step \d+ time_s ([0-9.]+)"}}
    return {"name": "attach-overhead", "model": {"preset": "tiny-llava"}, "stage": "sft",
            "precision": {"dtype": "fp32", "amp_level": "O0"}, "batch": {"global": 8, "micro": 4},
            "optimizer": {"name": "adamw", "lr": 1.0e-3},
            "measure": {"warmup_steps": 5, "steps": steps, "repeat": repeat, "timeout_s": 600, "cpu_threads": 1},
            "backends": backends}


def summarise(runs_dir: Path) -> dict:
    by_backend: dict[str, list[float]] = {}
    for r in load_runs([runs_dir]):
        assert r.ok, f"{r.run_dir}: {r.status} {r.reason}"
        by_backend.setdefault(r.backend, []).append(r.measurement.ips)
    out = {}
    for fw in FRAMEWORKS:
        adapter = statistics.median(by_backend[fw])
        for kind in KINDS:
            ips = by_backend[fw + kind]
            out[fw + kind] = {"ips": ips, "median_ips": statistics.median(ips), "spread": spread(ips),
                              "ratio_to_adapter": statistics.median(ips) / adapter}
    return out


def readme(result: dict) -> str:
    lines = ["# A training script under xfw's probe vs xfw's own adapter (tiny LLaVA, CPU)", "",
             f"Command: `{result['command']}`  ", f"Host: {result['env']['host']['cpu']}, "
             f"{result['env']['host']['num_cpus']} CPUs, one host thread per process; "
             f"{result['env']['date_utc']}; xfw {result['env']['xfw_git_sha']}", "",
             "| backend | what ran | median ips | spread | / adapter |", "|---|---|---:|---:|---:|"]
    what = {"": "xfw's adapter", "_trainer": "Trainer script, probe", "_loop": "hand-written loop, probe",
            "_loop_log": "the same loop, no probe: its own printed step times"}
    for fw in FRAMEWORKS:
        for kind in KINDS:
            r = result["sides"][fw + kind]
            spread_text = f"{r['spread']:.0%}" if r["spread"] is not None else "–"
            lines.append(f"| {fw + kind} | {what[kind]} | {r['median_ips']:.1f} | {spread_text} | "
                         f"{r['ratio_to_adapter']:.2f} |")
    sides = result["sides"]
    probe_vs_own = {fw: sides[f"{fw}_loop"]["median_ips"] / sides[f"{fw}_loop_log"]["median_ips"] for fw in FRAMEWORKS}
    lines += ["", "The probe against the script's own timing of the same loop (`*_loop` / `*_loop_log`): "
              + ", ".join(f"{fw} {r:.2f}" for fw, r in probe_vs_own.items()) + ".", "",
              "ips: global samples per second over each run's measured window; median over the repeats, "
              "spread = (max − min) / median. The runs alternate (each repeat runs every backend once), so drift "
              "on this shared machine hits all sides alike. `compare/` holds every run directory and xfw's own "
              "report of them; `recipe.yaml` is what ran."]
    if result.get("reading"):
        lines += ["", "## Reading it", "", result["reading"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--readme-only", action="store_true",
                        help="rewrite OUT/README.md from OUT/result.json (after adding a 'reading' to it)")
    args = parser.parse_args()
    if args.readme_only:
        (args.out / "README.md").write_text(readme(json.loads((args.out / "result.json").read_text())))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    recipe_path = args.out / "recipe.yaml"
    recipe_path.write_text(yaml.safe_dump(recipe(args.out, args.repeat, args.steps), sort_keys=False))
    names = [fw + kind for fw in FRAMEWORKS for kind in KINDS]
    outcome = workflow.compare([str(recipe_path)], names, overrides=[], interpreters={}, out_dir=args.out / "compare",
                               force=True, log=print)
    print(outcome.text)
    if outcome.exit_code:
        sys.exit(f"a run did not succeed (exit code {outcome.exit_code}): {'; '.join(outcome.notes)}")
    result = {"command": " ".join(["python", *sys.argv]), "env": host_env(), "recipe": str(recipe_path),
              "load_average_after": os.getloadavg(), "sides": summarise(args.out / "compare")}
    (args.out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "README.md").write_text(readme(result))
    print(readme(result))


if __name__ == "__main__":
    main()
