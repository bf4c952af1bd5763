"""The xfw CPU test device for Paddle (``testcpu``): where it is, how a process uses it, and the one
place that lets Paddle's AMP treat it as bf16-capable (docs/testdevice.md).

``testcpu`` is a Paddle *custom device* built by ``scripts/build_testdevice.sh`` from
``adapters/paddle/testdevice`` into ``.venv/paddle/lib/xfw-testdevice/libxfw_testcpu.so``. Its memory is
host memory, its collectives are real across processes (shared memory), and it registers native
kernels for the in-place ops sharding applies to views of its buffers and bf16/fp16 kernels for the
ops the tiny models run under AMP. It exists so that Paddle's GPU-only paths (``group_sharded_parallel``
stage 2/3, bf16 O2 with master weights/gradients) run for real on a CPU. Its timings mean nothing for
a GPU.

Paddle loads custom devices once, when ``paddle`` is first imported, from the directory in
``CUSTOM_DEVICE_ROOT``. So:

* a launcher puts :func:`env` into the environment of every process it starts (``paddle.distributed.launch``
  then finds the device itself: backend XCCL, ``FLAGS_selected_testcpus``);
* a process that imports paddle itself calls :func:`activate` first (or after, if the environment was
  already set): it sets the environment when paddle is not imported yet, imports paddle, checks that
  ``testcpu`` is registered, enables bf16 AMP for it, and selects the device (``paddle.set_device``).

``XFW_TESTCPU_FILL=nan`` (or ``zero``) in a process's environment fills memory fresh from the device, so
a run that reads memory nothing wrote shows it (docs/testdevice.md); ``env()`` does not set it.

Nothing here runs at import time; importing this module does not import paddle.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

DEVICE_TYPE = "testcpu"
LIBRARY = "libxfw_testcpu.so"
_ROOT = Path(__file__).resolve().parents[3]
# The build script's output directory, under the Paddle environment (never paddle's default plugin
# directory: a plugin there would be loaded, and chosen as the default device, by every Paddle process).
DEFAULT_DIR = _ROOT / ".venv" / "paddle" / "lib" / "xfw-testdevice"
DESCRIPTION = "xfw CPU test device (testcpu): a Paddle custom device on host memory; timings are not GPU figures"


def plugin_dir() -> Path:
    """The directory holding the plugin: ``XFW_TESTDEVICE_DIR`` if set, else the build script's default."""
    return Path(os.environ.get("XFW_TESTDEVICE_DIR") or DEFAULT_DIR)


def library() -> Path:
    return plugin_dir() / LIBRARY


def available() -> bool:
    """True when the plugin has been built (``scripts/build_testdevice.sh``); does not import paddle."""
    return library().is_file()


def env() -> dict[str, str]:
    """Environment a process needs *before* importing paddle to have the ``testcpu`` device.

    ``CUSTOM_DEVICE_ROOT``: where Paddle looks for device plugins. ``FLAGS_enable_api_kernel_fallback``
    stays on (ops without a device kernel run Paddle's CPU kernel on copies; in-place ops the device
    needs natively are registered natively). ``XFW_TESTDEVICE=1`` tells xfw code in that process to
    call :func:`activate`. Raises FileNotFoundError when the plugin is not built."""
    if not available():
        raise FileNotFoundError(f"{library()} is missing: run scripts/build_testdevice.sh")
    return {"CUSTOM_DEVICE_ROOT": str(plugin_dir()), "XFW_TESTDEVICE": "1"}


def activate(device_id: int | None = None):
    """Prepare this process to run on ``testcpu`` and return ``paddle``.

    Sets :func:`env` if paddle is not imported yet, imports paddle, checks the device is registered
    (RuntimeError naming the cause otherwise: paddle imported before the environment was set, or the
    plugin failed to load), enables bf16 AMP for it (:func:`enable_bf16_amp`) and calls
    ``paddle.set_device('testcpu:<id>')`` with ``device_id`` or the launcher's selected device
    (``FLAGS_selected_testcpus``, else 0)."""
    if "paddle" not in sys.modules:
        os.environ.update(env())
    import paddle

    types = paddle.device.get_all_custom_device_type() or []
    if DEVICE_TYPE not in types:
        why = ("paddle was imported before CUSTOM_DEVICE_ROOT was set" if os.environ.get("CUSTOM_DEVICE_ROOT")
               != str(plugin_dir()) else f"Paddle did not load {library()} (see its log above)")
        raise RuntimeError(f"the {DEVICE_TYPE} device is not registered: {why}")
    enable_bf16_amp()
    if device_id is None:
        selected = os.environ.get(f"FLAGS_selected_{DEVICE_TYPE}s", "0").split(",")[0]
        device_id = int(selected or 0)
    paddle.set_device(f"{DEVICE_TYPE}:{device_id}")
    return paddle


def enable_bf16_amp() -> None:
    """Let Paddle's AMP run bf16 on ``testcpu``: the ONE place xfw changes Paddle's behaviour for it.

    Paddle 3.3.1 decides bf16 AMP for custom devices in ``paddle.amp.auto_cast._is_custom_device_bfloat16_supported``
    from a fixed list of device types (npu, intel_hpu, iluvatar_gpu, metax_gpu); any other custom device gets
    "CustomPlace only support float16 amp" and ``auto_cast``/``decorate`` silently stay fp32. This wraps that
    function so ``testcpu`` answers True too (the device registers bf16 kernels for the ops the tiny
    models run); every other device keeps Paddle's answer. Idempotent."""
    import importlib

    auto_cast = importlib.import_module("paddle.amp.auto_cast")  # the module, not the function of that name

    original = auto_cast._is_custom_device_bfloat16_supported
    if getattr(original, "_xfw_testcpu", False):
        return

    def supported() -> bool:
        place = auto_cast._current_expected_place()
        return (place.is_custom_place() and place.get_device_type() == DEVICE_TYPE) or original()

    supported._xfw_testcpu = True
    auto_cast._is_custom_device_bfloat16_supported = supported


def is_active() -> bool:
    """True when this process runs on ``testcpu`` (paddle imported and its expected place is the device)."""
    if "paddle" not in sys.modules:
        return False
    import paddle

    place = paddle.framework._current_expected_place()
    return place.is_custom_place() and place.get_device_type() == DEVICE_TYPE
