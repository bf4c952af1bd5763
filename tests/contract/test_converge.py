"""xfw converge can tell: both sides in fp32 are the same within the margin; one side's precision loss is named.

Tiny LLaVA on its real data (recipes/tiny/data: a few hundred pictures whose answers follow from what
is drawn), 3 seeds, both real adapters, as a user runs it (the CLI). First both sides in fp32: the
paired decision (per-seed log ratios of the final eval loss, margin 2%) says "same within ±2%" (the
sides differ by fp32 rounding). Then the same command with one ordinary, reported setting
changed on the PyTorch side only — bf16 O2 with its master weights off, so the optimizer updates bf16
weights in place and small updates round away — into the same --out with --force: the Paddle runs
(same spec) are kept, the PyTorch ones run again, and the verdict names torch as worse. Measured on
this 2-core machine (lr 3e-4, 3 seeds, eval every 20 steps): at the recipe's batch (4 in micro-batches
of 2) fp32 is "same" at every point to 120 (per-seed ratios within 1e-6) and bf16 without master weights
"same" at 20 and 40, then torch worse from step 60 on (95% intervals −2.4…−1.8% at 60, −4.1…−3.0% at
80, −8.0…−4.6% at 120). At a batch of 2 in one micro-batch (what runs here: a third of the CPU time per
step) the same: fp32 "same" at every point to 100, torch worse from step 60 (−2.3…−1.5% at 60,
−3.9…−2.5% at 80, −5.3…−4.0% at 100), the mean eval loss from 6.25 to 3.67 by step 80. So 80 steps
(was 120) still reach both verdicts, with a separation that lasts over two points. The speed runs
measure 2 steps (the recipe's 8 give a 0.5 s window that converge would measure with 160 steps): the
curves' pace puts 2 steps under compare's 5 s minimum, so converge measures 40 steps under speed-window/
at once and never runs the recipe's own window (asserted); the path that runs it and then measures again
is a nightly converge entry's (README's `xfw nightly suites/cpu_converge.yaml`, test_documented_commands).
Nothing here asserts on speed beyond its line.
"""

import json
import subprocess

import pytest

from conftest import ROOT, require_interpreter

pytestmark = pytest.mark.contract

RECIPE = "recipes/tiny/llava_json_sft.yaml"
COMMON = ["--backends", "paddle,torch", "--seeds", "3", "--steps", "80", "--eval-every", "20",
          "--set", "optimizer.lr=3.0e-4", "--set", "batch.global=2", "--set", "batch.micro=2",
          "--set", "measure.warmup_steps=1", "--set", "measure.steps=2"]
PURE_BF16 = ["--set", "backends.torch.override.precision.dtype=bf16",
             "--set", "backends.torch.override.precision.amp_level=O2",
             "--set", "backends.torch.override.precision.master_weights=false"]


def converge(out, *extra):
    xfw = ROOT / ".venv" / "torch" / "bin" / "xfw"
    done = subprocess.run([str(xfw), "converge", RECIPE, *COMMON, "--out", str(out), *extra], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    report = json.loads((out / "converge.json").read_text()) if (out / "converge.json").exists() else None
    return done, report


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    require_interpreter("torch")
    require_interpreter("paddle")
    out = tmp_path_factory.mktemp("converge")
    fp32 = converge(out)
    paddle_runs = {p: p.stat().st_mtime_ns for p in out.glob("seed-*/paddle/steps.jsonl")}
    degraded = converge(out, *PURE_BF16, "--force")
    kept = all(p.stat().st_mtime_ns == t for p, t in paddle_runs.items())
    return out, fp32, degraded, kept


def test_both_sides_in_fp32_are_the_same_within_the_margin(runs):
    out, (done, report), _, _ = runs
    assert done.returncode == 0, done.stderr[-3000:]
    assert report["comparison"] == "like-for-like" and report["backends"] == ["torch", "paddle"]
    assert [p["step"] for p in report["points"]] == [0, 20, 40, 60, 80]
    assert all(p["n"] == {"torch": 3, "paddle": 3} for p in report["points"])
    decision = report["points"][-1]["decision"]
    assert report["final_outcome"] == "same" and decision["n"] == 3 and decision["margin"] == 0.02
    assert -0.02 < decision["low"] <= decision["high"] < 0.02 and report["first_separation"] is None
    assert "the same within ±2.0%" in report["final_verdict"] and "smallest difference it could detect" in \
        report["final_verdict"]
    final = report["points"][-1]
    assert final["mean"]["torch"] < report["points"][0]["mean"]["torch"] - 1.0  # it learned
    assert abs(final["diff"]) < 1e-3 and final["std"]["torch"] > 0  # same model, same batches; seeds differ
    # Time to target: both sides reach the reference's mean final eval loss on their mean curves.
    assert all(report["targets"][b]["curve_samples"] for b in ("torch", "paddle"))
    assert "Batches: identical on both sides in 3 of 3 seeds (micro-batch hashes)" in report["settings_differences"]
    # What a person reads: the verdict table and the time-to-target line on stdout; the files beside.
    assert "the same within ±2.0%" in done.stdout and "time to target" in done.stdout and "like-for-like" in done.stdout
    for name in ("converge.md", "converge.html", "converge.csv", "curves.csv", "converge.png"):
        assert (out / name).stat().st_size > 0, name
    # The speed: measured once per side, longer at once (the curves' pace puts the recipe's window under 5 s).
    assert not (out / "speed").exists() and "at the learning curves' pace" in done.stdout + done.stderr
    assert all(json.loads((out / "speed-window" / b / "summary.json").read_text())["setup"]["measure_steps"] == 40
               for b in ("torch", "paddle"))
    assert "seeds 0, 1, 2: torch exports their starts (one process)" in done.stderr  # one adapter start for three
    for seed in (0, 1, 2):  # both sides of a seed loaded one export
        specs = [json.loads((out / f"seed-{seed}" / b / "spec.json").read_text()) for b in ("torch", "paddle")]
        assert specs[0]["model"]["weights"] == specs[1]["model"]["weights"] == str(out / f"seed-{seed}" / "weights")
        assert specs[0]["data"]["eval_samples"] == 24 and specs[0]["measure"]["seed"] == seed


def test_one_sided_precision_loss_names_that_side_worse(runs):
    out, _, (done, report), kept = runs
    assert done.returncode == 0, done.stderr[-3000:]
    assert kept, "the Paddle runs of the same spec were run again instead of kept"
    final = report["points"][-1]
    assert final["worse"] == "torch" and report["final_outcome"] == "better", report["headline"]  # paddle better
    # two-sided, the decision speaks of paddle (B) against torch (A, the reference): paddle/torch - 1 < 0
    assert final["decision"]["outcome"] == "better" and final["decision"]["high"] < 0 and final["diff"] < 0
    assert report["headline"][1].startswith("final eval loss (step 80): paddle better than torch by at least ")
    assert report["headline"][2].startswith("torch stays worse from step ")
    assert report["points"][0]["decision"]["outcome"] == "same"  # the same start: nothing to tell yet
    assert "deliberate difference (torch: " in report["headline"][0]  # never "like-for-like" alone
    assert report["target_source"].startswith("paddle mean final eval loss")  # not the changed side's
    # The difference is deliberate and shown, never silent: the override and the applied master weights.
    lines = "\n".join(report["settings_differences"])
    assert "master_weights" in lines and "override" in lines, lines
    torch_spec = json.loads((out / "seed-0" / "torch" / "spec.json").read_text())
    assert torch_spec["precision"] == {"dtype": "bf16", "amp_level": "O2", "master_weights": False}
    assert "paddle better than torch by at least" in done.stdout
