"""The multi-process launcher the Paddle adapter describes (``describe()["launcher"]``):
``paddle.distributed.launch`` with the CPU test device's environment (``xfw_paddle.testdevice.env``)
set first when the spec asks for it, so that the launcher finds the device (backend XCCL, one device
per rank) and every rank inherits it::

    python -m xfw_paddle.launch --nnodes 1 ... .../xfw_paddle/__main__.py --spec RUN/spec.json --records ...

Without ``backends.paddle.device: testcpu`` it is ``paddle.distributed.launch`` unchanged.
"""

from __future__ import annotations

import json
import os
import runpy
import sys


def wants_testdevice(argv: list[str]) -> bool:
    """Whether the spec after ``--spec`` in ``argv`` asks for the test device (False when unreadable:
    the adapter then reports the spec's problem itself)."""
    try:
        path = argv[argv.index("--spec") + 1]
        with open(path, encoding="utf-8") as f:
            spec = json.load(f)
        return spec.get("backend_knobs", {}).get("device") == "testcpu"
    except (ValueError, IndexError, OSError, AttributeError):
        return False


def prepare_testdevice(argv: list[str]) -> None:
    """Put the test device's environment into this process before Paddle is imported, when the spec
    asks for it and the device is built (else the session reports ``unsupported`` and why)."""
    if "paddle" in sys.modules or not wants_testdevice(argv):
        return
    from xfw_paddle import testdevice

    if testdevice.available():
        os.environ.update(testdevice.env())


if __name__ == "__main__":
    prepare_testdevice(sys.argv)
    sys.argv[0] = "paddle.distributed.launch"
    runpy.run_module("paddle.distributed.launch", run_name="__main__", alter_sys=True)
