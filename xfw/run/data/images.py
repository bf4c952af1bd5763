"""Image preprocessing, framework-free (Pillow + numpy), written to give what transformers' own
processors give (tests/contract/test_preprocessing.py holds them equal to 1e-5 on photographs):

* :func:`clip_image`: CLIPImageProcessor (resize the shorter side, centre crop, rescale, normalise);
  LLaVA's "square" mode, which PaddleMIX's LLaVA scripts ran.
* :func:`anyres_tiles`: LlavaNextImageProcessor (LLaVA-1.6 AnyRes: the best-fit grid resolution,
  aspect-preserving resize, zero padding, tiles, and the whole image resized as the base tile).
* :func:`qwen2vl_image`: Qwen2VLImageProcessor's smart resize (sides multiples of patch x merge,
  pixels within [min_pixels, max_pixels]), after PaddleMIX's cap on the longer side.
* :func:`sd_image`: the Stable Diffusion training scripts' resize, centre crop and scale to [-1, 1].

Every resize goes through Pillow on 8-bit RGB, as transformers' slow processors do; arithmetic
follows theirs (rescale in float64, then float32; normalise in float32). Outputs are float32,
channels first.
"""

from __future__ import annotations

import math

import numpy as np
from PIL import Image

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
RESAMPLE = {"bilinear": Image.BILINEAR, "bicubic": Image.BICUBIC, "lanczos": Image.LANCZOS, "nearest": Image.NEAREST}


MAX_IMAGE_PIXELS = 1 << 26
"""The most pixels xfw decodes from one image (67,108,864, e.g. 8192 x 8192): an image header claims its
size before any pixel is read, so a decompression bomb (100000 x 100000 in a few KB) is refused
before it costs memory. Pillow's own limit (89,478,485 pixels) only warns below twice that."""


def load_rgb(path) -> Image.Image:
    """An image file as 8-bit RGB (any mode Pillow reads is converted, as the processors do).
    Anything that is not an image Pillow decodes whole (a truncated file, a header claiming more
    than :data:`MAX_IMAGE_PIXELS`, a file Pillow's plugins choke on) is a ValueError saying why."""
    try:
        pillow_limit, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, None  # the check below is stricter
        try:
            image = Image.open(path)  # reads the header only
        finally:
            Image.MAX_IMAGE_PIXELS = pillow_limit
        with image:
            width, height = image.size
            if width * height > MAX_IMAGE_PIXELS:
                raise ValueError(f"its header claims {width}x{height} pixels, more than the {MAX_IMAGE_PIXELS:,} "
                                 "xfw decodes (a decompression bomb, or an image to shrink first)")
            if width < 1 or height < 1:
                raise ValueError(f"its header claims {width}x{height} pixels")
            return image.convert("RGB")
    except ValueError:
        raise
    except Image.DecompressionBombError as err:
        raise ValueError(f"a decompression bomb ({err})") from None
    except MemoryError:
        raise ValueError("decoding it ran out of memory") from None
    except Exception as err:  # noqa: BLE001 - Pillow's plugins raise OSError, SyntaxError, struct.error, ...
        raise ValueError(f"not an image Pillow can decode ({type(err).__name__}: {str(err)[:160]})") from None


def _normalise(image: Image.Image | np.ndarray, mean=OPENAI_CLIP_MEAN, std=OPENAI_CLIP_STD) -> np.ndarray:
    """8-bit HWC -> float32 CHW: x / 255 (in float64, then float32), then (x - mean) / std in float32."""
    pixels = (np.asarray(image).astype(np.float64) * (1 / 255)).astype(np.float32)
    pixels = (pixels - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)
    return np.ascontiguousarray(pixels.transpose(2, 0, 1))


def _resize_shorter(image: Image.Image, size: int, resample) -> Image.Image:
    """The shorter side to ``size``, the longer one ``int(size * long / short)`` (transformers' rule)."""
    width, height = image.size
    short, long = (width, height) if width <= height else (height, width)
    new_long = int(size * long / short)
    target = (size, new_long) if width <= height else (new_long, size)
    return image.resize(target, resample=resample)


