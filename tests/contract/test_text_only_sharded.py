"""A micro-batch of text-only samples on one rank of a sharded run: the same training as one process.

Real LLaVA data has samples without an image. A rank whose micro-batch holds only such samples used
to skip the vision tower, so the ranks' collectives no longer matched: PyTorch's FSDP2 stage 2 crashed
(gloo: "Received data size doesn't match expected size") and Paddle's stage 2 summed mismatched
gradients, then hung (found by xfw converge on the grown tiny data). Both adapters now run a zero image
through the tower and add 0 x its features (``idle_vision``), as LLaVA's trainer does. Here the data is
ordered so that rank 0's first micro-batch is text-only and rank 1's has images: stage 2 on two processes
must equal one process (the mean of the ranks' micro-batch losses is the one process's loss).
"""

import json
import subprocess

import pytest

from conftest import ROOT, require_interpreter

pytestmark = pytest.mark.contract

DATA = ROOT / "recipes" / "tiny" / "data"


@pytest.fixture(scope="module")
def text_first(tmp_path_factory):
    out = tmp_path_factory.mktemp("text-only")
    samples = json.loads((DATA / "conversations.json").read_text())
    text = [s for s in samples if "image" not in s][:2]
    images = [s for s in samples if "image" in s][:6]
    (out / "conversations.json").write_text(json.dumps(text + images))
    return out


def step_losses(out, backend, processes):
    run = out / f"{backend}-{processes}"
    xfw = ROOT / ".venv" / "torch" / "bin" / "xfw"
    done = subprocess.run(
        [str(xfw), "run", "recipes/tiny/llava_json_sft.yaml", "--backend", backend, "--out", str(run),
         "--set", f"data.path={out / 'conversations.json'}", "--set", f"data.image_root={DATA}",
         "--set", "data.shuffle=false", "--set", "measure.warmup_steps=0", "--set", "measure.steps=2",
         "--set", f"parallel.nproc_per_node={processes}",
         "--set", f"parallel.sharding={'stage2' if processes > 1 else 'none'}",
         "--set", "backends.paddle.device=testcpu"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    records = [json.loads(line) for line in (run / "tiny-llava-json-sft" / backend / "steps.jsonl").open()]
    by_step = {}
    for r in records:
        if r["kind"] == "step":
            by_step.setdefault(r["step"], []).append(r["loss"])
    return [sum(v) / len(v) for _, v in sorted(by_step.items())]


@pytest.mark.parametrize("backend", ["torch", "paddle"])
def test_stage2_with_a_text_only_micro_batch_equals_one_process(text_first, backend):
    require_interpreter(backend)
    one, two = step_losses(text_first, backend, 1), step_losses(text_first, backend, 2)
    assert len(one) == len(two) == 2
    assert two == pytest.approx(one, rel=1e-5)
