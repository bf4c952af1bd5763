"""Parity's module probe, its file format: every parameter-owning module's output on the first
batch, in call order, under its canonical name, written by each adapter's ``--probe-modules FILE``::

    write_probe("run/modules.json", [("model.language_model.norm", array), ...])
    # run/modules.json          {"modules": [{"name", "norm", "shape"}, ...], "outputs": "modules.safetensors"}
    # run/modules.safetensors   the outputs themselves, float32, one tensor per module
    modules, outputs = read_probe("run/modules.json")

The outputs are kept whole so parity can compare them element by element (``xfw.report.parity``):
an output norm alone misses a change that keeps it, a negated norm weight for one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from xfw.contract.atomic import write_json_atomic
from xfw.contract.weights import load_file, save_file


def write_probe(path: str | os.PathLike, found: list[tuple[str, np.ndarray]]) -> None:
    path = Path(path)
    outputs = path.with_suffix(".safetensors")
    arrays = {name: np.asarray(value, dtype=np.float32) for name, value in found}
    save_file(arrays, outputs)
    modules = [{"name": name, "norm": float(np.linalg.norm(value.astype(np.float64))), "shape": list(value.shape)}
               for name, value in found]
    write_json_atomic(path, {"modules": modules, "outputs": outputs.name})


def read_probe(path: str | os.PathLike) -> tuple[list[dict], dict[str, np.ndarray]]:
    """(modules in call order, their outputs by name); outputs {} for a probe written before they were kept."""
    path = Path(path)
    data = json.loads(path.read_text())
    modules = data["modules"]
    outputs = load_file(path.parent / data["outputs"]) if data.get("outputs") else {}
    return modules, outputs
