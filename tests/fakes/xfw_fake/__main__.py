"""A fake adapter for launcher tests: writes canned records, trains nothing.

Its behaviour comes from the spec's ``backends.<name>.behave`` knob (the spec is an adapter's
only input): ok | crash | hang | abort_after_end | oom_stderr. ``ips`` sets its throughput.
It exists to test the launcher's classification and the report's handling of failures;
real training is tested against the real adapters in tests/contract.
"""

import json
import os
import sys
import time

from xfw.records import RecordWriter


def main(argv):
    if "--describe" in argv:
        print(json.dumps({"backend": "fake", "framework": "fake", "framework_version": "0", "versions": {},
                          "device": "cpu", "device_name": "none", "launcher": ["{python}", "-m", "xfw_fake"]}))
        return 0
    spec = json.load(open(argv[argv.index("--spec") + 1]))
    writer = RecordWriter(argv[argv.index("--records") + 1], 0)
    knobs = spec["backend_knobs"]
    behave, ips = knobs.get("behave", "ok"), float(knobs.get("ips", 100.0))
    warmup, steps = spec["measure"]["warmup_steps"], spec["measure"]["steps"]
    samples = spec["batch"]["global"]
    step_time = samples / ips
    writer.start(num_ranks=1, warmup_steps=warmup, steps=steps)
    for i in range(warmup + steps):
        if behave == "crash" and i == 1:
            print("Traceback (most recent call last):\nRuntimeError: fake adapter crashed on purpose", file=sys.stderr)
            return 1
        if behave == "hang" and i == 1:
            time.sleep(3600)
        writer.write("step", step=i, phase="warmup" if i < warmup else "measure", step_time_s=step_time,
                     samples=samples, tokens=0, loss=5.0 - 0.1 * i, mem_alloc_peak_bytes=1 << 20,
                     mem_reserved_peak_bytes=2 << 20)
    if behave == "oom_stderr":
        print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", file=sys.stderr)
        return 1
    writer.write("window", window_time_s=step_time * steps, num_steps=steps, samples=samples * steps, tokens=0)
    writer.write("applied", framework="fake", framework_version="0", device="cpu", device_name="none",
                 weight_dtype="float32", compute_dtype="float32", amp_level="O0", master_weights=False,
                 sharding_impl="none", attention_impl="none", tf32=False, fused_optimizer=False, recompute=False,
                 num_params_total=int(knobs.get("params", 1000)), num_params_trainable=10, num_processes=1,
                 grad_accum_steps=spec["derived"]["grad_accum_steps"], mem_source="cuda_allocator", notes="fake")
    writer.write("end")
    writer.close()
    if behave == "abort_after_end":
        os.abort()
    return 0


sys.exit(main(sys.argv[1:]))
