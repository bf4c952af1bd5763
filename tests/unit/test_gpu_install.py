"""The GPU install (docs/gpu.md, scripts/setup.sh --gpu): what can be checked without a GPU.

* the GPU requirement files hold no CPU-only pin (no CPU `paddlepaddle`, no `+cpu` build, no `-r` of the CPU
  files) and parse as requirements; their shared pins agree with the CPU files;
* `setup.sh --gpu` refuses a CUDA version it does not know in one line, before touching anything;
* the packages that should come from the default index resolve there (a metadata-only dry run; sdists by their
  version list), and torch's pinned wheel there is a CUDA build. Skipped only when no network reaches the index.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
TORCH_GPU = ROOT / "adapters/torch/requirements-gpu.txt"
TORCH_GPU_LATE = ROOT / "adapters/torch/requirements-gpu-no-build-isolation.txt"
PADDLE_GPU = ROOT / "adapters/paddle/requirements-gpu.txt"
GPU_FILES = (TORCH_GPU, TORCH_GPU_LATE, PADDLE_GPU)
SETUP = ROOT / "scripts/setup.sh"
NETWORK_ERRORS = ("NewConnectionError", "Network is unreachable", "Temporary failure in name resolution",
                  "Name or service not known", "Max retries exceeded", "ConnectTimeout", "ReadTimeout",
                  "Connection refused", "ProxyError", "SSLError")


def _lines(path: Path) -> list[str]:
    out = []
    for raw in path.read_text().splitlines():
        line = raw.split(" #", 1)[0].strip()
        if line and not line.startswith("#"):
            out.append(line)
    return out


def _requirements(path: Path) -> dict[str, Requirement]:
    reqs = {}
    for line in _lines(path):
        assert not line.startswith("-"), f"{path.name}: option line {line!r} (indexes are named by setup.sh)"
        req = Requirement(line)  # raises on anything that is not a requirement
        assert req.name.lower() not in reqs, f"{path.name}: {req.name} twice"
        reqs[req.name.lower()] = req
    return reqs


def _pin(req: Requirement) -> str:
    (spec,) = req.specifier
    assert spec.operator == "==", f"{req} is not pinned"
    return spec.version


def test_gpu_files_parse_and_pin_every_package():
    for path in GPU_FILES:
        reqs = _requirements(path)
        assert reqs, f"{path.name} is empty"
        for req in reqs.values():
            _pin(req)


def test_no_cpu_only_pin_leaks_into_a_gpu_file():
    for path in GPU_FILES:
        text = path.read_text()
        assert "+cpu" not in text, path.name
        assert "requirements.txt" not in " ".join(_lines(path)), f"{path.name} includes a CPU file"
        assert "paddlepaddle" not in _requirements(path), f"{path.name} pins the CPU paddlepaddle"
    paddle = _requirements(PADDLE_GPU)
    assert "paddlepaddle-gpu" in paddle
    assert set(_requirements(TORCH_GPU)) >= {"torch"}
    assert set(_requirements(TORCH_GPU_LATE)) == {"deepspeed", "flash-attn"}


def test_gpu_files_keep_the_cpu_files_other_pins():
    pairs = ((TORCH_GPU, ROOT / "adapters/torch/requirements.txt"),
             (PADDLE_GPU, ROOT / "adapters/paddle/requirements.txt"),
             (TORCH_GPU_LATE, ROOT / "adapters/torch/requirements-no-build-isolation.txt"))
    for gpu, cpu in pairs:
        gpu_reqs, cpu_reqs = _requirements(gpu), _requirements(cpu)
        cpu_reqs.pop("paddlepaddle", None)
        gpu_reqs.pop("paddlepaddle-gpu", None)
        gpu_reqs.pop("flash-attn", None)
        assert set(gpu_reqs) == set(cpu_reqs), f"{gpu.name} vs {cpu.name}"
        for name in cpu_reqs:
            assert _pin(gpu_reqs[name]) == _pin(cpu_reqs[name]), f"{name}: {gpu.name} vs {cpu.name}"
    assert _pin(_requirements(PADDLE_GPU)["paddlepaddle-gpu"]) == \
        _pin(_requirements(ROOT / "adapters/paddle/requirements.txt")["paddlepaddle"])


@pytest.mark.parametrize("args", [["--gpu", "11.2"], ["--gpu"], ["--gpu", "12.6.1"], ["--gpu", "12.6; rm"],
                                  ["--cpu"]])
def test_setup_refuses_bad_arguments_in_one_line(args, tmp_path):
    before = sorted(p.name for p in (ROOT / ".venv").iterdir()) if (ROOT / ".venv").is_dir() else []
    proc = subprocess.run(["bash", str(SETUP), *args], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("scripts/setup.sh: ")
    assert "--gpu" in lines[0] or "unknown argument" in lines[0]
    after = sorted(p.name for p in (ROOT / ".venv").iterdir()) if (ROOT / ".venv").is_dir() else []
    assert after == before


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a driver is here: --gpu would really build")
def test_setup_gpu_refuses_without_a_driver():
    proc = subprocess.run(["bash", str(SETUP), "--gpu", "12.6"], capture_output=True, text=True, timeout=30,
                          env={**os.environ, "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "nvidia-smi" in proc.stderr


def _pip(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    """pip against the default index only: no config file, no local wheel directory, no constraints."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_DEFAULT_TIMEOUT="20")
    if os.environ.get("PIP_CERT"):
        env["PIP_CERT"] = os.environ["PIP_CERT"]
    proc = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, timeout=120,
                          env=env, cwd=tmp_path)
    if proc.returncode != 0 and any(marker in proc.stderr for marker in NETWORK_ERRORS):
        first = next((ln for ln in proc.stderr.splitlines() if any(m in ln for m in NETWORK_ERRORS)), "")
        pytest.skip(f"no network reaches the package index: {first.strip()[:200]}")
    return proc


