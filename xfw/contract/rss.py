"""The process's resident memory: the one memory measure every backend shares on a CPU.

Frameworks report their own memory differently on a host (PyTorch keeps no CPU allocator
statistics; Paddle's host allocator sees only its own tensors), so the harness measures every
adapter process the same way, from the kernel (Linux ``/proc/self``)::

    after_build = reset_peak()   # once the model is built: the resident set now, and the peak from here
    ...                          # training
    peak_bytes()                 # the largest resident set since then (VmHWM)

Resetting the high-water mark (``/proc/self/clear_refs``, value 5, Linux >= 4.0) keeps the
framework's start-up and model construction out of the training peak, as ``reset_peak_memory_stats``
does for a CUDA allocator; the resident set right after the build is recorded beside it. Where the
reset is refused, the peak is the process's since it started (:func:`reset_peak` says which); where
``/proc`` is missing, ``getrusage``'s peak is used.
"""

from __future__ import annotations

import os
import re
import resource

_STATUS, _STATM, _CLEAR_REFS = "/proc/self/status", "/proc/self/statm", "/proc/self/clear_refs"


def current_bytes() -> int | None:
    """The resident set now; None without ``/proc``."""
    try:
        with open(_STATM, encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def peak_bytes() -> int:
    """The largest resident set since the last :func:`reset_peak` (or since the process started)."""
    try:
        with open(_STATUS, encoding="ascii") as f:
            found = re.search(r"^VmHWM:\s+(\d+) kB", f.read(), re.M)
        if found:
            return int(found.group(1)) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def reset_peak() -> tuple[int | None, bool]:
    """(the resident set now, whether the peak now counts from here)."""
    try:
        with open(_CLEAR_REFS, "w", encoding="ascii") as f:
            f.write("5")
        reset = True
    except OSError:
        reset = False
    return current_bytes(), reset
