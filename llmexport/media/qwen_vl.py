"""Qwen-VL image inputs as MNN 3.6.1's runtime builds them, and as HF's processor does.

The runtime (omni.cpp ``Omni::qwen2VisionProcess``; the five-input layout with ``idx_tensor``
fourth, which selects patch 16): the image resized bilinearly to the requested size rounded to a
multiple of ``patch * merge`` (the identity when it already is one), BGR -> RGB,
``(pixel - image_mean) * image_norm``, the frame repeated for the temporal patch of 2, then
- ``patches`` [grid_h * grid_w, 3 * 2 * patch * patch]: merge blocks row-major, inside a block
  its 2x2 patches row-major, each patch (channel, time, row, column);
- ``position_ids`` [2, n] int32: each patch's (row, column) on the patch grid, in that order;
- ``attention_mask`` [1, n, n] zeros;
- ``idx_tensor`` [4, n] int32 / ``weight_tensor`` [4, n] float: the learned ``num_grid_per_side``
  square of position embeddings sampled bilinearly (align_corners) at each patch, the four corners
  (floor/ceil row, floor/ceil column) and their weights.

HF's processor (transformers ``Qwen2VLImageProcessorPil``, which Qwen3.5 and Qwen3-VL use): the
same patch layout and the same normalisation (rescale 1/255, then mean = std = 0.5 per channel),
after ``smart_resize`` (sides multiples of ``patch * merge`` within the pixel budget). An image
whose sides are multiples of ``patch * merge`` and within the budget is not resized by either,
so both see the same pixels; tests/test_qwen3_5_vision.py proves the rest equal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from PIL import Image

TEMPORAL = 2  # omni.cpp: temporal_patch_size, fixed
MERGE = 2  # omni.cpp: merge_size, fixed
#: HF's normalisation (rescale 1/255, mean = std = 0.5) as the runtime's (pixel - mean) * norm
IMAGE_MEAN = 127.5
IMAGE_NORM = 1.0 / 127.5


@dataclass(frozen=True)
class VisionInputs:
    """``visual.mnn``'s five inputs for one image, by name."""

    patches: np.ndarray
    position_ids: np.ndarray
    attention_mask: np.ndarray
    idx_tensor: np.ndarray
    weight_tensor: np.ndarray

    def feeds(self) -> dict[str, np.ndarray]:
        return dict(vars(self))

    @property
    def soft_tokens(self) -> int:
        return self.patches.shape[0] // (MERGE * MERGE)


def runtime_pixels(image: "Image.Image") -> np.ndarray:
    """[3, H, W] float32: RGB ``(pixel - IMAGE_MEAN) * IMAGE_NORM``, what the runtime's resize
    gives for an image already at its requested size."""
    rgb = np.asarray(image.convert("RGB"), dtype=np.float32).transpose(2, 0, 1)
    return (rgb - np.float32(IMAGE_MEAN)) * np.float32(IMAGE_NORM)


def block_order(grid_h: int, grid_w: int) -> np.ndarray:
    """Row-major patch index of each patch in the runtime's (and HF's) merge-block order."""
    index = np.arange(grid_h * grid_w).reshape(grid_h // MERGE, MERGE, grid_w // MERGE, MERGE)
    return index.transpose(0, 2, 1, 3).reshape(-1)


def vision_inputs(pixels: np.ndarray, patch: int, grid_side: int) -> VisionInputs:
    """The runtime's inputs for normalised ``pixels`` [3, H, W] (sides multiples of ``patch * MERGE``)."""
    channels, height, width = pixels.shape
    if height % (patch * MERGE) or width % (patch * MERGE):
        raise ValueError(f"image {height}x{width} is not a multiple of {patch * MERGE} on both sides")
    gh, gw = height // patch, width // patch
    frames = np.stack([pixels] * TEMPORAL)  # [T, C, H, W]
    blocks = frames.reshape(TEMPORAL, channels, gh // MERGE, MERGE, patch, gw // MERGE, MERGE, patch)
    patches = blocks.transpose(2, 5, 3, 6, 1, 0, 4, 7).reshape(gh * gw, channels * TEMPORAL * patch * patch)
    order = block_order(gh, gw)
    rows, cols = order // gw, order % gw
    idx, weight = _interpolation(gh, gw, grid_side)
    return VisionInputs(np.ascontiguousarray(patches, dtype=np.float32),
                        np.stack([rows, cols]).astype(np.int32), np.zeros((1, gh * gw, gh * gw), np.float32),
                        idx[:, order].astype(np.int32), weight[:, order].astype(np.float32))


def _interpolation(gh: int, gw: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Row-major corners and weights, in float32 as omni.cpp computes them."""
    h = np.arange(gh, dtype=np.float32) * np.float32(side - 1) / np.float32(gh - 1)
    w = np.arange(gw, dtype=np.float32) * np.float32(side - 1) / np.float32(gw - 1)
    h0, w0 = h.astype(np.int64), w.astype(np.int64)
    h1, w1 = np.minimum(h0 + 1, side - 1), np.minimum(w0 + 1, side - 1)
    dh, dw = (h - h0.astype(np.float32))[:, None], (w - w0.astype(np.float32))[None, :]
    one = np.float32(1.0)
    idx = np.stack([(h0[:, None] * side + w0[None, :]), (h0[:, None] * side + w1[None, :]),
                    (h1[:, None] * side + w0[None, :]), (h1[:, None] * side + w1[None, :])])
    weight = np.stack([(one - dh) * (one - dw), (one - dh) * dw, dh * (one - dw), dh * dw])
    return idx.reshape(4, -1), weight.reshape(4, -1).astype(np.float32)


def hf_pixel_values(image: "Image.Image", patch: int) -> tuple["np.ndarray", list[int]]:
    """HF's processor output for one image kept at its size: (pixel_values [n, 3*2*patch*patch],
    image_grid_thw [1, h, w])."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    pixels = image.width * image.height
    processor = Qwen2VLImageProcessorPil(patch_size=patch, merge_size=MERGE, temporal_patch_size=TEMPORAL,
                                         image_mean=[0.5] * 3, image_std=[0.5] * 3,
                                         size={"shortest_edge": pixels, "longest_edge": pixels})
    out = processor(images=[image], return_tensors="np")
    return out["pixel_values"], [int(v) for v in out["image_grid_thw"][0]]
