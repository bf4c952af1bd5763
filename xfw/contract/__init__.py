"""The adapter contract: everything an adapter may import from xfw, and nothing else.

An adapter (``xfw_torch``, ``xfw_paddle``, ...) runs in its own interpreter beside its own
framework, so this layer needs only numpy and the standard library: no pandas, click or
matplotlib, and never a framework (``tests/unit/test_boundaries.py`` holds it to that).

* :mod:`~xfw.contract.harness`  the training-and-timing loop both adapters run, and their entry point
* :mod:`~xfw.contract.records`  the ``steps.jsonl`` record format adapters write
* :mod:`~xfw.contract.synthetic`  seeded batches, identical for every backend
* :mod:`~xfw.contract.presets`, :mod:`~xfw.contract.families`  neutral architectures and each family's facts
* :mod:`~xfw.contract.weights`, :mod:`~xfw.contract.hf_names`  the neutral checkpoint format
* :mod:`~xfw.contract.env`, :mod:`~xfw.contract.atomic`  host facts; atomic file writes
"""
