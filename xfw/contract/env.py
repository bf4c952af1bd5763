"""The environment a run happened in: host facts the core can read without a framework.

Framework-side facts (versions, GPU model, CUDA/cuDNN) come from the adapter's
``--describe`` and are merged in by the launcher, so ``env.json`` holds both::

    {"host": {"hostname": "...", "cpu": "AMD EPYC", "num_cpus": 2, "mem_total_bytes": ...},
     "python": "3.11.7", "date_utc": "2026-11-22T16:15:00Z", "xfw_git_sha": "3863397...",
     "backend": {"framework": "torch", "versions": {...}, "device_name": "..."}}
"""

from __future__ import annotations

import datetime as dt
import os
import platform
import subprocess
from pathlib import Path

import xfw


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def package_versions(names: tuple[str, ...]) -> dict[str, str]:
    """Installed versions from package metadata (no imports: paddlenlp's alone takes seconds)."""
    from importlib import metadata

    out = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def mem_total_bytes() -> int | None:
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def git_sha(root: Path | None = None) -> str | None:
    root = root or Path(xfw.__file__).resolve().parent.parent
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    sha = out.stdout.strip()
    if out.returncode or not sha:
        return None
    dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, timeout=10, check=False).stdout.strip()
    return sha + ("-dirty" if dirty else "")


def host_env() -> dict:
    return {
        "host": {
            "hostname": platform.node(), "os": platform.platform(), "cpu": cpu_model(),
            "num_cpus": os.cpu_count(), "mem_total_bytes": mem_total_bytes(),
        },
        "python": platform.python_version(),
        "date_utc": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "xfw_version": xfw.__version__,
        "xfw_git_sha": git_sha(),
        **({"slurm": {"job_id": os.environ["SLURM_JOB_ID"], "node": os.environ.get("SLURMD_NODENAME", ""),
                      "partition": os.environ.get("SLURM_JOB_PARTITION", ""),
                      "cluster": os.environ.get("SLURM_CLUSTER_NAME", "")}}
           if "SLURM_JOB_ID" in os.environ else {}),  # a run under Slurm (xfw.run.launch.slurm): which job, which node
    }
