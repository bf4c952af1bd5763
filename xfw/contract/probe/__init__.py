"""The probe: xfw's measurement inside a training command it did not write.

A recipe may give a backend a command instead of one of xfw's models (``backends.<name>.command``,
:mod:`xfw.recipe.command`). The launcher starts it with this package importable and these variables::

    XFW_PROBE_SPEC=RUN/spec.json  XFW_PROBE_RECORDS=RUN/steps.jsonl
    XFW_PROBE_HOOKS=xfw_torch.probe,xfw_paddle.probe
    PYTHONPATH=<xfw>/xfw/contract/probe/site:<xfw>:<xfw>/adapters/torch:<xfw>/adapters/paddle[:...]

Every Python process of the command then loads ``site/sitecustomize.py`` at start-up, which calls
:func:`activate`: the spec is read, and each hook module named in ``XFW_PROBE_HOOKS`` says which
modules to watch (``{"torch": install, "transformers.trainer": install_trainer}``); its hooks go in
when the script imports those (:mod:`~xfw.contract.probe.imports`), never before, so the probe
imports no framework. The hooks report steps, batches and models to one
:class:`~xfw.contract.probe.core.Probe`, which writes ``steps.jsonl`` exactly as xfw's adapters
do: the core's statistics, reports and nightly verdicts apply unchanged.

Standard library only: this runs in the user's interpreter, which may have nothing but its own
training stack (no numpy, no PyYAML, no xfw installed).
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path

from xfw.contract.probe.variables import ENV_HOOKS, ENV_RECORDS, ENV_SPEC, ENV_TOKEN, STAMP  # noqa: F401
SITE_DIR = Path(__file__).resolve().with_name("site")
"""Holds only ``sitecustomize.py``; the launcher puts it first on the command's PYTHONPATH."""


def activate(environ: dict | None = None):
    """Start the probe in this process when xfw's variables are set; returns it (None otherwise)."""
    from xfw.contract.probe.core import Probe
    from xfw.contract.probe.imports import when_imported

    environ = os.environ if environ is None else environ
    if not environ.get(ENV_SPEC) or not environ.get(ENV_RECORDS):
        return None
    with open(environ[ENV_SPEC], encoding="utf-8") as f:
        spec = json.load(f)
    probe = Probe(spec, environ[ENV_RECORDS], token=environ.get(ENV_TOKEN, ""))
    for name in filter(None, environ.get(ENV_HOOKS, "").split(",")):
        hooks = importlib.import_module(name).hooks()
        for module_name, install in hooks.items():
            when_imported(module_name, lambda module, install=install: _install(probe, install, module))
    return probe


def _install(probe, install, module) -> None:
    """One framework's hooks, installed as its module finishes importing; a failure turns the probe
    off and is recorded, the import itself goes on."""
    if probe.disabled:
        return
    try:
        install(module, probe)
    except Exception as err:  # noqa: BLE001 - never break the script's import
        probe.fail(err)
