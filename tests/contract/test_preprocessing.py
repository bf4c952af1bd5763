"""The core's image preprocessing (xfw.run.data.images) equals transformers' own processors on real
photographs: CLIPImageProcessor (LLaVA's square mode), LlavaNextImageProcessor (AnyRes tiles, and
the unpadded token count transformers' model packs), Qwen2VLImageProcessor (smart resize and the
patch layout), to 1e-5.

The photographs are scikit-learn's sample images (``china.jpg``, ``flower.jpg``), shipped in the
Paddle environment; crops of them give other aspect ratios, so AnyRes picks other grids.
"""

import numpy as np
import pytest

from xfw.contract import presets
from xfw.contract.families import llava, qwen2vl
from xfw.run.data import images

from conftest import ROOT

pytestmark = pytest.mark.contract
PHOTOS = ROOT / ".venv" / "paddle" / "lib" / "python3.11" / "site-packages" / "sklearn" / "datasets" / "images"
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def photos():
    found = [PHOTOS / name for name in ("china.jpg", "flower.jpg")]
    if not all(p.is_file() for p in found):
        pytest.skip(f"scikit-learn's sample photographs are not at {PHOTOS} (make setup installs them with Paddle)")
    pictures = [images.load_rgb(p) for p in found]
    china, flower = pictures
    # Real photographs in other shapes: a tall and a wide crop, and a small one (upscaled by the processors).
    return {"china": china, "flower": flower, "tall": china.crop((100, 0, 300, 427)),
            "wide": flower.crop((0, 150, 640, 330)), "small": flower.crop((200, 100, 290, 170))}


NAMES = ["china", "flower", "tall", "wide", "small"]


@pytest.mark.parametrize("name", NAMES)
def test_clip_square_mode_equals_clip_image_processor(photos, name):
    from transformers import CLIPImageProcessor

    processor = CLIPImageProcessor(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336})
    expected = processor(images=photos[name], return_tensors="np")["pixel_values"][0]
    got = images.clip_image(photos[name], 336)
    assert got.shape == expected.shape == (3, 336, 336)
    np.testing.assert_allclose(got, expected, atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("name", NAMES)
def test_anyres_tiles_and_token_counts_equal_llava_next(photos, name):
    import torch
    from transformers import LlavaNextImageProcessor
    from transformers.models.llava_next.modeling_llava_next import get_anyres_image_grid_shape, unpad_image

    arch = presets.resolve_arch("llava-1.6-vicuna-7b", {}, None, None)
    pinpoints = arch["anyres"]["grid_pinpoints"]
    processor = LlavaNextImageProcessor(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336},
                                        image_grid_pinpoints=pinpoints)
    out = processor(images=photos[name], return_tensors="np")
    image = photos[name]
    hw = (image.size[1], image.size[0])
    best = llava.select_best_resolution(hw, pinpoints)
    got = images.anyres_tiles(image, 336, best)
    expected = out["pixel_values"][0]
    assert got.shape == expected.shape and tuple(out["image_sizes"][0]) == hw
    np.testing.assert_allclose(got, expected, atol=TOLERANCE, rtol=0)
    # The token count transformers' LlavaNext packs for this image: base tile + unpadded grid + newlines.
    rows, cols = get_anyres_image_grid_shape(hw, pinpoints, 336)
    g = 336 // 14
    kept = unpad_image(torch.zeros(1, rows * g, cols * g), torch.tensor(hw))
    layout = llava.anyres_layout(arch, hw)
    assert (layout["rows"], layout["cols"], layout["tiles"]) == (rows, cols, got.shape[0])
    assert layout["tokens"] == g * g + kept.shape[1] * (kept.shape[2] + 1)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("cap", [None, 512], ids=["processor", "paddlemix-512"])
def test_qwen2vl_dynamic_resolution_equals_qwen2vl_image_processor(photos, name, cap):
    from transformers import Qwen2VLImageProcessor

    arch = presets.resolve_arch("qwen2-vl-2b", {}, None, None)
    v = arch["vision"]
    min_pixels, max_pixels = 3136, 256 * 28 * 28  # a cap that binds on the full photographs
    processor = Qwen2VLImageProcessor(min_pixels=min_pixels, max_pixels=max_pixels, patch_size=v["patch_size"],
                                      temporal_patch_size=v["temporal_patch_size"], merge_size=v["spatial_merge_size"])
    image = images.cap_longer_side(photos[name], cap)  # PaddleMIX's image_resolution, before the processor
    out = processor(images=image, return_tensors="np")
    resized = images.qwen2vl_image(photos[name], factor=28, min_pixels=min_pixels, max_pixels=max_pixels, max_side=cap)
    patches = qwen2vl.patchify(resized, arch)
    grid = [1, resized.shape[1] // 14, resized.shape[2] // 14]
    assert out["image_grid_thw"][0].tolist() == grid
    assert patches.shape == out["pixel_values"].shape
    np.testing.assert_allclose(patches, out["pixel_values"], atol=TOLERANCE, rtol=0)
