"""xfw converge refuses bad input before anything launches: one line naming the key, exit 2.

No framework runs here: every refusal comes from checking the options and the recipe (real data is
prepared with the CLI environment's tokenizers and Pillow). The held-out split itself is checked in
xfw.contract.batches: fixed for every seed, never trained on, the same rule MicroBatches follows.
"""

import json
import shutil

import numpy as np
import pytest
from click.testing import CliRunner

from conftest import ROOT
from xfw import cli
from xfw.contract.batches import held_out

RECIPE = str(ROOT / "recipes" / "tiny" / "llava_json_sft.yaml")


def converge(*args):
    return CliRunner().invoke(cli.main, ["converge", RECIPE, *args, "--python", "torch=/nonexistent/python"])


@pytest.mark.parametrize("args, says", [
    (["--seeds", "0"], "--seeds"),
    (["--eval-every", "0"], "--eval-every"),
    (["--target", "low"], "--target"),
    (["--steps", "10", "--eval-every", "25"], "--steps: 10 is fewer than --eval-every 25"),
    (["--eval-samples", "5000"], "data.eval_samples: 5000 held out of a data set of 240 samples"),
    (["--set", "data.eval_samples=-1"], "data.eval_samples"),
    (["--backends", "torch"], "exactly two backends"),
    (["--margin", "0"], "--margin: 0 must be above 0"),
    (["--margin", "-0.01"], "--margin"),
    (["--margin", "two"], "--margin: 'two' is not a number"),
    (["--margin", "nan"], "--margin"),
    (["--seeds", "auto"], "--seeds auto: needs --max-seeds"),
    (["--seeds", "5", "--max-seeds", "3"], "--max-seeds: 3 (must be at least --seeds 5"),
    (["--seeds", "many"], "--seeds: 'many'"),
    (["--seeds", "1000000000"], "--seeds: 1000000000 (must be 1 to 100)"),
    (["--direction", "paddle-better"], "--direction: 'paddle-better'"),
    (["--target", "0"], "--target: 0.0"),
    (["--target", "-1"], "no curve can reach"),
])
def test_bad_input_is_one_line_naming_the_key_and_exit_2(args, says):
    result = converge(*args)
    assert result.exit_code == 2, result.output
    assert says in result.output, result.output
    assert "Traceback" not in result.output


def test_synthetic_data_is_refused_naming_data_kind():
    result = CliRunner().invoke(cli.main, ["converge", str(ROOT / "recipes" / "tiny" / "llava_sft.yaml")])
    assert result.exit_code == 2 and "data.kind: converge needs real data" in result.output, result.output


def test_an_eval_split_that_duplicates_training_samples_is_refused(tmp_path):
    data = ROOT / "recipes" / "tiny" / "data"
    samples = json.loads((data / "conversations.json").read_text())
    twice = samples[:20] + samples[:20]  # every sample twice: some copy lands in each split
    (tmp_path / "conversations.json").write_text(json.dumps(twice))
    shutil.copytree(data / "images", tmp_path / "images")
    result = converge("--set", f"data.path={tmp_path / 'conversations.json'}", "--set", f"data.image_root={tmp_path}",
                      "--eval-samples", "4")
    assert result.exit_code == 2 and "the eval split overlaps the training split" in result.output, result.output


def test_the_held_out_split_is_fixed_disjoint_and_independent_of_the_run_seed():
    train, held = held_out(240, 24)
    assert len(held) == 24 and len(train) == 216 and not set(train) & set(held)
    assert np.array_equal(held_out(240, 24)[1], held)  # the same split every time (no run seed in it)
    assert np.array_equal(held_out(10, 0)[0], np.arange(10)) and held_out(10, 0)[1].size == 0
    with pytest.raises(ValueError, match="data.eval_samples"):
        held_out(10, 10)


