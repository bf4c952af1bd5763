"""xfw selfcheck on CPU: what CPU can check passes, what it cannot is listed with the reason, and
compare warns about a run through a path this machine has not passed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, require_interpreter

pytestmark = pytest.mark.contract


def xfw(*args, cwd):
    return subprocess.run([sys.executable, "-m", "xfw.cli", *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, timeout=900, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                              [str(ROOT), os.environ.get("PYTHONPATH", "")])})


@pytest.fixture(scope="module")
def checked(tmp_path_factory):
    require_interpreter("torch")
    require_interpreter("paddle")
    here = tmp_path_factory.mktemp("machine")
    (here / "recipes").symlink_to(ROOT / "recipes")
    done = xfw("selfcheck", "--families", "llava", "--paths", "bf16-o1,stage2", cwd=here)
    return here, done


def verdicts(here) -> dict:
    data = json.loads((here / "runs" / "selfcheck" / "selfcheck.json").read_text())
    return {(v["backend"], v["path"]): v for v in data["verdicts"]}


def test_selfcheck_passes_what_cpu_can_and_says_why_for_the_rest(checked):
    here, done = checked
    assert done.returncode == 0, done.stdout + done.stderr
    found = verdicts(here)
    assert found[("torch", "fp32")]["verdict"] == "pass" and found[("paddle", "fp32")]["verdict"] == "pass"
    assert found[("torch", "bf16-o1")]["verdict"] == "pass"
    assert found[("torch", "stage2")]["verdict"] == "pass"  # FSDP2 over gloo, loss equal to one process
    paddle_amp = found[("paddle", "bf16-o1")]
    assert paddle_amp["verdict"] == "not checked" and "ignores AMP" in paddle_amp["detail"]
    stage2 = found[("paddle", "stage2")]
    described = json.loads((here / "runs" / "selfcheck" / "selfcheck.json").read_text())["env"]["backends"]["paddle"]
    if described.get("cpu_test_device"):  # group_sharded_parallel ran on the CPU test device, and it says so
        assert stage2["verdict"] == "pass" and "CPU test device (testcpu)" in stage2["detail"], stage2
    else:
        assert stage2["verdict"] == "not checked" and "backends.paddle.device=testcpu" in stage2["detail"]
    assert "Could not be checked on this machine" in done.stdout


def test_compare_warns_about_a_path_this_machine_has_not_passed(checked, tmp_path):
    here, _ = checked
    bf16 = ["--set", "precision.dtype=bf16", "--set", "precision.amp_level=O1", "--set", "measure.steps=2"]
    paddle = xfw("run", "recipes/tiny/llava_sft.yaml", "--backend", "paddle", *bf16, "--out", here / "p", cwd=here)
    assert "paddle bf16-o1: selfcheck says not checked here" in paddle.stdout + paddle.stderr
    torch = xfw("run", "recipes/tiny/llava_sft.yaml", "--backend", "torch", *bf16, "--out", here / "t", cwd=here)
    assert torch.returncode == 0 and "bf16-o1" not in torch.stdout + torch.stderr  # passed here: no warning
    elsewhere = tmp_path / "new-machine"
    elsewhere.mkdir()
    (elsewhere / "recipes").symlink_to(ROOT / "recipes")
    fresh = xfw("run", "recipes/tiny/llava_sft.yaml", "--backend", "torch", *bf16, "--out", elsewhere / "t",
                cwd=elsewhere)
    assert "torch bf16-o1: never selfchecked on this machine" in fresh.stdout  # in the report's warnings too
