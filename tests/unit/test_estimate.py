"""The memory estimate: bytes per parameter by AMP level and ZeRO stage, activations, and its error
on the committed H100 runs."""

import json

import pytest
from click.testing import CliRunner

from xfw import cli
from xfw.contract.families.sd15 import activations as sd15
from xfw.report import estimate as est
from xfw.recipe import load_recipe
from xfw.recipe.spec import resolve_spec
from xfw.report.results import RunResult

from conftest import ROOT

H100 = ROOT / "results" / "h100"


def invoke(*args):
    return CliRunner().invoke(cli.main, [str(a) for a in args], catch_exceptions=False)


def spec_of(path, *overrides):
    return resolve_spec(load_recipe(path, list(overrides)), backend="estimate", run_id="test")


def test_o2_holds_low_precision_weights_an_fp32_master_copy_and_adam_for_trainable_parameters():
    states = est.model_state_bytes(10, 4, amp_level="O2", sharding="none", num_processes=1)
    assert states == {"weights": 20, "master weights": 16, "gradients": 8, "optimizer states": 32}
    o1 = est.model_state_bytes(10, 4, amp_level="O1", sharding="none", num_processes=1)
    assert o1 == {"weights": 40, "master weights": 0, "gradients": 16, "optimizer states": 32}


@pytest.mark.parametrize("stage,sharded", [("stage1", {"master weights", "optimizer states"}),
                                           ("stage2", {"master weights", "optimizer states", "gradients"}),
                                           ("stage3", {"master weights", "optimizer states", "gradients", "weights"})])
def test_each_zero_stage_divides_what_it_shards_by_the_process_count(stage, sharded):
    full = est.model_state_bytes(10, 4, amp_level="O2", sharding="none", num_processes=4)
    split = est.model_state_bytes(10, 4, amp_level="O2", sharding=stage, num_processes=4)
    assert {k for k in full if split[k] == full[k] / 4} == sharded
    assert {k for k in full if split[k] == full[k]} == set(full) - sharded


@pytest.mark.parametrize("run, counts", [("llava7b-lora/micro16", (340_799_488, 7_383_246_848)),
                                         ("qwen2vl2b-sft/micro8", (1_577_802_240, 2_208_985_600)),
                                         ("sd15-lora/micro96", (797_184, 1_067_032_491)),  # UNet attention LoRA
                                         ("sd3-lora/micro32", (1_179_648, 2_113_327_331))])  # MMDiT attention LoRA
def test_trainable_split_matches_what_the_adapter_reported_on_the_gpu(run, counts):
    spec = json.loads((H100 / run / "torch" / "spec.json").read_text())
    applied = RunResult.load(H100 / run / "torch").applied
    assert est.trainable_params(spec) == counts == (applied["num_params_trainable"], applied["num_params_total"])


def test_recompute_shrinks_activations_and_fp32_doubles_them(write_recipe):
    path = write_recipe()
    plain, recomputed = (est.activation_bytes(spec_of(path, f"recompute={v}"), recompute=v) for v in (False, True))
    assert recomputed < plain
    bf16 = spec_of(path, "precision.dtype=bf16", "precision.amp_level=O1")
    fp32 = spec_of(path)
    vocab = 10 * 64 * 2 * 512  # the loss term (fp32 in both)
    assert est.activation_bytes(fp32, recompute=False) - vocab == 2 * (est.activation_bytes(bf16, recompute=False)
                                                                       - vocab)


@pytest.mark.parametrize("run", ["llava7b-lora/micro16", "llava7b-lora/micro32", "qwen2vl2b-sft/micro8",
                                 "sd3-dreambooth/micro8", "sd3-dreambooth/micro16", "sd3-lora/micro32"])
def test_the_estimate_is_within_20_percent_of_the_h100_peak_allocated(run):
    run_dir = H100 / run / "torch"
    e = est.estimate(json.loads((run_dir / "spec.json").read_text()))
    measured = RunResult.load(run_dir).measurement.mem_alloc_peak_bytes
    assert abs(e.total_bytes - measured) / measured < 0.20


