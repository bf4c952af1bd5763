"""The record format: what adapters may write, and reading it back while it is being written."""

import json

from xfw.contract.records import RecordTail, RecordWriter, load_records, validate_record

STEP = {"schema": 1, "kind": "step", "rank": 0, "step": 0, "phase": "measure", "step_time_s": 0.5,
        "samples": 4, "tokens": 256, "loss": 3.0, "mem_alloc_peak_bytes": 10, "mem_reserved_peak_bytes": None}


def test_a_complete_step_record_is_valid():
    assert validate_record(STEP) == []


def test_missing_wrong_typed_and_unexpected_keys_are_each_reported():
    bad = {**STEP, "samples": 4.5, "extra": 1}
    del bad["loss"]
    problems = validate_record(bad)
    assert any("missing 'loss'" in p for p in problems)
    assert any("'samples' has type float" in p for p in problems)
    assert any("unexpected key 'extra'" in p for p in problems)


def test_booleans_are_not_accepted_as_numbers():
    assert validate_record({**STEP, "samples": True})


def test_unknown_phase_and_schema_version_are_rejected():
    assert any("phase" in p for p in validate_record({**STEP, "phase": "cooldown"}))
    assert any("schema" in p for p in validate_record({**STEP, "schema": 2}))


def test_writer_refuses_to_write_an_invalid_record(tmp_path):
    writer = RecordWriter(tmp_path / "r.jsonl", 0)
    try:
        writer.write("step", step=0)
    except AssertionError as err:
        assert "missing" in str(err)
    else:
        raise AssertionError("invalid record was written")


def test_a_torn_last_line_is_dropped_when_loading(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(STEP) + "\n" + '{"schema": 1, "kind": "st')
    assert load_records(path) == [STEP]


def test_tail_returns_only_new_complete_lines(tmp_path):
    path = tmp_path / "r.jsonl"
    tail = RecordTail(path)
    assert tail.poll() == []
    with open(path, "w") as f:
        f.write(json.dumps(STEP) + "\n" + json.dumps({**STEP, "step": 1})[:20])
    assert [r["step"] for r in tail.poll()] == [0]
    with open(path, "a") as f:
        f.write(json.dumps({**STEP, "step": 1})[20:] + "\n")
    assert [r["step"] for r in tail.poll()] == [1]
    assert tail.poll() == []


def test_a_step_may_carry_a_gradient_norm_only_as_a_number_or_null():
    assert validate_record({**STEP, "grad_norm_l2": 1.25}) == []
    assert validate_record({**STEP, "grad_norm_l2": None}) == []
    assert any("'grad_norm_l2' has type str" in p for p in validate_record({**STEP, "grad_norm_l2": "1.0"}))
    assert validate_record({**STEP, "grad_norm_l2": True})
    window = {"schema": 1, "kind": "window", "rank": 0, "window_time_s": 1.0, "num_steps": 1, "samples": 1,
              "tokens": 1, "grad_norm_l2": 1.0}
    assert any("unexpected key 'grad_norm_l2'" in p for p in validate_record(window))  # steps only


def test_the_gradient_norm_knob_is_a_boolean_for_one_process_and_off_by_default():
    import pytest

    from xfw.contract.harness import InvalidSpec, wants_grad_norm

    def spec(knobs, processes=1):
        return {"backend": "torch", "backend_knobs": knobs, "derived": {"num_processes": processes}}

    assert wants_grad_norm(spec({})) is False and wants_grad_norm(spec({"grad_norm": True})) is True
    with pytest.raises(InvalidSpec, match=r"backends\.torch\.grad_norm: must be true or false, got 'yes'"):
        wants_grad_norm(spec({"grad_norm": "yes"}))
    with pytest.raises(InvalidSpec, match=r"backends\.torch\.grad_norm: only with one process"):
        wants_grad_norm(spec({"grad_norm": True}, processes=2))
    assert wants_grad_norm(spec({"grad_norm": False}, processes=2)) is False


def test_resident_memory_readings_are_optional_integers_and_the_reset_flag_a_boolean():
    base = {"schema": 1, "rank": 0, "kind": "start", "num_ranks": 1, "warmup_steps": 0, "steps": 1, "t_unix_s": 1.0}
    assert validate_record(base) == []  # a run from before the harness read its resident memory
    assert validate_record({**base, "rss_after_build_bytes": 10, "rss_peak_since_build": True}) == []
    assert validate_record({**base, "rss_peak_since_build": 1})
    assert validate_record({**base, "rss_after_build_bytes": True})
    assert validate_record({**STEP, "rss_peak_bytes": 4096}) == []
    assert validate_record({**STEP, "rss_peak_bytes": 1.5})
