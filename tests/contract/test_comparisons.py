"""Both comparisons on CPU, both backends, as a user runs them (issue 22's done-when):

    xfw compare recipes/tiny/llava_sft.yaml --as published
    xfw compare recipes/tiny/llava_sft.yaml --as like-for-like --set backends.paddle.env.X=... --set backends.torch.env.Y=...

Each report says which comparison it is; the published one lists every setting it applied with its
source and what this CPU could not carry out; the variables reach every adapter process and the
settings table; the mechanisms each side carried out are in ``applied``."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
XFW = ROOT / ".venv" / "torch" / "bin" / "xfw"
SHORT = ["--set", "measure.warmup_steps=1", "--set", "measure.steps=3"]


def _compare(out: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(XFW), "compare", "recipes/tiny/llava_sft.yaml", "--backends", "paddle,torch",
                           "--out", str(out), *SHORT, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def _applied(out: Path, backend: str) -> dict:
    lines = (out / "tiny-llava-sft" / backend / "steps.jsonl").read_text().splitlines()
    return next(json.loads(line) for line in lines if '"kind": "applied"' in line or '"kind":"applied"' in line)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("comparisons")
    published = _compare(base / "published", "--as", "published")
    like = _compare(base / "like", "--as", "like-for-like", "--set", "backends.paddle.env.XFW_TEST_FLAG_P=on",
                    "--set", "backends.torch.env.OMP_PROC_BIND=false")
    return base, published, like


def test_both_comparisons_run_on_both_backends(runs):
    _, published, like = runs
    assert published.returncode == 0, published.stdout[-2000:] + published.stderr[-2000:]
    assert like.returncode == 2  # XFW_* is xfw's own: refused in one line, nothing launched
    assert "XFW_TEST_FLAG_P" in like.stderr and "Traceback" not in like.stderr


def test_the_published_report_names_its_comparison_and_every_source(runs):
    base, published, _ = runs
    report = (base / "published" / "report.md").read_text()
    assert "**Published comparison: each side as its own benchmark script ran it" in report
    assert "| torch | sharding_impl | deepspeed | PaddlePaddle/benchmark@208ccca835b8:" in report
    assert "| paddle | env.NVIDIA_TF32_OVERRIDE | 0 | PaddlePaddle/PaddleMIX@" in report
    # what a CPU cannot carry out is said, never dropped
    assert "torch: attn_implementation: asked flash_attention_2, ran sdpa: needs a CUDA device" in report
    assert "torch: tf32: asked true: a CPU has no TF32" in report
    # matmul and convolution TF32 apart, as the scripts set them; Paddle's stage 2 without overlap, with its source
    assert "torch: tf32_conv: asked true: a CPU has no TF32 (fp32 convolutions ran)" in report
    assert "| paddle | stage2_overlap | False | PaddlePaddle/PaddleNLP@418c3a511dcf:paddlenlp/trainer/trainer.py#L2133 |" in report
    assert "| mechanism.comm_overlap | n/a (one process) | n/a (one process) |" in report
    assert "ips as its script defined it" in report
    csv = (base / "published" / "report.csv").read_text()
    assert "published" in csv.splitlines()[1]


def test_variables_reach_the_adapter_processes_and_the_settings_table(runs, tmp_path):
    base, _, _ = runs
    applied = _applied(base / "published", "paddle")
    assert applied["env"]["NVIDIA_TF32_OVERRIDE"] == "0"  # as the adapter process saw it
    assert applied["env"]["FLAGS_cudnn_deterministic"] == "1"
    report = (base / "published" / "report.md").read_text()
    assert "| env.FLAGS_cudnn_deterministic | 1 | (not set) | ⚠ differs |" in report
    torch_applied = _applied(base / "published", "torch")
    assert torch_applied["mechanisms"]["optimizer_impl"] == "foreach"  # the script's adamw_torch, carried out
    assert torch_applied["not_honoured"]["sharding_impl"].startswith("asked deepspeed, ran none: this recipe runs one process")


def test_like_for_like_lists_what_it_leaves_out(tmp_path):
    out = tmp_path / "like"
    done = _compare(out, "--backends", "torch", "--set", "backends.torch.env.OMP_PROC_BIND=false")
    assert done.returncode == 0, done.stderr[-2000:]
    report = (out / "report.md").read_text()
    # One backend: the heading says so, never "on both sides".
    assert ("**Like-for-like settings, one backend (torch): the recipe as it says, nothing compared against another "
            "side.**") in report
    assert "deliberately does not" in report and "torch: attn_implementation = flash_attention_2" in report
    assert _applied(out, "torch")["env"] == {"OMP_PROC_BIND": "false"}
    assert "| env.OMP_PROC_BIND | false |" in report