def test_sd15_blocks_count_what_diffusers_keeps_for_backward():
    # ResnetBlock2D, same width, bf16 autocast: per side GroupNorm input (fp32), SiLU input (fp32), conv input
    assert sd15.resnet_per_px(320, 320, 2, True) == 2 * (4 + 4 + 2) * 320
    # a width change adds the 1x1 shortcut's bf16 input; in fp32 that input is the norm's and is not copied
    assert sd15.resnet_per_px(320, 640, 2, True) == 10 * 960 + 2 * 320
    assert sd15.resnet_per_px(320, 640, 4, False) == 12 * 960
    # BasicTransformerBlock: 3 fp32 LayerNorm inputs + 29 bf16 tensors of width d (q/k/v inputs cast 3 times)
    assert sd15.attention_block_per_token(320, 2, True) == 70 * 320
    assert sd15.attention_block_per_token(320, 4, False) == 120 * 320


def test_sd15_activations_scale_with_batch_and_pixels_and_recompute_keeps_only_block_inputs():
    arch = spec_of(ROOT / "recipes" / "sd15_lora.yaml")["model"]["arch"]  # 512 px
    small = {**arch, "data": {**arch["data"], "image_size": 256}}
    for fn in (lambda a, b: sd15.unet_activation_bytes(a, b, act=2, autocast=True, recompute=True),
               lambda a, b: sd15.unet_activation_bytes(a, b, act=2, autocast=True, recompute=False),
               lambda a, b: sd15.vae_encoder_bytes(a, b, act=2, autocast=True)):
        assert fn(arch, 8) == 8 * fn(arch, 1)
        assert fn(arch, 1) == pytest.approx(4 * fn(small, 1))  # every level has 4x the pixels at 512 px
    full = sd15.unet_activation_bytes(arch, 1, act=2, autocast=True, recompute=False)
    assert full > 4 * sd15.unet_activation_bytes(arch, 1, act=2, autocast=True, recompute=True)
    assert sd15.unet_activation_bytes(arch, 1, act=4, autocast=False, recompute=False) > full  # fp32 tensors


def test_sd15_peak_is_the_vae_encoder_with_recompute_and_the_unet_without(write_recipe):
    spec = spec_of(ROOT / "recipes" / "sd15_pretrain.yaml")
    arch, b = spec["model"]["arch"], spec["batch"]["micro"]
    vae = sd15.vae_encoder_bytes(arch, b, act=2, autocast=True)
    assert spec["recompute"] and est.activation_bytes(spec, recompute=True) == vae
    assert est.activation_bytes(spec, recompute=False) == sd15.unet_activation_bytes(arch, b, act=2, autocast=True,
                                                                                   recompute=False) > vae
    tiny = est.estimate(spec_of(ROOT / "recipes" / "tiny" / "sd15_pretrain.yaml"))  # fp32, one resnet per block
    assert tiny.activations > 0 and not any("no activation estimate" in n for n in tiny.notes)


@pytest.mark.parametrize("run", ["sd15-pretrain/micro64", "sd15-lora/micro96",
                                 "sd15-lora/micro128"])  # 128: the peak of step 0, which ran before the OOM
def test_the_sd15_estimate_is_within_10_percent_of_the_h100_peak_allocated(run):
    run_dir = H100 / run / "torch"
    e = est.estimate(json.loads((run_dir / "spec.json").read_text()))
    measured = RunResult.load(run_dir).measurement.mem_alloc_peak_bytes
    assert abs(e.total_bytes - measured) / measured < 0.10


@pytest.mark.parametrize("run", ["llava7b-lora/micro64", "qwen2vl2b-sft/micro32", "sd3-lora/micro64"])
def test_the_estimate_exceeds_the_h100_capacity_where_it_ran_out_of_memory(run):
    e = est.estimate(json.loads((H100 / run / "torch" / "spec.json").read_text()))
    assert e.total_bytes > 79.18 * est.GIB  # "GPU 0 has a total capacity of 79.18 GiB" (maxbatch.json)


def test_cli_prints_the_estimate_next_to_a_runs_measurement(tmp_path, write_recipe, fake_backend):
    result = invoke("estimate", "--run", H100 / "qwen2vl2b-sft" / "micro8" / "torch")
    assert result.exit_code == 0
    assert "| measured peak allocated (cuda_allocator) | 52.07 |" in result.output
    assert "| estimate error vs allocated | -3% |" in result.output
    plain = invoke("estimate", write_recipe(), "--set", "parallel.sharding=stage2")
    assert plain.exit_code == 0 and "| stage3 |" in plain.output and "measured" not in plain.output


def test_cli_wants_a_recipe_or_a_run_and_names_bad_keys(write_recipe):
    assert invoke("estimate").exit_code == 2
    bad = invoke("estimate", write_recipe(batch={"global": 5, "micro": 2}))
    assert bad.exit_code == 2 and "batch.global: 5 is not divisible" in bad.output
