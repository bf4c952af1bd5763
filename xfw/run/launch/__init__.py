"""How one run starts and ends: the adapter process, the one job runner and where its jobs run (local or Slurm),
the output lock, the guard every started process lives under, backend instances (builds) and attached commands.
Imports nothing from :mod:`xfw.run.commands`."""
