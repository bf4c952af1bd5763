"""Stable Diffusion families in the core: presets check, batches carry every random draw, same bytes per seed."""

import numpy as np
import pytest

from xfw.contract import presets, synthetic
from xfw.contract.families import sd3, sd15
from xfw.recipe import load_recipe, recipe_from_dict
from xfw.recipe.spec import resolve_spec

from conftest import ROOT, TINY_RECIPE


def spec(preset: str, **changes):
    stage = "pretrain" if presets.PRESETS[preset]["family"] == "sd15" else "dreambooth"
    data = {**TINY_RECIPE, "model": {"preset": preset}, "stage": stage, **changes}
    return resolve_spec(recipe_from_dict(data), backend="x", run_id="r")


def arch_error(preset: str, override: dict, image_size=None) -> presets.ArchError:
    with pytest.raises(presets.ArchError) as info:
        presets.resolve_arch(preset, override, image_size, None)
    return info.value


@pytest.mark.parametrize("preset", ["sd-1.5", "sd-3-medium", "tiny-sd15", "tiny-sd3"])
def test_diffusion_presets_resolve(preset):
    assert presets.resolve_arch(preset, {}, None, None)["family"] in ("sd15", "sd3")


@pytest.mark.parametrize("preset", ["tiny-sd15", "tiny-sd3"])
def test_batches_are_bit_identical_for_the_same_seed_and_differ_by_index(preset):
    s = spec(preset)
    a, b, other = synthetic.sample(s, 0, 2), synthetic.sample(s, 0, 2), synthetic.sample(s, 0, 3)
    assert sorted(a) == sorted(b)
    for key in a:
        assert a[key].tobytes() == b[key].tobytes() and a[key].dtype == b[key].dtype
    assert not np.array_equal(a["noise"], other["noise"])


def test_sd15_batch_holds_images_clip_ids_latent_noise_and_timesteps():
    arch = presets.resolve_arch("sd-1.5", {}, None, None)
    batch = sd15.make_batch(arch, 3, np.random.default_rng(0))
    pixels, ids = batch["pixel_values"], batch["input_ids"]
    assert pixels.shape == (3, 3, 512, 512) and pixels.dtype == np.float32
    assert -1.0 <= pixels.min() and pixels.max() <= 1.0
    assert ids.shape == (3, 77) and ids.dtype == np.int64
    assert (ids[:, 0] == 49406).all() and (ids[:, -1] == 49407).all() and ids[:, 1:-1].max() < 49406
    assert batch["noise"].shape == (3, 4, 64, 64) and batch["noise"].dtype == np.float32  # 512 / 8
    t = batch["timesteps"]
    assert t.shape == (3,) and t.dtype == np.int64 and ((0 <= t) & (t < 1000)).all()


def test_sd3_batch_holds_precomputed_text_embeddings_latent_noise_and_sigmas():
    arch = presets.resolve_arch("sd-3-medium", {}, None, None)
    batch = sd3.make_batch(arch, 2, np.random.default_rng(0))
    assert batch["prompt_embeds"].shape == (2, 154, 4096)
    assert batch["pooled_prompt_embeds"].shape == (2, 2048)
    assert batch["noise"].shape == (2, 16, 64, 64)
    assert all(v.dtype == np.float32 for v in batch.values())
    assert ((0 < batch["sigmas"]) & (batch["sigmas"] <= 1)).all()


def test_ddpm_schedule_is_stable_diffusions_scaled_linear():
    alphas = sd15.alphas_cumprod(presets.PRESETS["sd-1.5"]["scheduler"])
    assert alphas.shape == (1000,) and alphas.dtype == np.float64
    assert alphas[0] == pytest.approx(1 - 0.00085)
    assert alphas[-1] == pytest.approx(0.0046600, rel=1e-4)  # diffusers' DDPMScheduler, same config
    assert (np.diff(alphas) < 0).all()


def test_sd3_sigmas_follow_the_shifted_flow_matching_grid():
    scheduler = dict(presets.PRESETS["sd-3-medium"]["scheduler"])
    uniform = sd3.sample_sigmas({**scheduler, "timestep_sampling": "uniform"}, 20000, np.random.default_rng(0))
    # Grid s = k / 1000, k = 1..1000, shifted by 3: sigma = 3s / (1 + 2s).
    s = 3 * uniform / (3 - 2 * uniform)
    assert np.allclose(s * 1000, np.round(s * 1000), atol=1e-3)
    assert uniform.max() == pytest.approx(1.0)
    lognormal = sd3.sample_sigmas(scheduler, 20000, np.random.default_rng(0))
    # logit-normal(0, 1) is symmetric about s = 0.5, which the shift maps to 0.75.
    assert np.median(lognormal) == pytest.approx(0.75, abs=0.01)


