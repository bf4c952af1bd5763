"""Selfcheck verdicts without running anything: which paths a run takes, and how family verdicts combine."""

from xfw.report import selfcheck as judge


def test_a_run_takes_the_paths_its_settings_name():
    assert judge.paths_of({"dtype": "fp32", "amp_level": "O0"}, {}) == []
    setup = {"dtype": "bf16", "amp_level": "O2", "recompute": True, "sharding": "stage2"}
    assert judge.paths_of(setup, {"attn_implementation": "eager"}) == ["bf16-o2", "recompute", "stage2",
                                                                       "attention-eager"]
    assert all(p in judge.BY_NAME for p in judge.paths_of(setup, {"attn_implementation": "eager"}))


def test_one_failing_family_fails_the_path_and_all_skipped_is_not_checked():
    fail = judge.combine("torch", "bf16-o2", {"llava": ("pass", "ok"), "sd3": ("fail", "loss nan")})
    assert fail.verdict == "fail" and fail.detail == "sd3: loss nan"
    skipped = judge.combine("paddle", "stage2", {"llava": ("not checked", "GPU-only"), "sd3": ("not checked", "x")})
    assert skipped.verdict == "not checked" and skipped.detail == "llava: GPU-only"
    partly = judge.combine("torch", "stage3", {"llava": ("pass", "ok"), "sd15": ("not checked", "unsupported")})
    assert partly.verdict == "pass" and "not checked for sd15" in partly.detail


def test_a_backend_with_a_cpu_test_device_runs_its_gpu_only_paths_there():
    from pathlib import Path

    from xfw.run.commands.selfcheck import overrides_for

    offers = {"device": "cpu", "cpu_test_device": "testcpu"}
    stage2 = overrides_for(judge.BY_NAME["stage2"], "paddle", Path("/w"), offers)
    assert "backends.paddle.device=testcpu" in stage2 and "parallel.sharding=stage2" in stage2
    assert "backends.paddle.device=testcpu" in overrides_for(judge.BY_NAME["bf16-o2"], "paddle", Path("/w"), offers)
    assert not any("device=" in o for o in overrides_for(judge.BY_NAME["fp32"], "paddle", Path("/w"), offers))
    assert not any("device=" in o for o in overrides_for(judge.BY_NAME["stage2"], "paddle", Path("/w"),
                                                         {**offers, "device": "gpu:0"}))  # a GPU: the real thing
    assert not any("device=" in o for o in overrides_for(judge.BY_NAME["stage2"], "torch", Path("/w"), {"device": "cpu"}))
