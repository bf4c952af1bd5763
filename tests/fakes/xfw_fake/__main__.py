"""A fake adapter for launcher tests: writes canned records, trains nothing.

Its behaviour comes from the spec's ``backends.<name>`` knobs (the spec is an adapter's only input):

* ``behave``: ok | crash | hang | abort_after_end | hang_after_end | oom_stderr | stopped_child (starts a child in a session
  of its own that stops itself with SIGSTOP, writes its ``pid:start`` to ``child_pid_file``, then hangs)
* ``ips``: throughput of one process (samples/s); with N processes each rank runs at
  ``ips * scale_eff`` (so ``scale_eff: 0.9`` makes 2 processes 90% efficient)
* ``oom_above_micro``: a micro-batch above this ends the run with an ``oom`` error record and a
  CUDA-like message on stderr (exit code 1), as a real OOM probe would
* ``mem_per_sample_bytes``: peak memory grows by this much per sample of the micro-batch, over
  a 1 MiB base; rank r adds r x 4096 bytes so per-rank tables have distinct rows
* ``params``: the parameter count the ``applied`` record reports
* ``ips_jitter``: each run's ips times exp(N(0, jitter)), drawn from a generator seeded by the run's id, so
  repeats differ as a noisy machine's would and every test run draws the same (A/B and bisect tests)

All ranks of a multi-process spec are written by this one process (one RecordWriter per rank),
so the core sees exactly what an N-rank run writes. It exists to test the launcher's
classification and the reports' layouts; real training is tested against the real adapters in
tests/contract.
"""

import json
import os
import sys
import time

from xfw.contract.lifeline import watch_parent
from xfw.contract.records import RecordWriter

EXIT_OOM = 4  # xfw.contract.harness.EXIT_OOM


def main(argv):
    if "--describe" in argv:
        print(json.dumps({"backend": "fake", "framework": "fake", "framework_version": "0", "versions": {},
                          "device": "cpu", "device_name": "none", "launcher": ["{python}", "-m", "xfw_fake"]}))
        return 0
    watch_parent()  # as the harness does: die with the xfw that started us
    spec = json.load(open(argv[argv.index("--spec") + 1]))
    records = argv[argv.index("--records") + 1]
    knobs = spec["backend_knobs"]
    num_ranks = spec["derived"]["num_processes"]
    writers = [RecordWriter(records, rank) for rank in range(num_ranks)]
    behave = knobs.get("behave", "ok")
    rank_ips = float(knobs.get("ips", 100.0)) * (float(knobs.get("scale_eff", 1.0)) if num_ranks > 1 else 1.0)
    if knobs.get("ips_jitter"):
        import math
        import random

        rank_ips *= math.exp(random.Random(spec["run_id"]).gauss(0.0, float(knobs["ips_jitter"])))
    warmup, steps = spec["measure"]["warmup_steps"], spec["measure"]["steps"]
    micro = spec["batch"]["micro"]
    samples = spec["batch"]["global"] // num_ranks  # per rank per optimizer step
    step_time = samples / rank_ips
    mem = (1 << 20) + micro * int(knobs.get("mem_per_sample_bytes", 0))
    for w in writers:
        w.start(num_ranks=num_ranks, warmup_steps=warmup, steps=steps)
    if "oom_above_micro" in knobs and micro > int(knobs["oom_above_micro"]):
        print(f"torch.OutOfMemoryError: CUDA out of memory at micro-batch {micro} (fake)", file=sys.stderr)
        for w in writers:
            w.write("error", status="oom", message=f"out of memory at micro-batch {micro} (fake)")
        return EXIT_OOM
    if behave == "stopped_child":
        import subprocess

        from xfw.contract.lifeline import identity

        child = subprocess.Popen([sys.executable, "-c", "import os, signal, time; os.kill(os.getpid(), signal.SIGSTOP); "
                                  "time.sleep(3600)"], start_new_session=True)
        with open(knobs["child_pid_file"], "w") as f:
            f.write(identity(child.pid))
        time.sleep(3600)
    for i in range(warmup + steps):
        if behave == "crash" and i == 1:
            print("Traceback (most recent call last):\nRuntimeError: fake adapter crashed on purpose", file=sys.stderr)
            return 1
        if behave == "hang" and i == 1:
            time.sleep(3600)
        for w in writers:
            w.write("step", step=i, phase="warmup" if i < warmup else "measure", step_time_s=step_time,
                    samples=samples, tokens=0, loss=5.0 - 0.1 * i, mem_alloc_peak_bytes=mem + w.rank * 4096,
                    mem_reserved_peak_bytes=2 * mem + w.rank * 4096)
    if behave == "oom_stderr":
        print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", file=sys.stderr)
        return 1
    for w in writers:
        w.write("window", window_time_s=step_time * steps, num_steps=steps, samples=samples * steps, tokens=0)
        w.write("applied", framework="fake", framework_version="0", device="cpu", device_name="none",
                weight_dtype="float32", compute_dtype="float32", amp_level="O0", master_weights=False,
                sharding_impl=spec["parallel"]["sharding"], attention_impl="none", tf32=False,
                fused_optimizer=False, recompute=False, num_params_total=int(knobs.get("params", 1000)),
                num_params_trainable=10, num_processes=num_ranks,
                grad_accum_steps=spec["derived"]["grad_accum_steps"], mem_source="cuda_allocator", notes="fake")
        w.write("end")
        w.close()
    if behave == "abort_after_end":
        os.abort()
    while behave == "hang_after_end":  # a launcher waiting at exit on what never comes (an exit barrier)
        time.sleep(1)
    return 0


sys.exit(main(sys.argv[1:]))
