"""xfw's PaddlePaddle adapter: ``python -m xfw_paddle --spec spec.json --records steps.jsonl``.

Builds the neutral architecture in the spec with Paddle and paddlenlp, trains it through the
core's shared loop (``xfw.contract.harness``), and reports the settings it actually applied.
"""