@pytest.mark.parametrize("preset, override, image_size, key", [
    ("tiny-sd15", {"unet": {"cross_attention_dim": 48}}, None, "model.arch.unet.cross_attention_dim"),
    ("tiny-sd15", {"unet": {"up_block_types": ["UpBlock2D"]}}, None, "model.arch.unet.up_block_types"),
    ("tiny-sd15", {"unet": {"down_block_types": ["CrossAttnDownBlock2D", "Nope"]}}, None, "model.arch.unet.down_block_types"),
    ("tiny-sd15", {"unet": {"attention_head_dim": 3}}, None, "model.arch.unet.attention_head_dim"),
    ("tiny-sd15", {"vae": {"norm_num_groups": 5}}, None, "model.arch.vae.norm_num_groups"),
    ("tiny-sd15", {"scheduler": {"beta_schedule": "cosine"}}, None, "model.arch.scheduler.beta_schedule"),
    ("tiny-sd15", {}, 34, "data.image_size"),  # 17-px latents do not halve into the UNet's 2 levels
    ("sd-1.5", {}, 500, "data.image_size"),
    ("tiny-sd3", {"text": {"dim": 64}}, None, "model.arch.text.dim"),
    ("tiny-sd3", {"text": {"precomputed": False}}, None, "model.arch.text.precomputed"),
    ("tiny-sd3", {"transformer": {"caption_projection_dim": 48}}, None, "model.arch.transformer.caption_projection_dim"),
    ("tiny-sd3", {"transformer": {"in_channels": 4}}, None, "model.arch.transformer.in_channels"),
    ("tiny-sd3", {}, 80, "data.image_size"),  # 20 patches per side > pos_embed_max_size 16
    ("tiny-sd3", {"scheduler": {"timestep_sampling": "mode"}}, None, "model.arch.scheduler.timestep_sampling"),
])
def test_inconsistent_diffusion_architectures_are_rejected_with_the_key(preset, override, image_size, key):
    assert arch_error(preset, override, image_size).key == key


def test_parameter_counts_match_the_published_models():
    # What diffusers 0.42 / transformers 5.2 build from the published config.json files of
    # runwayml/stable-diffusion-v1-5 and stabilityai/stable-diffusion-3-medium-diffusers
    # (counted once on the meta device; tests/contract checks the tiny presets every run).
    assert presets.count_params(presets.PRESETS["sd-1.5"]) == {
        "unet": 859_520_964, "vae": 83_653_863, "text_encoder": 123_060_480, "total": 1_066_235_307}
    assert presets.count_params(presets.PRESETS["sd-3-medium"]) == {
        "transformer": 2_028_328_000, "vae": 83_819_683, "total": 2_112_147_683}


def test_sd3_last_block_reads_text_without_updating_it():
    t = presets.PRESETS["tiny-sd3"]["transformer"]
    d = t["num_heads"] * t["head_dim"]
    one_more = sd3.count_transformer({**t, "num_layers": t["num_layers"] + 1}) - sd3.count_transformer(t)
    # A full joint block: 2 x 6-way modulation, 8 attention projections, 2 feed-forwards.
    assert one_more == 2 * (6 * d * d + 6 * d) + 8 * (d * d + d) + 2 * (8 * d * d + 5 * d)


def test_seed_rows_carry_the_settings_paddlemixs_scripts_ran():
    """docs/recipes.md: SD1.5 pretraining ran 80 per GPU at 256 px (not the seed note's global 80 at 512)."""
    rows = {name: load_recipe(ROOT / "recipes" / f"{name}.yaml")
            for name in ("sd15_pretrain", "sd15_lora", "sd3_dreambooth", "sd3_lora")}
    for name, r in rows.items():
        assert (r.parallel.nnodes, r.parallel.nproc_per_node) == (1, 8), name
        assert r.precision.dtype == ("bf16" if name.startswith("sd15") else "fp16"), name
    assert [rows[n].data.image_size for n in rows] == [256, 512, 512, 512]
    assert [rows[n].batch.global_size for n in rows] == [80 * 8, 96 * 8, 8, 8]
    assert [rows[n].optimizer.max_grad_norm for n in rows] == [None, 1.0, 1.0, 1.0]


def test_tiny_diffusion_presets_have_display_names():
    assert presets.display_name("tiny-sd15") == "Tiny SD1.5" and presets.display_name("sd-3-medium") == "Stable Diffusion 3"
