"""The PyTorch adapter, for real: tiny LLaVA trained on CPU.

The plain run goes through its own interpreter, exactly what the launcher runs (``python -m xfw_torch``). The
other runs call the same entry point (``harness.main`` with the adapter's session and describe) in this process,
which is the torch environment when the tests run under ``.venv/torch/bin/python``: each saves an interpreter
start and ~6 CPU s of imports, and the same-seed check then compares a fresh process with a long-lived one.
"""

import json
import math

import pytest

from xfw.contract import families, presets
from xfw.contract.records import validate_record

from conftest import TINY_RECIPE, applied, kinds, losses, run_adapter

pytestmark = pytest.mark.contract
ARCH = presets.resolve_arch("tiny-llava", {}, None, None)
COUNTS = presets.count_params(ARCH)


PLAIN = {"warmup_steps": 2, "steps": 8}  # the plain run's (enough for its loss to fall); recompute's and the rerun's


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """One plain fp32 SFT run of 2 + 8 steps, read by the tests that need just that run (protocol and learning,
    counts, what it applied, recompute's and reproducibility's reference): one adapter start instead of five."""
    code, records, stderr = run_adapter("torch", tmp_path_factory.mktemp("plain"), measure=PLAIN)
    assert code == 0, stderr
    return records


def test_tiny_sft_writes_valid_records_in_protocol_order_and_learns(plain):
    records = plain
    for r in records:
        assert validate_record(r) == [], r
    assert kinds(records) == ["start"] + ["step"] * 10 + ["window", "applied", "end"]
    steps = [r for r in records if r["kind"] == "step"]
    assert [r["phase"] for r in steps] == ["warmup"] * 2 + ["measure"] * 8
    assert [r["step"] for r in steps] == list(range(10))
    assert all(r["samples"] == 4 and r["tokens"] == 4 * 64 for r in steps)
    assert all(math.isfinite(x) for x in losses(records))
    assert losses(records)[-1] < losses(records)[0] - 0.3  # lr 1e-3 on a fixed pool: it must learn


def test_parameter_counts_match_the_neutral_architecture(plain):
    records = plain
    a = applied(records)
    assert a["num_params_total"] == COUNTS["total"]
    assert a["num_params_trainable"] == COUNTS["projector"] + COUNTS["text"]  # sft: vision frozen


@pytest.fixture(scope="module")
def bf16_pretrain(tmp_path_factory):
    """One pretrain run under bf16 autocast (O1), 1 + 3 steps, read by two tests: what trains in pretrain
    (autocast changes the compute dtype, not which parameters train) and that bf16 autocast runs on CPU and
    says so (its forward and backward go through the whole model, frozen parts included, to reach the
    projector): one run instead of two (in this process, module doc)."""
    code, records, stderr = run_adapter("torch", tmp_path_factory.mktemp("bf16_pretrain"), stage="pretrain",
                                        precision={"dtype": "bf16", "amp_level": "O1"},
                                        measure={"warmup_steps": 1, "steps": 3}, in_process=True)
    assert code == 0, stderr
    return records


def test_pretrain_trains_only_the_projector(bf16_pretrain):
    assert applied(bf16_pretrain)["num_params_trainable"] == COUNTS["projector"]


def test_fp32_run_reports_what_it_applied(plain):
    records = plain
    a = applied(records)
    assert (a["weight_dtype"], a["compute_dtype"], a["amp_level"], a["master_weights"]) == (
        "float32", "float32", "O0", False)
    assert a["device"] == "cpu" and a["mem_source"] == "peak_rss"
    assert a["version_torch"].startswith("2.") and "version_transformers" in a


def test_bf16_autocast_runs_on_cpu_and_says_so(bf16_pretrain):
    a = applied(bf16_pretrain)
    assert (a["weight_dtype"], a["compute_dtype"], a["amp_level"]) == ("float32", "bfloat16", "O1")
    assert all(math.isfinite(x) for x in losses(bf16_pretrain))


def test_bf16_o2_keeps_low_precision_weights_with_fp32_master_weights(tmp_path):
    code, records, stderr = run_adapter("torch", tmp_path, precision={"dtype": "bf16", "amp_level": "O2"},
                                        measure={"warmup_steps": 1, "steps": 6}, in_process=True)
    assert code == 0, stderr
    a = applied(records)
    assert (a["weight_dtype"], a["compute_dtype"], a["master_weights"]) == ("bfloat16", "bfloat16", True)
    assert losses(records)[-1] < losses(records)[0]


