"""PLANTED slowdown for the real bisect in results/cpu/decisions (never part of a real build): with
XFW_PLANTED_STEP_SLEEP_S set, every ``torch.optim.AdamW.step`` sleeps that long first. The wrapper scripts
beside this file put it on PYTHONPATH; Python imports ``sitecustomize`` at start-up, and this one patches
AdamW when ``torch.optim.adamw`` is first imported (a finder on sys.meta_path)."""

import importlib.abc
import importlib.util
import os
import sys
import time

DELAY_S = float(os.environ.get("XFW_PLANTED_STEP_SLEEP_S") or 0)


class _PlantInAdamW(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "torch.optim.adamw":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            step = module.AdamW.step

            def slowed(self, *args, **kwargs):
                time.sleep(DELAY_S)
                return step(self, *args, **kwargs)

            module.AdamW.step = slowed

        spec.loader.exec_module = exec_module
        return spec


if DELAY_S > 0:
    sys.meta_path.insert(0, _PlantInAdamW())
