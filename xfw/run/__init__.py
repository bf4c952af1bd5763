"""Running: recipes in, run directories out.

* :mod:`~xfw.recipe`  recipes: load, override, validate, resolve to ``spec.json``
* :mod:`~xfw.run.launcher`  one adapter process for one run, and side tasks (describe, export, probe)
* :mod:`~xfw.run.jobs`  the one job runner: keep a settled run, else launch, record its variant
* :mod:`~xfw.run.sweep`, :mod:`~xfw.run.maxbatch`, :mod:`~xfw.run.parity`  studies built on it
* :mod:`~xfw.run.suite`, :mod:`~xfw.run.nightly`  the nightly job

Imports go down only: this layer reads :mod:`xfw.report` (results, statistics) and
:mod:`xfw.contract`; nothing below imports it.
"""