def _center_crop(image: Image.Image, height: int, width: int) -> Image.Image:
    """The centre ``height`` x ``width`` (top-left at ((H - h) // 2, (W - w) // 2)); images smaller
    than the crop are zero-padded around, as transformers' center_crop does."""
    full_w, full_h = image.size
    if full_h >= height and full_w >= width:
        top, left = (full_h - height) // 2, (full_w - width) // 2
        return image.crop((left, top, left + width, top + height))
    canvas_h, canvas_w = max(height, full_h), max(width, full_w)
    canvas = Image.new("RGB", (canvas_w, canvas_h))
    pad_top, pad_left = math.ceil((canvas_h - full_h) / 2), math.ceil((canvas_w - full_w) / 2)
    canvas.paste(image, (pad_left, pad_top))
    top, left = (full_h - height) // 2 + pad_top, (full_w - width) // 2 + pad_left
    return canvas.crop((max(0, left), max(0, top), min(canvas_w, left + width), min(canvas_h, top + height)))


def clip_image(image: Image.Image, size: int, resample=Image.BICUBIC) -> np.ndarray:
    """CLIPImageProcessor with shortest_edge = crop = ``size``: ``[3, size, size]``."""
    return _normalise(_center_crop(_resize_shorter(image, size, resample), size, size))


# -- LLaVA-1.6 AnyRes --------------------------------------------------------------------------------

def _patch_output_size(image_hw: tuple[int, int], target: tuple[int, int]) -> tuple[int, int]:
    """transformers' get_patch_output_size: fit inside ``target`` keeping the aspect ratio."""
    height, width = image_hw
    target_h, target_w = target
    scale_w, scale_h = target_w / width, target_h / height
    if scale_w < scale_h:
        return min(math.ceil(height * scale_w), target_h), target_w
    return target_h, min(math.ceil(width * scale_h), target_w)


def anyres_tiles(image: Image.Image, tile: int, best: tuple[int, int], resample=Image.BICUBIC) -> np.ndarray:
    """LlavaNextImageProcessor for one image and its best-fit resolution ``best`` (height, width;
    ``xfw.contract.families.llava.select_best_resolution``): ``[1 + rows * cols, 3, tile, tile]``, the
    whole image squashed to one tile first, then the padded grid's tiles row by row."""
    width, height = image.size
    new_h, new_w = _patch_output_size((height, width), best)
    resized = image.resize((new_w, new_h), resample=resample)
    canvas = Image.new("RGB", (best[1], best[0]))  # zeros: the processor pads with 0
    canvas.paste(resized, ((best[1] - new_w) // 2, (best[0] - new_h) // 2))
    tiles = [image.resize((tile, tile), resample=resample)]
    tiles += [canvas.crop((x, y, x + tile, y + tile)) for y in range(0, best[0], tile) for x in range(0, best[1], tile)]
    return np.stack([clip_image(t, tile, resample) for t in tiles])


# -- Qwen2-VL ----------------------------------------------------------------------------------------

def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's target size: both sides multiples of ``factor``, pixels within [min_pixels,
    max_pixels], the aspect ratio kept as closely as possible (Python's round, as the processor)."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"aspect ratio {max(height, width) / min(height, width):.0f} is above Qwen2-VL's limit of 200")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def cap_longer_side(image: Image.Image, limit: int | None) -> Image.Image:
    """PaddleMIX's ``_preprocess_image`` (image_resolution): shrink with nearest-neighbour so the
    longer side is at most ``limit``; smaller images are left alone."""
    width, height = image.size
    if limit is None or max(width, height) <= limit:
        return image
    factor = limit / max(width, height)
    return image.resize((int(width * factor), int(height * factor)), resample=Image.NEAREST)


def qwen2vl_image(image: Image.Image, *, factor: int, min_pixels: int, max_pixels: int,
                  max_side: int | None = None) -> np.ndarray:
    """Qwen2VLImageProcessor up to its patch layout: ``[3, H, W]`` with H, W multiples of ``factor``
    (patch x merge); ``xfw.contract.families.qwen2vl.patchify`` makes the patches."""
    image = cap_longer_side(image, max_side)
    height, width = smart_resize(image.size[1], image.size[0], factor, min_pixels, max_pixels)
    return _normalise(image.resize((width, height), resample=Image.BICUBIC))


# -- Stable Diffusion --------------------------------------------------------------------------------

def sd_image(image: Image.Image, size: int, interpolation: str = "bilinear") -> np.ndarray:
    """The SD training scripts' transforms: shorter side to ``size`` (torchvision's Resize on a PIL
    image), centre crop, to [0, 1], then normalised with mean = std = 0.5 to [-1, 1]: ``[3, size, size]``."""
    image = _center_crop(_resize_shorter(image, size, RESAMPLE[interpolation]), size, size)
    return _normalise(image, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))
