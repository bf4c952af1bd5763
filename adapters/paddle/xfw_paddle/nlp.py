"""PaddleNLP's modules, imported without the package's eager ``__init__``.

``import paddlenlp`` imports all of PaddleNLP first: Taskflow, data augmentation, its datasets
(HuggingFace ``datasets``), metrics (scikit-learn, SciPy), the server — 4.4 s of a 6 s start on
2 cores, for a run that needs only a Llama from ``paddlenlp.transformers`` (0.9 s). :func:`load`
imports a module the way the package itself would, in the package's own order (``data`` first: it
settles PaddleNLP's ``data <-> transformers`` circle; ``prompt`` before ``peft``: the
``peft -> trainer -> peft`` one), under a package module whose ``__init__`` did not run. It then
does the one thing that ``__init__`` does besides importing, ``paddle.disable_signal_handler()``,
so a run behaves the same either way. An ImportError on the first load (another PaddleNLP version,
another circle) drops the partial modules and imports the package whole, as before; on a later one
(a model may already hold classes of the modules loaded so far) it is raised, never a second copy.

The model and every computation are PaddleNLP's own code either way (tiny LLaVA trains to the same
losses bit for bit); only what is not used is not imported: a run's RSS after its model is built is
about 165 MiB lower (564 -> 399 MiB, tiny LLaVA), its training memory (peak minus that RSS) unchanged.
LoRA still needs most of PaddleNLP (``peft -> prompt -> trainer``). The SD families import ppdiffusers
through :func:`load_ppdiffusers`: ppdiffusers' patches import one PaddleNLP model module (CLAP), which
would import the package whole (3.7 s); loaded first as above, ppdiffusers and its SD models take
1.9 s instead of 3.4-4.6 (506 PaddleNLP modules instead of 709).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import sys
from types import ModuleType

BEFORE = {"paddlenlp.peft": ("paddlenlp.data", "paddlenlp.prompt")}
"""What PaddleNLP's own ``__init__`` imports before a module (default: ``paddlenlp.data``)."""


def _shell() -> bool:
    """Put a ``paddlenlp`` package whose ``__init__`` has not run into ``sys.modules`` (False: the
    package is already imported, whole or as this shell)."""
    if "paddlenlp" in sys.modules:
        return False
    spec = importlib.util.find_spec("paddlenlp")
    package = importlib.util.module_from_spec(spec)  # the module, its __path__, not its code
    package.__version__ = importlib.metadata.version("paddlenlp")
    package.xfw_shell = True  # how a reader of sys.modules can tell (and how load() knows)
    sys.modules["paddlenlp"] = package
    return True


def _drop_partial() -> None:
    for name in [n for n in sys.modules if n == "paddlenlp" or n.startswith("paddlenlp.")]:
        del sys.modules[name]


def load(name: str) -> ModuleType:
    """``importlib.import_module(name)`` for a PaddleNLP module, without the rest of PaddleNLP."""
    fresh = _shell()
    if not getattr(sys.modules["paddlenlp"], "xfw_shell", False):
        return importlib.import_module(name)
    try:
        for first in BEFORE.get(name, ("paddlenlp.data",)):
            importlib.import_module(first)
        module = importlib.import_module(name)
    except ImportError:
        if not fresh:  # a model may already be built from the modules loaded so far: no second copy of them
            raise
        _drop_partial()
        importlib.import_module("paddlenlp")
        return importlib.import_module(name)
    if fresh:
        import paddle

        paddle.disable_signal_handler()  # the rest of PaddleNLP's __init__
    return module


PPDIFFUSERS_NEEDS = "paddlenlp.transformers.clap.modeling"
"""The PaddleNLP module ppdiffusers' own ``__init__`` imports (``ppdiffusers.patches.converter``)."""


def load_ppdiffusers() -> ModuleType:
    """``import ppdiffusers`` with the PaddleNLP module it imports loaded first by :func:`load` (the
    package's ``__init__`` then never runs); ppdiffusers' patches of Paddle run as ever."""
    if "ppdiffusers" not in sys.modules:
        load(PPDIFFUSERS_NEEDS)
    return importlib.import_module("ppdiffusers")
