"""What each many-run command decides — which runs to start, in what order, and what their results mean: converge,
parity, bisect, selfcheck, sweep, maxbatch, nightly (and its suite file), explain; the bound of every count they
take (:mod:`~xfw.run.commands.counts`). Each launches through :mod:`xfw.run.launch`."""