def test_recompute_changes_memory_not_math(tmp_path, plain):
    _, recomputed, _ = run_adapter("torch", tmp_path, recompute=True, measure=PLAIN, in_process=True)
    assert applied(recomputed)["recompute"] is True
    assert losses(recomputed) == pytest.approx(losses(plain), rel=1e-5)


def test_runs_with_the_same_seed_are_reproducible(tmp_path, plain):
    first = plain  # its own process; the second in this one, after other runs built models and drew numbers
    _, second, _ = run_adapter("torch", tmp_path, measure=PLAIN, in_process=True)
    assert losses(first) == pytest.approx(losses(second), rel=1e-6)


def test_lora_trains_only_the_adapters_and_the_projector(tmp_path):
    lora = {"r": 4, "alpha": 8, "targets": ["q_proj", "v_proj", "down_proj"]}
    code, records, stderr = run_adapter("torch", tmp_path, stage="lora", lora=lora, optimizer={"lr": 1.0e-2},
                                        measure={"warmup_steps": 0, "steps": 6}, in_process=True)
    assert code == 0, stderr
    added = families.count_lora_params(ARCH, lora)
    assert added == 2 * 4 * ((64 + 64) + (64 + 64) + (128 + 64))
    a = applied(records)
    assert a["num_params_total"] == COUNTS["total"] + added
    assert a["num_params_trainable"] == COUNTS["projector"] + added
    assert losses(records)[-1] < losses(records)[0]


def test_a_lora_target_that_does_not_exist_is_invalid(tmp_path):
    code, records, _ = run_adapter("torch", tmp_path, stage="lora",
                                   lora={"r": 4, "alpha": 8, "targets": ["q_proj"]},
                                   edit_spec=lambda spec: spec["lora"].update(targets=["no_such_proj"]),
                                   in_process=True)
    assert code == 2 and records[-1]["status"] == "invalid" and "lora.targets" in records[-1]["message"]


@pytest.mark.parametrize("preset", ["tiny-llava-next", "tiny-qwen2-vl"])
def test_other_vision_language_presets_match_their_analytic_counts_and_learn(tmp_path, preset):
    arch = presets.resolve_arch(preset, {}, None, None)
    counts = families.analytic_counts(arch, "sft")
    code, records, stderr = run_adapter("torch", tmp_path, model={"preset": preset},
                                        measure={"warmup_steps": 1, "steps": 6}, in_process=True)
    assert code == 0, stderr
    a = applied(records)
    assert a["num_params_total"] == counts["total"]
    assert a["num_params_trainable"] == counts["trainable"]  # all but the vision tower (bar Qwen2-VL's merger)
    assert "vision" not in counts["trainable_parts"]
    assert all(validate_record(r) == [] for r in records)
    assert losses(records)[-1] < losses(records)[0]


def test_an_unknown_backend_knob_is_invalid(tmp_path):
    code, records, _ = run_adapter("torch", tmp_path, backends={"torch": {"bogus": 1}}, in_process=True)
    assert code == 2
    assert records[-1]["status"] == "invalid" and "backends.torch.bogus" in records[-1]["message"]


def test_describe_prints_versions_and_the_multi_process_launcher(capsys):
    """``python -m xfw_torch --describe``'s entry point, here (every launch elsewhere runs it as a command:
    xfw.run.launch.launcher.describe_backend)."""
    pytest.importorskip("torch")
    from xfw.contract import harness
    from xfw_torch.session import build_session, describe

    assert harness.main(build_session, describe, ["--describe"]) == 0
    info = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert info["framework"] == "torch" and "transformers" in info["versions"]
    assert "{nproc}" in info["launcher"]


def test_frozen_parameters_get_no_gradient_and_do_not_change():
    torch = pytest.importorskip("torch")  # in-process: the test interpreter is the torch environment
    from xfw.recipe import recipe_from_dict
    from xfw.recipe.spec import resolve_spec
    from xfw.contract.synthetic import make_pool
    from xfw_torch.session import build_session

    spec = resolve_spec(recipe_from_dict(dict(TINY_RECIPE)), backend="torch", run_id="t")
    session = build_session(spec)
    vision = session.model.model.vision_tower
    before = [p.detach().clone() for p in vision.parameters()]
    projector_before = session.model.model.multi_modal_projector.linear_1.weight.detach().clone()
    batches = [session.to_device(b) for b in make_pool(spec, 0)[:2]]
    session.train_step(batches)
    assert all(p.grad is None and not p.requires_grad for p in vision.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, vision.parameters()))
    assert not torch.equal(projector_before, session.model.model.multi_modal_projector.linear_1.weight)