@pytest.fixture(scope="module")
def default_index_wheels(tmp_path_factory):
    """One metadata-only dry run of every wheel the GPU files take from the default index."""
    tmp = tmp_path_factory.mktemp("pip")
    wanted = [str(r) for path in (TORCH_GPU, PADDLE_GPU) for name, r in _requirements(path).items()
              if name != "paddlepaddle-gpu"]  # Paddle's own index only (setup.sh --gpu adds it)
    report = tmp / "report.json"
    proc = _pip(["install", "--dry-run", "--no-deps", "--ignore-installed", "--only-binary=:all:",
                 "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
                 "--platform", "manylinux2014_x86_64", "--python-version", "3.11", "--target", str(tmp / "t"),
                 "--quiet", "--report", str(report), *wanted], tmp)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return {i["metadata"]["name"].lower().replace("_", "-"): i for i in json.loads(report.read_text())["install"]}


def test_default_index_resolves_every_wheel_pin(default_index_wheels):
    for path in (TORCH_GPU, PADDLE_GPU):
        for name, req in _requirements(path).items():
            if name == "paddlepaddle-gpu":
                continue
            got = default_index_wheels[name.replace("_", "-")]
            assert got["metadata"]["version"] == _pin(req), name


def test_torch_pin_is_a_cuda_build_on_the_default_index(default_index_wheels):
    torch = default_index_wheels["torch"]
    assert "+cpu" not in torch["metadata"]["version"] and "+cpu" not in torch["download_info"]["url"]
    requires = " ".join(torch["metadata"].get("requires_dist", []))
    assert "cuda-toolkit" in requires or "nvidia-cudnn" in requires, requires[:500]


def test_source_packages_are_published_on_the_default_index(tmp_path):
    for name, req in _requirements(TORCH_GPU_LATE).items():
        proc = _pip(["index", "versions", name], tmp_path)
        assert proc.returncode == 0, proc.stderr[-1000:]
        versions = proc.stdout.split("Available versions:", 1)[1].split("\n", 1)[0]
        assert _pin(req) in [v.strip() for v in versions.split(",")], f"{name} {_pin(req)} not in {versions[:200]}"
