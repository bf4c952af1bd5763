"""The probe's names: the variables that start it in a command's processes and the key that stamps its records.
Imports nothing, so the package (:mod:`xfw.contract.probe`, which re-exports them) and its core both read them."""

ENV_SPEC = "XFW_PROBE_SPEC"
ENV_RECORDS = "XFW_PROBE_RECORDS"
ENV_HOOKS = "XFW_PROBE_HOOKS"
ENV_TOKEN = "XFW_PROBE_TOKEN"
STAMP = "xfw_probe"
"""Each record the probe writes carries the run's token (``ENV_TOKEN``, drawn afresh by the launcher
for every run) under this key; the launcher keeps only stamped records and removes the stamp
(:func:`xfw.run.launch.attached.verify_records`): lines anyone else writes into the records file are
told apart, and the run is ``invalid``."""
