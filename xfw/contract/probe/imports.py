"""Run a function right after a module is imported, whoever imports it and whenever.

The probe installs its hooks into a framework the moment the user's script imports it, without
importing anything itself: a Paddle script never loads PyTorch because the probe watches for it::

    when_imported("transformers.trainer", lambda module: patch(module.Trainer))

A finder first on ``sys.meta_path`` answers only for watched names: it asks the other finders for
the module's spec and wraps its loader, so the callback runs once the module's code has run (the
module's own ``__loader__`` is the original one again by then). A module imported already gets
the callback at once.

The callbacks stay registered until a module's code has actually run: a mere look-up of the spec
(``importlib.util.find_spec("torch")``, which datasets, transformers and peft do before importing
it, or does without importing it) runs nothing and takes nothing away. However the import comes,
``import``, ``importlib.import_module``, lazily inside a function or from another thread, it goes
through this finder. :func:`missed` names the watched modules that were imported without their
callbacks (a loader that cannot be wrapped, the watcher removed from ``sys.meta_path``), so the
probe can say it could not hook them.
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

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self.loader  # what the module's own code and importlib.resources see
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        for callback in _WATCHER.take(module.__name__):  # once, by whichever import ran the code
            callback(module)


class _Watcher(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self.callbacks: dict[str, list[Callback]] = {}
        self.done: set[str] = set()
        self._busy = threading.local()
        self._lock = threading.Lock()

    def take(self, name: str) -> list[Callback]:
        with self._lock:
            self.done.add(name)
            return self.callbacks.pop(name, [])

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
        spec.loader = _Loader(spec.loader)  # a look-up that never loads leaves the callbacks in place
        return spec


_WATCHER = _Watcher()


def when_imported(name: str, callback: Callback) -> None:
    """Call ``callback(module)`` once ``name`` (a full dotted name) has been imported."""
    if name in sys.modules:
        callback(sys.modules[name])
        return
    with _WATCHER._lock:
        _WATCHER.callbacks.setdefault(name, []).append(callback)
    if _WATCHER not in sys.meta_path:
        sys.meta_path.insert(0, _WATCHER)


def missed() -> list[str]:
    """Watched modules imported without their callbacks having run (so their hooks are not in)."""
    return sorted(n for n in list(_WATCHER.callbacks) if n in sys.modules and n not in _WATCHER.done)
