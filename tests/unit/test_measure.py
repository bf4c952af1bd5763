"""Statistics: warm-up excluded, throughput summed over ranks, percentiles over measured steps."""

import pytest

from xfw.report.measure import spread, summarize


def step(rank, i, phase, t, loss=1.0, alloc=100, reserved=200):
    return {"kind": "step", "rank": rank, "step": i, "phase": phase, "step_time_s": t, "samples": 8,
            "tokens": 512, "loss": loss, "mem_alloc_peak_bytes": alloc, "mem_reserved_peak_bytes": reserved}


def window(rank, seconds, steps=4):
    return {"kind": "window", "rank": rank, "window_time_s": seconds, "num_steps": steps, "samples": 8 * steps,
            "tokens": 512 * steps}


def run(ranks=1, warmup_time=100.0):
    records = []
    for r in range(ranks):
        records += [step(r, 0, "warmup", warmup_time, loss=9.0, alloc=999_999)]
        records += [step(r, i, "measure", t, loss=5.0 - i, alloc=100 + r) for i, t in zip(range(1, 5), (1, 2, 3, 4))]
        records += [window(r, 10.0)]
    records.append({"kind": "applied", "rank": 0, "mem_source": "cuda_allocator"})
    return records


def test_throughput_uses_only_the_measured_window():
    m = summarize(run())
    assert m.ips == pytest.approx(32 / 10.0)
    assert m.tokens_per_s == pytest.approx(512 * 4 / 10.0)
    assert m.num_warmup_steps == 1 and m.num_measured_steps == 4


def test_global_throughput_sums_ranks():
    m = summarize(run(ranks=2))
    assert m.ips == pytest.approx(2 * 32 / 10.0)
    assert m.num_ranks == 2 and len(m.per_rank) == 2


def test_step_time_percentiles_exclude_warmup():
    m = summarize(run(warmup_time=1000.0))
    assert m.step_time_median_s == pytest.approx(2.5)
    assert m.step_time_p10_s == pytest.approx(1.3)
    assert m.step_time_p90_s == pytest.approx(3.7)


def test_memory_is_the_peak_over_all_steps_and_ranks_with_its_source():
    m = summarize(run(ranks=2))
    assert m.mem_alloc_peak_bytes == 999_999  # warm-up peaks count: memory is a high-water mark
    assert m.mem_reserved_peak_bytes == 200
    assert m.mem_source == "cuda_allocator"


def test_losses_first_and_last_come_from_rank_zero_in_step_order():
    m = summarize(list(reversed(run())))
    assert m.loss_first == 9.0 and m.loss_last == 1.0


def test_a_run_without_a_window_has_no_throughput_but_keeps_its_steps():
    records = [r for r in run() if r["kind"] != "window"]
    m = summarize(records)
    assert m.ips is None and m.num_measured_steps == 4


def test_spread_is_relative_range_and_needs_two_values():
    assert spread([10.0]) is None
    assert spread([9.0, 10.0, 11.0]) == pytest.approx(0.2)


def test_the_shared_memory_measure_is_the_peak_rss_on_a_cpu_and_the_allocator_on_a_gpu():
    cpu = [{**r, "rss_peak_bytes": 5000 + r["step"]} if r["kind"] == "step" else r for r in run()]
    cpu = [{**r, "mem_source": "host_allocator"} if r["kind"] == "applied" else r for r in cpu]
    cpu.append({"kind": "start", "rank": 0, "rss_after_build_bytes": 4000, "rss_peak_since_build": True})
    m = summarize(cpu)
    # The training memory: the peak since the build minus the resident set right after it.
    assert (m.memory_bytes, m.memory_source, m.rss_after_build_bytes) == (1004, "rss_training", 4000)
    assert m.rss_peak_bytes == 5004 and m.per_rank[0]["rss_training_bytes"] == 1004
    unreset = summarize([{**r, "rss_peak_since_build": False} if r["kind"] == "start" else r for r in cpu])
    assert (unreset.memory_bytes, unreset.memory_source) == (5004, "peak_rss")  # start-up may be in that peak
    assert m.mem_alloc_peak_bytes == 999_999 and m.mem_source == "host_allocator"  # the framework's own, kept
    gpu = summarize([{**r, "rss_peak_bytes": 5000} if r["kind"] == "step" else r for r in run()])
    assert (gpu.memory_bytes, gpu.memory_source, gpu.rss_peak_bytes) == (999_999, "cuda_allocator", 5000)
    old = summarize([{**r, "mem_source": "host_allocator"} if r["kind"] == "applied" else r for r in run()])
    assert (old.memory_bytes, old.memory_source) == (999_999, "host_allocator")
