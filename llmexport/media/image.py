"""Gemma4 image preprocessing, equal to transformers' ``Gemma4ImageProcessorPil``.

Mirrors image_processing_pil_gemma4.py (transformers 5.x): the target size keeps the aspect
ratio and fills the patch budget (``max_soft_tokens * pooling**2`` patches of ``patch`` pixels,
both sides multiples of ``patch * pooling``), the resize is PIL bicubic (with PIL's
antialiasing), pixels are scaled by 1/255, patches are laid out (dy, dx, channel) in row-major
patch order, positions are (x = column, y = row), and padding rows carry zeros at (-1, -1).

MNN's runtime (omni.cpp ``gemma4VisionProcess``, 3.6.1) resizes differently: it rounds each side
of the requested size to a multiple of 48 and resizes bilinearly without antialiasing. Giving it
an image that already has ``processed_size`` makes its resize the identity, so both sides see the
same pixels: ``resize_to_processed`` does that with HF's filter, and ``save_image_for_runtime``
saves it losslessly and returns the prompt fragment ``<img><hw>H,W</hw>path</img>``. The size
must be given: without ``<hw>`` the runtime uses ``image_size`` for the first image and, since it
keeps the size of the last image it processed, that image's size for every later one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # Pillow is needed only to resize images, not to compute sizes
    from PIL import Image

PATCH = 16
POOLING = 3
MAX_SOFT_TOKENS = 280


@dataclass(frozen=True)
class ImagePatches:
    """One preprocessed image: ``patches`` [max_patches, 3*patch*patch] float32,
    ``positions`` [max_patches, 2] int64 (x, y; -1 for padding), ``soft_tokens`` real tokens,
    ``size`` the (height, width) the image was resized to."""

    patches: np.ndarray
    positions: np.ndarray
    soft_tokens: int
    size: tuple[int, int]

    @property
    def num_patches(self) -> int:
        return self.soft_tokens * POOLING * POOLING


def processed_size(height: int, width: int, patch: int = PATCH, pooling: int = POOLING,
                   max_soft_tokens: int = MAX_SOFT_TOKENS) -> tuple[int, int]:
    """(height, width) HF's processor resizes an image of this size to (get_aspect_ratio_preserving_size)."""
    max_patches = max_soft_tokens * pooling * pooling
    target_px = max_patches * patch * patch
    factor = math.sqrt(target_px / (height * width))
    side = pooling * patch
    th = int(math.floor(factor * height / side)) * side
    tw = int(math.floor(factor * width / side)) * side
    if th == 0 and tw == 0:
        raise ValueError(f"image {height}x{width} cannot be resized to a multiple of {side}")
    longest = (max_patches // pooling ** 2) * side
    if th == 0:
        th, tw = side, min(int(math.floor(width / height)) * side, longest)
    elif tw == 0:
        tw, th = side, min(int(math.floor(height / width)) * side, longest)
    if th * tw > target_px:
        raise ValueError(f"resizing {height}x{width} to {th}x{tw} exceeds {max_patches} patches")
    return th, tw


def runtime_size(height: int, width: int, patch: int = PATCH, pooling: int = POOLING,
                 max_soft_tokens: int = MAX_SOFT_TOKENS) -> tuple[int, int]:
    """(height, width) MNN 3.6.1's runtime resizes to for a requested ``<hw>`` size (omni.cpp
    ``gemma4VisionProcess``): each side rounded to a multiple of 48 (at least 48), then the larger
    side shrunk by 48 until the patches fit the budget. Equal to the input for HF's processed sizes."""
    side = patch * pooling
    h = max(side, int(math.floor(height / side + 0.5)) * side)  # C round(): halves away from zero
    w = max(side, int(math.floor(width / side + 0.5)) * side)
    while (h // patch) * (w // patch) > max_soft_tokens * pooling * pooling:
        if h >= w:
            h -= side
        else:
            w -= side
    return h, w


def resize_to_processed(image: "Image.Image", max_soft_tokens: int = MAX_SOFT_TOKENS) -> "Image.Image":
    """The RGB image at HF's processed size, resized with HF's filter (bicubic).

    Saved and given to MNN's runtime as ``<img><hw>H,W</hw>path</img>``, the runtime's own
    (bilinear) resize becomes the identity and its patches equal HF's.
    """
    from PIL import Image

    image = image.convert("RGB")
    h, w = processed_size(image.height, image.width, max_soft_tokens=max_soft_tokens)
    if (h, w) == (image.height, image.width):
        return image
    return image.resize((w, h), resample=Image.Resampling.BICUBIC)


def save_image_for_runtime(image: "Image.Image", path: Path | str, max_soft_tokens: int = MAX_SOFT_TOKENS) -> str:
    """Save ``resize_to_processed(image)`` at ``path`` (give it a lossless format such as .png) and
    return the prompt fragment ``<img><hw>H,W</hw>path</img>`` that makes MNN 3.6.1's runtime
    see exactly HF's pixels (and hence HF's soft-token count) for ``image``."""
    resized = resize_to_processed(image, max_soft_tokens)
    resized.save(path)
    return f"<img><hw>{resized.height},{resized.width}</hw>{path}</img>"


def patchify(pixels: np.ndarray, patch: int = PATCH) -> np.ndarray:
    """[H, W, C] -> [(H/p)*(W/p), p*p*C], patches row-major, each laid out (dy, dx, c)."""
    h, w, c = pixels.shape
    gh, gw = h // patch, w // patch
    out = pixels.reshape(gh, patch, gw, patch, c).transpose(0, 2, 1, 3, 4)
    return out.reshape(gh * gw, patch * patch * c)


def patch_positions(grid_h: int, grid_w: int) -> np.ndarray:
    """[(grid_h*grid_w), 2] (x, y) positions in the patch order of ``patchify``."""
    ys, xs = np.meshgrid(np.arange(grid_h), np.arange(grid_w), indexing="ij")
    return np.stack([xs.reshape(-1), ys.reshape(-1)], axis=-1).astype(np.int64)


def preprocess(image: "Image.Image", max_soft_tokens: int = MAX_SOFT_TOKENS) -> ImagePatches:
    """HF's patches, positions and soft-token count for one image (padded to the budget)."""
    resized = resize_to_processed(image, max_soft_tokens)
    # HF rescales in float64 and stores float32.
    pixels = (np.asarray(resized, dtype=np.uint8) * (1 / 255)).astype(np.float32)
    patches = patchify(pixels)
    grid_h, grid_w = resized.height // PATCH, resized.width // PATCH
    positions = patch_positions(grid_h, grid_w)
    budget = max_soft_tokens * POOLING * POOLING
    pad = budget - patches.shape[0]
    patches = np.concatenate([patches, np.zeros((pad, patches.shape[1]), np.float32)])
    positions = np.concatenate([positions, np.full((pad, 2), -1, np.int64)])
    return ImagePatches(patches, positions, grid_h * grid_w // POOLING ** 2, (resized.height, resized.width))


def synthetic_image(height: int, width: int, seed: int = 0) -> "Image.Image":
    """A deterministic RGB image with smooth gradients and noise (for verification prompts)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    y = np.linspace(0.0, 1.0, height)[:, None, None]
    x = np.linspace(0.0, 1.0, width)[None, :, None]
    phase = rng.uniform(0, 2 * np.pi, size=(1, 1, 3))
    base = 0.5 + 0.35 * np.sin(6 * x + 4 * y + phase)
    noise = rng.normal(0, 0.08, size=(height, width, 3))
    return Image.fromarray(np.clip((base + noise) * 255, 0, 255).astype(np.uint8), "RGB")
