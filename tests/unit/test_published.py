"""The two comparisons (xfw.recipe.published, xfw.report.comparison): loading a published file, applying
it to a recipe (the user's --set wins), what spec.json says per backend, throughput as each script
defined it, and which mechanism differences the report flags. No framework."""

from __future__ import annotations

from pathlib import Path

import pytest

from xfw.report import comparison
from xfw.report.compare import Side
from xfw.report.measure import script_throughput, summarize
from xfw.recipe import published
from xfw.recipe import RecipeError, load_recipe
from xfw.recipe.spec import resolve_spec

ROOT = Path(__file__).resolve().parents[2]
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def write_published(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "row.yaml"
    path.write_text(f"row: tiny-row\nsources:\n  run: {{repo: Org/Repo, commit: {COMMIT}, path: run.sh}}\n" + body)
    return path


GOOD = """sides:
  torch:
    - {key: optimizer_impl, value: foreach, source: run, line: 3}
    - {key: deepspeed.overlap_comm, value: true, source: run}
    - {key: env.NCCL_ALGO, value: "Tree", source: run, line: 9}
    - {not_reproduced: "the script's own loop", source: run, line: 20}
  paddle:
    - {key: env.FLAGS_cudnn_deterministic, value: "1", source: run, line: 5}
throughput:
  paddle: {definition: step_mean, skip_steps: 2, source: run, line: 30}
"""


def test_a_published_file_loads_with_every_source_cited(tmp_path):
    table = published.load(write_published(tmp_path, GOOD))
    torch_side = table["sides"]["torch"]
    assert [e["key"] for e in torch_side["set"]] == ["optimizer_impl", "deepspeed.overlap_comm", "env.NCCL_ALGO"]
    assert torch_side["set"][0]["source"] == f"Org/Repo@{COMMIT[:12]}:run.sh#L3"
    assert torch_side["set"][1]["source"] == f"Org/Repo@{COMMIT[:12]}:run.sh"  # no line given
    assert torch_side["not_reproduced"] == [{"what": "the script's own loop", "source": f"Org/Repo@{COMMIT[:12]}:run.sh#L20"}]
    assert table["throughput"]["paddle"]["definition"] == "step_mean"


@pytest.mark.parametrize("body, needle", [
    ("sides:\n  torch:\n    - {key: tf32, value: true, source: nowhere}\n", "sides.torch.0.source: 'nowhere'"),
    ("sides:\n  torch:\n    - {key: env.X, value: 1, source: run}\n", "must be a string"),
    ("sides:\n  torch:\n    - {value: 1, source: run}\n", "needs key"),
    ("throughput:\n  torch: {definition: fastest, source: run}\n", "throughput.torch.definition"),
    ("sides: {torch: {key: tf32}}\n", "sides.torch: must be a list"),
])
def test_a_broken_published_file_is_one_line_naming_file_and_key(tmp_path, body, needle):
    with pytest.raises(published.PublishedError) as err:
        published.load(write_published(tmp_path, body))
    assert needle in str(err.value) and str(tmp_path) in str(err.value) and "\n" not in str(err.value)


def test_a_commit_must_be_a_full_hash(tmp_path):
    path = tmp_path / "row.yaml"
    path.write_text("row: r\nsources:\n  run: {repo: Org/Repo, commit: abc123, path: run.sh}\n")
    with pytest.raises(published.PublishedError, match="sources.run.commit"):
        published.load(path)


def _recipe(tmp_path: Path, published_file: Path, extra: str = "") -> Path:
    source = (ROOT / "recipes" / "tiny" / "llava_sft.yaml").read_text()
    lines = [line for line in source.splitlines() if not line.startswith("published:")]
    path = tmp_path / "recipe.yaml"
    path.write_text("\n".join(lines) + f"\npublished: {published_file}\n" + extra)
    return path


def test_published_applies_each_side_and_the_users_set_wins(tmp_path):
    recipe_path = _recipe(tmp_path, write_published(tmp_path, GOOD))
    plain = load_recipe(recipe_path)
    assert plain.comparison == "like-for-like" and "optimizer_impl" not in plain.backends.get("torch", {})
    as_published = load_recipe(recipe_path, ["comparison=published", "backends.torch.optimizer_impl=for_loop"])
    assert as_published.backends["torch"]["optimizer_impl"] == "for_loop"  # the user's --set
    assert as_published.backends["torch"]["deepspeed"] == {"overlap_comm": True}
    assert as_published.backends["paddle"]["env"] == {"FLAGS_cudnn_deterministic": "1"}
    spec = resolve_spec(as_published, backend="paddle", run_id="x/paddle")
    assert spec["backend_env"] == {"FLAGS_cudnn_deterministic": "1"} and "env" not in spec["backend_knobs"]
    assert spec["comparison"]["kind"] == "published" and spec["comparison"]["row"] == "tiny-row"
    assert spec["comparison"]["throughput"]["definition"] == "step_mean"
    torch_spec = resolve_spec(plain, backend="torch", run_id="x/torch")
    assert torch_spec["comparison"]["kind"] == "like-for-like"
    assert [e["key"] for e in torch_spec["comparison"]["not_applied"]][:1] == ["optimizer_impl"]


def test_published_without_a_published_file_is_refused(tmp_path):
    source = (ROOT / "recipes" / "tiny" / "llava_sft.yaml").read_text()
    path = tmp_path / "recipe.yaml"
    path.write_text("\n".join(line for line in source.splitlines() if not line.startswith("published:")))
    with pytest.raises(RecipeError, match="comparison: published needs the recipe's `published:` key"):
        load_recipe(path, ["comparison=published"])
    with pytest.raises(RecipeError, match="comparison: must be one of like-for-like, published"):
        load_recipe(path, ["comparison=fastest"])


def test_adapter_variables_are_checked_like_a_commands(tmp_path):
    recipe_path = _recipe(tmp_path, write_published(tmp_path, GOOD))
    with pytest.raises(RecipeError, match="backends.torch.env.X: must be a string"):
        load_recipe(recipe_path, ["backends.torch.env={X: 1}"])
    with pytest.raises(RecipeError, match="XFW_RUN"):
        load_recipe(recipe_path, ["backends.torch.env={XFW_RUN: a}"])
    assert load_recipe(recipe_path, ["backends.torch.env.OMP_PROC_BIND=close"]).backends["torch"]["env"] == \
        {"OMP_PROC_BIND": "close"}


def _steps(times: list[float], warmup: int, ranks: int = 2, samples: int = 4) -> list[dict]:
    out = []
    for rank in range(ranks):
        for i, t in enumerate(times):
            out.append({"kind": "step", "rank": rank, "step": i, "phase": "warmup" if i < warmup else "measure",
                        "step_time_s": t, "samples": samples, "tokens": 0, "loss": 1.0,
                        "mem_alloc_peak_bytes": None, "mem_reserved_peak_bytes": None})
        window = sum(times[warmup:])
        out.append({"kind": "window", "rank": rank, "window_time_s": window, "num_steps": len(times) - warmup,
                    "samples": samples * (len(times) - warmup), "tokens": 0})
    return out


def test_each_scripts_throughput_definition_from_the_same_records():
    m = summarize(_steps([2.0, 1.0, 0.5, 0.5, 0.25], warmup=1))
    assert m.ips == pytest.approx(2 * 16 / 2.25)  # xfw: the window, all ranks
    assert script_throughput(m, {"definition": "window"}) == m.ips
    # PaddleMIX: per-step rates (4 samples x 2 ranks / t) after the first 2 logged steps
    assert script_throughput(m, {"definition": "step_mean", "skip_steps": 2}) == pytest.approx((16 + 16 + 32) / 3)
    # HF Trainer: every sample over the whole run, warm-up included
    assert script_throughput(m, {"definition": "whole_run"}) == pytest.approx(40 / 4.25)
    # SD3's parser: rank 0's rate x 8 (over its window, or its steps after the skipped ones)
    assert script_throughput(m, {"definition": "rank0_times", "n": 8}) == pytest.approx(16 / 2.25 * 8)
    assert script_throughput(m, {"definition": "rank0_times", "n": 8, "skip_steps": 3}) == pytest.approx(8 / 0.75 * 8)


def _side(name: str, mechanisms: dict, kind: str = "like-for-like", env: dict | None = None) -> Side:
    applied = {"mechanisms": mechanisms, **({"env": env} if env else {})}
    return Side(backend=name, status="ok", applied=applied, setup={"comparison": {"kind": kind}})


class _Row:
    def __init__(self, sides):
        self.sides, self.settings, self.differing, self.warnings = sides, {}, [], []


def test_names_that_mean_the_same_mechanism_are_not_flagged_and_real_differences_are():
    row = _Row({"paddle": _side("paddle", {"attention_kernel": "flash_attn", "optimizer_impl": "for_loop",
                                           "grad_reduce_dtype": "float32", "sharding_detail": "group_sharded os_g"},
                                env={"FLAGS_cudnn_deterministic": "1"}),
                "torch": _side("torch", {"attention_kernel": "sdpa: flash", "optimizer_impl": "foreach",
                                         "grad_reduce_dtype": "float32", "sharding_detail": "FSDP2 fully_shard"})})
    comparison.add_mechanisms(row)
    assert row.differing == ["mechanism.optimizer_impl", "env.FLAGS_cudnn_deterministic"]
    assert row.settings["env.FLAGS_cudnn_deterministic"] == {"paddle": "1", "torch": "(not set)"}
    assert any(w.startswith("mechanism optimizer_impl differs") for w in row.warnings)  # like-for-like: warned


def test_a_published_row_shows_its_differences_without_warning_and_mixed_rows_are_named():
    row = _Row({"paddle": _side("paddle", {"optimizer_impl": "for_loop"}, "published"),
                "torch": _side("torch", {"optimizer_impl": "foreach"}, "published")})
    comparison.add_mechanisms(row)
    assert row.differing == ["mechanism.optimizer_impl"] and row.warnings == []
    assert comparison.title([row]).startswith("Published comparison")
    mixed = _Row({"paddle": _side("paddle", {}, "published"), "torch": _side("torch", {})})
    comparison.add_mechanisms(mixed)
    assert comparison.kind_of(mixed) == "mixed" and "different comparisons" in mixed.warnings[0]


def test_communication_overlap_and_tf32_switches_are_compared_by_what_they_mean():
    """comm_overlap: DDP's and FSDP's overlap are both overlap, Paddle stage 2 without it is not; TF32 for
    convolutions is its own mechanism, n/a on a CPU on both sides (issue 33)."""
    row = _Row({"paddle": _side("paddle", {"comm_overlap": "none: stage 2 reduces each gradient bucket synchronously",
                                           "tf32_conv": "n/a"}),
                "torch": _side("torch", {"comm_overlap": "overlapped: FSDP reduce-scatters gradients during the backward",
                                         "tf32_conv": "n/a (CPU)"})})
    comparison.add_mechanisms(row)
    assert row.differing == ["mechanism.comm_overlap"]
    assert any(w.startswith("mechanism comm_overlap differs: paddle=none: stage 2") for w in row.warnings)
    same = _Row({"paddle": _side("paddle", {"comm_overlap": "overlapped: DataParallel all-reduces gradient buckets"}),
                 "torch": _side("torch", {"comm_overlap": "overlapped: DDP all-reduces gradient buckets"})})
    comparison.add_mechanisms(same)
    assert same.differing == [] and comparison.neutral("comm_overlap", "n/a (one process)") == "n/a"


def _entries(row: str, side: str) -> tuple[dict, list[str]]:
    table = published.load(ROOT / "recipes" / "published" / f"{row}.yaml")["sides"][side]
    return {e["key"]: (e["value"], e["source"]) for e in table["set"]}, [e["what"] for e in table["not_reproduced"]]


@pytest.mark.parametrize("row, matmul, conv", [("llava7b_sft", True, True), ("qwen2vl2b_sft", False, True),
                                               ("sd15_lora", True, True), ("sd3_dreambooth", False, True)])
def test_published_files_record_matmul_and_convolution_tf32_as_each_script_set_them(row, matmul, conv):
    knobs, _ = _entries(row, "torch")
    assert (knobs["tf32"][0], knobs["tf32_conv"][0]) == (matmul, conv)


@pytest.mark.parametrize("row", ["llava7b_pretrain", "llava13b_sft", "llava7b_lora", "qwen2vl2b_sft", "qwen2vl7b_sft"])
def test_paddles_stage2_without_overlap_is_recorded_with_paddlenlps_line(row):
    knobs, _ = _entries(row, "paddle")
    assert knobs["stage2_overlap"] == (False, "PaddlePaddle/PaddleNLP@418c3a511dcf:paddlenlp/trainer/trainer.py#L2133")


@pytest.mark.parametrize("row", sorted(p.stem for p in (ROOT / "recipes" / "published").glob("*.yaml")))
def test_every_launchers_timeout_is_recorded_on_both_sides(row):
    for side in ("paddle", "torch"):
        assert any(w.startswith("timeout 30m around the launcher") for w in _entries(row, side)[1]), side


@pytest.mark.parametrize("row", ["sd3_dreambooth", "sd3_lora"])
def test_sd3_records_accelerates_end_of_pass_step_and_validation_in_the_timed_loop(row):
    table = published.load(ROOT / "recipes" / "published" / f"{row}.yaml")
    torch_side = {e["what"]: e["source"] for e in table["sides"]["torch"]["not_reproduced"]}
    end_of_pass = next(w for w in torch_side if w.startswith("accelerate 1.1.1 also ends an accumulation"))
    assert "D/ceil(D/4)" in end_of_pass and "not 4" in end_of_pass
    assert torch_side[end_of_pass] == "huggingface/accelerate@cdde654039e6:src/accelerate/accelerator.py#L1027"
    assert not any("4 samples per optimizer step" in w for w in torch_side)
    for side, every in (("paddle", "every 20th"), ("torch", "every 100th")):  # epoch % N == 0 holds at epoch 0 too
        assert any(w.startswith(f"validation inside the timed loop after the first pass over the data and {every} "
                                "after it") for w in (e["what"] for e in table["sides"][side]["not_reproduced"])), side
