"""Running: recipes in, run directories out. Three folders, one concern each:

* :mod:`xfw.run.launch`  how one run starts and ends: the adapter process (:mod:`~xfw.run.launch.launcher`), the one
  job runner and its executors (:mod:`~xfw.run.launch.jobs`, local or :mod:`~xfw.run.launch.slurm`), the output
  lock, the guard and short tasks, backend instances (builds) and attached commands
* :mod:`xfw.run.data`  real data: read, check and prepare (``prepare_data`` is the one writer of the cache)
* :mod:`xfw.run.commands`  what each many-run command decides: which runs to start and what they mean
  (converge, parity, bisect, selfcheck, sweep, maxbatch, nightly and its suite, explain)

Recipes themselves are :mod:`xfw.recipe` (same layer). Imports go down only: ``commands`` uses ``launch`` and
``data``, never the reverse; this layer reads :mod:`xfw.report` and :mod:`xfw.contract`; nothing below imports it.
"""