def test_training_never_reads_a_held_out_sample_and_each_epoch_covers_the_rest():
    from xfw.contract.batches import EvalBatches, MicroBatches
    from xfw.recipe import load_recipe
    from xfw.recipe.spec import resolve_spec

    recipe = load_recipe(RECIPE, ["data.eval_samples=24", "measure.warmup_steps=0", "measure.steps=108"])
    spec = resolve_spec(recipe, backend="torch", run_id="test")
    train, held = held_out(spec["data"]["num_samples"], 24)
    stream = MicroBatches(spec, rank=0)
    visited = [stream.sample_index(p) for p in range(2 * len(train))]  # two epochs of positions
    assert sorted(visited[:len(train)]) == sorted(visited[len(train):]) == list(train)
    evals = EvalBatches(spec)
    assert sum(evals.sizes) == 24 and len(evals) == 12
    first, again = evals[0][0], EvalBatches(spec)[0][0]  # the same held-out batch at every evaluation
    assert all(np.array_equal(first[k], again[k]) for k in first)


def test_the_speed_window_is_measured_longer_at_once_when_the_curves_pace_puts_it_under_the_minimum():
    from types import SimpleNamespace

    from xfw.run.commands.converge import curve_step_s, longer_steps, ordinary_first

    def run(backend, step_s, ok=True):
        return SimpleNamespace(backend=backend, ok=ok, measurement=SimpleNamespace(step_time_median_s=step_s))

    # the faster side's median over its curves; failed curves and sides without a pace do not count
    assert curve_step_s([run("torch", 0.03), run("torch", 0.05), run("torch", 0.04), run("paddle", 0.07),
                         run("paddle", 0.001, ok=False)]) == 0.04
    assert curve_step_s([run("torch", None)]) is None and curve_step_s([]) is None
    assert ordinary_first(8, None)  # no pace: the recipe's window first, as always
    assert ordinary_first(100, 0.05) and not ordinary_first(99, 0.05)  # 5 s is compare's minimum
    assert longer_steps(2, 0.03) == 40  # at most 20x the recipe's steps
    assert longer_steps(50, 0.05) == 201  # about 10 s
    assert longer_steps(50, 0.5) == 51  # always more than the recipe's


def test_the_starts_are_exported_by_one_process_and_a_failure_is_retried_seed_by_seed(tmp_path, monkeypatch):
    """One export process for every seed; when it fails, each seed again alone, so the failure names its seed
    and the other seeds keep their starts; a start already there (same spec) is kept, not exported again."""
    from xfw.run.commands import converge, parity
    from xfw.run.launch.launcher import Backend

    chosen = converge.plan(str(ROOT / "recipes" / "tiny" / "llava_json_sft.yaml"), [], backends=("paddle", "torch"),
                           seeds=3, steps=4, eval_every=2)
    calls = []

    def export_starts(backend, starts, timeout_s):
        calls.append([d.parent.name for d, _ in starts])
        if len(starts) > 1 or starts[0][0].parent.name == "seed-1":
            raise parity.ParityError("backend 'torch': could not export the initial weights (boom)")
        starts[0][0].mkdir(parents=True, exist_ok=True)
        (starts[0][0] / "model.safetensors").write_bytes(b"x")
        (starts[0][0] / "spec.json").write_text(json.dumps(starts[0][1]))

    monkeypatch.setattr(parity, "export_starts", export_starts)
    torch = Backend("torch", "python")
    lines = []
    done = converge._export_seeds(chosen, [0, 1, 2], torch, tmp_path, log=lines.append)
    assert calls == [["seed-0", "seed-1", "seed-2"], ["seed-0"], ["seed-1"], ["seed-2"]]
    assert done[0] is True and done[2] is True and str(done[1]) == (
        "seed 1: backend 'torch': could not export the initial weights (boom)")
    assert lines == ["seeds 0, 1, 2: torch exports their starts (one process)"]
    calls.clear()
    again = converge._export_seeds(chosen, [0, 1, 2], torch, tmp_path)  # a rerun: 0 and 2 kept, 1 alone
    assert again[0] is False and again[2] is False and isinstance(again[1], converge.ConvergeError)
    assert calls == [["seed-1"]]
