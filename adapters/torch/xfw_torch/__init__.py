"""xfw's PyTorch adapter: ``python -m xfw_torch --spec spec.json --records steps.jsonl``.

Builds the neutral architecture in the spec with transformers, trains it through the core's
shared loop (``xfw.contract.harness``), and reports the settings it actually applied.
"""
