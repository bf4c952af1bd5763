"""Commands shaped like the upstream training scripts users attach to (issue 26), measured under the
probe with the real frameworks on CPU: examples/attach/torch_diffusers_lora.py (transformers and
peft imported before torch after a spec look-up, accelerate with accumulation 2 and bf16 autocast,
its prefetching loader, gradient checkpointing, LoRA, a tqdm bar) and paddle_ppdiffusers_lora.py
(paddle through importlib, ppdiffusers with recompute, accumulation 2, auto_cast). One compare of
both and two torch runs at module scope (about a minute on 2 cores); and a plain torch loop whose
torch is looked up, then imported from a thread (a few seconds).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from xfw.contract.records import read_records

from conftest import ROOT, require_interpreter

pytestmark = pytest.mark.contract
RECIPE = ROOT / "examples" / "attach" / "diffusers_lora.yaml"
NAME = "tiny-sd15-attach-diffusers"
# YAML-quoted; the unit group reads the bar when it switches to s/it (a step over a second: a loaded machine)
TQDM = r"steps_per_s='Steps: +\d+%\|[^|]*\| *(?P<step>\d+)/\d+ \[[^,\]]*, *([0-9.]+)(?P<unit>it/s|s/it)'"


def xfw(*args):
    python = require_interpreter("torch")
    require_interpreter("paddle")
    return subprocess.run([str(python), "-m", "xfw.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("shapes")
    both = xfw("compare", RECIPE, "--backends", "paddle,torch", "--out", out / "both")
    fp32 = xfw("run", RECIPE, "--backend", "torch", "--out", out / "fp32", "--set", "backends.torch.command.9=no",
               "--set", "backends.torch.command.2=--no-gradient-checkpointing",
               "--set", "backends.torch.command.3=--max-steps=100")
    bar = xfw("run", RECIPE, "--backend", "torch", "--out", out / "bar", "--set", f"backends.torch.log_pattern.{TQDM}",
              "--set", "backends.torch.log_pattern.after=Running training",
              "--set", "backends.torch.log_pattern.stream=stderr")
    return {"both": (both, out / "both"), "fp32": (fp32, out / "fp32"), "bar": (bar, out / "bar")}


def records(out: Path, backend: str) -> tuple[list[dict], dict]:
    found, problem = read_records(out / NAME / backend / "steps.jsonl")
    assert problem == ""
    return [r for r in found if r["kind"] == "step"], next((r for r in found if r["kind"] == "applied"), {})


def test_a_diffusers_accelerate_script_is_measured_as_it_trains(runs):
    result, out = runs["both"]
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    steps, applied = records(out, "torch")
    assert [r["samples"] for r in steps] == [8, 8, 8, 8]  # 2 micro-batches of 4 reached the UNet, every step
    assert (applied["micro_batch"], applied["grad_accum_steps"]) == (4, 2)
    assert (applied["compute_dtype"], applied["recompute"]) == ("bfloat16", True)  # accelerate's autocast, seen inside
    assert applied["version_diffusers"] and applied["version_accelerate"] and applied["version_peft"]
    assert re.search(r"parameters over UNet2DConditionModel \d+ \(trainable [1-9]\d*\), Encoder \d+ \(trainable 0\), "
                     r"CLIPTextModel \d+ \(trainable 0\)", applied["notes"]), applied["notes"]
    assert applied["params_by_module"]["CLIPTextModel"] == {"total": 49664, "trainable": 0}


def test_a_ppdiffusers_script_is_measured_as_it_trains(runs):
    result, out = runs["both"]
    steps, applied = records(out, "paddle")
    assert [r["samples"] for r in steps] == [8, 8, 8, 8]
    assert (applied["micro_batch"], applied["grad_accum_steps"], applied["recompute"]) == (4, 2, True)
    # Paddle's auto_cast(bfloat16) does nothing on a CPU: the layers ran float32, and the probe says so
    assert applied["compute_dtype"] == "float32" and applied["version_ppdiffusers"]
    assert "UNet2DConditionModel" in applied["notes"] and "CLIPTextModel" in applied["notes"]


def test_the_compare_of_the_two_reads_right(runs):
    result, _ = runs["both"]
    warnings = result.stdout.split("### Warnings", 1)[1].split("###", 1)[0]
    assert "grad_accum_steps differs" not in warnings and "recompute differs" not in warnings
    assert "compute_dtype differs: paddle=float32, torch=bfloat16" in warnings
    assert "the preset tiny-sd15 has 1,501,003" in warnings  # the decoder never ran in a training step
    assert re.search(r"\| torch \| the command's own \| the command's own \(samples counted from the inputs that "
                     r"reached UNet2DConditionModel's forward\) \|.*\| torch [^|]*\(transformers [^|]*diffusers 0\.42",
                     result.stdout)


def test_fp32_without_checkpointing_is_seen_as_such(runs):
    result, out = runs["fp32"]
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    _, applied = records(out, "torch")
    assert (applied["compute_dtype"], applied["amp_level"], applied["recompute"]) == ("float32", "O0", False)


def test_a_tqdm_bar_is_parsed_from_the_start_of_training_and_stops_the_command(runs):
    result, out = runs["bar"]
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    steps, applied = records(out, "torch")
    assert len(steps) == 4 and applied == {}
    assert all(0.01 < r["step_time_s"] ** -1 < 1000 for r in steps)  # a training step's rate, not loading's
    assert "100/100" not in (out / NAME / "torch" / "stderr.log").read_text()  # stopped after 4 steps


THREAD_IMPORT = """
    import importlib, importlib.util, threading
    assert importlib.util.find_spec("torch") is not None  # a look-up first, as datasets does
    loading = threading.Thread(target=importlib.import_module, args=("torch",))  # then imported from a thread
    loading.start()
    loading.join()
    torch = importlib.import_module("torch")
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(100):
        model(torch.randn(4, 8)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
"""


def test_torch_looked_up_then_imported_from_a_thread_is_measured(tmp_path):
    from test_attach_real import run_script

    result = run_script(tmp_path, "torch", THREAD_IMPORT, [])
    assert result.status == "ok", result.reason
    found, problem = read_records(tmp_path / "out" / "torch" / "steps.jsonl")
    assert problem == "" and [r["samples"] for r in found if r["kind"] == "step"][1:] == [4, 4, 4]


UPSTREAM_MAKER = ROOT / "examples" / "attach" / "upstream" / "make_tiny_sd15.py"
# The maker runs as its own command line (runpy, as __main__), then the loaders read what it wrote from
# disk, in the same process: one framework import instead of two (issue 44).
MAKE_THEN = """
import runpy, sys
sys.argv = sys.argv[1:]  # MAKER FRAMEWORK PIPELINE_DIR DATA_DIR, the maker's own command line
runpy.run_path(sys.argv[0], run_name="__main__")
sys.argv = sys.argv[:1] + sys.argv[2:3]  # LOAD_CHECK reads PIPELINE_DIR as sys.argv[1]
"""
LOAD_CHECK = {
    # each library's own loaders read what the maker wrote, as the upstream example scripts load it
    "torch": """
import sys, torch
from diffusers import StableDiffusionPipeline
pipe = StableDiffusionPipeline.from_pretrained(sys.argv[1])
ids = pipe.tokenizer(["a picture number 3"], max_length=pipe.tokenizer.model_max_length, padding="max_length",
                     truncation=True, return_tensors="pt").input_ids
states = pipe.text_encoder(ids)[0]
latents = pipe.vae.encode(torch.zeros(1, 3, 32, 32)).latent_dist.sample()
out = pipe.unet(latents, torch.tensor([10]), states).sample
print(tuple(ids.shape), tuple(out.shape))
""",
    "paddle": """
import sys, paddle
from paddlenlp.transformers import CLIPTextModel, CLIPTokenizer
from ppdiffusers import AutoencoderKL, UNet2DConditionModel
root = sys.argv[1]
tok = CLIPTokenizer.from_pretrained(root + "/tokenizer")
ids = paddle.to_tensor([tok("a picture number 3", max_length=tok.model_max_length, padding="max_length",
                            truncation=True)["input_ids"]])
states = CLIPTextModel.from_pretrained(root + "/text_encoder")(ids)[0]
latents = AutoencoderKL.from_pretrained(root, subfolder="vae").encode(paddle.zeros([1, 3, 32, 32])).latent_dist.sample()
out = UNet2DConditionModel.from_pretrained(root, subfolder="unet")(latents, paddle.to_tensor([10]), states).sample
print(tuple(ids.shape), tuple(out.shape))
""",
}


@pytest.mark.parametrize("framework", ["torch", "paddle"])
def test_the_upstream_examples_tiny_pipeline_loads_with_each_librarys_own_loaders(tmp_path, framework):
    """examples/attach/upstream/make_tiny_sd15.py (docs/attach.md, "The upstream scripts themselves")
    writes what diffusers' and ppdiffusers' own loaders read; a text-to-UNet pass runs on it."""
    python = str(require_interpreter(framework))
    loaded = subprocess.run([python, "-c", MAKE_THEN + LOAD_CHECK[framework], str(UPSTREAM_MAKER), framework,
                             str(tmp_path / "pipe"), str(tmp_path / "images")], capture_output=True, text=True,
                            timeout=300)
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    assert f"{framework} pipeline in {tmp_path / 'pipe'}" in loaded.stdout  # the maker ran to its end
    assert len(list((tmp_path / "images").glob("*.png"))) == 32
    assert (tmp_path / "images" / "metadata.jsonl").read_text().count("\n") == 32
    assert loaded.stdout.strip().splitlines()[-1] == "(1, 16) (1, 4, 16, 16)"  # ids, the UNet's output
