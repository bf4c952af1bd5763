"""Run a function right after a module is imported, whoever imports it and whenever.

The probe installs its hooks into a framework the moment the user's script imports it, without
importing anything itself: a Paddle script never loads PyTorch because the probe watches for it::

    when_imported("transformers.trainer", lambda module: patch(module.Trainer))

A finder first on ``sys.meta_path`` answers only for watched names: it asks the other finders for
the module's spec and wraps its loader, so the callback runs once the module's code has run (the
module's own ``__loader__`` is the original one again by then). A module imported already gets
the callback at once.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import threading
from types import ModuleType
from typing import Callable

Callback = Callable[[ModuleType], None]


class _Loader(importlib.abc.Loader):
    """The original loader, then the callbacks."""

    def __init__(self, loader, callbacks: list[Callback]):
        self.loader, self.callbacks = loader, callbacks

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self.loader  # what the module's own code and importlib.resources see
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        for callback in self.callbacks:
            callback(module)


class _Watcher(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self.callbacks: dict[str, list[Callback]] = {}
        self._busy = threading.local()

    def find_spec(self, name: str, path=None, target=None):
        if name not in self.callbacks or name in getattr(self._busy, "names", ()):
            return None
        self._busy.names = {*getattr(self._busy, "names", ()), name}
        try:
            spec = importlib.util.find_spec(name)  # the other finders' answer (this one is busy)
        finally:
            self._busy.names = self._busy.names - {name}
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _Loader(spec.loader, self.callbacks.pop(name))
        return spec


_WATCHER = _Watcher()


def when_imported(name: str, callback: Callback) -> None:
    """Call ``callback(module)`` once ``name`` (a full dotted name) has been imported."""
    if name in sys.modules:
        callback(sys.modules[name])
        return
    _WATCHER.callbacks.setdefault(name, []).append(callback)
    if _WATCHER not in sys.meta_path:
        sys.meta_path.insert(0, _WATCHER)
