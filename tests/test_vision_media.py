"""Stage 0 (vision): our image preprocessing equals HF's Gemma4 PIL image processor."""

from __future__ import annotations

import numpy as np
import PIL  # noqa: E402,F401  (pillow is a dependency)
import pytest

from llmexport.media.image import (
    MAX_SOFT_TOKENS,
    patchify,
    preprocess,
    processed_size,
    resize_to_processed,
    runtime_size,
    save_image_for_runtime,
    synthetic_image,
)

# square, wide, sides not multiples of 48, tall and thin, already at a processed size, tiny
SIZES = [(300, 300), (200, 640), (317, 451), (1000, 40), (768, 768), (20, 30)]


@pytest.fixture(scope="module")
def hf_processor():
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    return Gemma4ImageProcessorPil()


@pytest.mark.parametrize("size", SIZES)
def test_patches_positions_and_soft_tokens_equal_hf(hf_processor, size):
    image = synthetic_image(*size, seed=sum(size))
    ref = hf_processor(images=[image], return_tensors="np")
    ours = preprocess(image)
    assert ours.soft_tokens == int(ref["num_soft_tokens_per_image"][0])
    assert ours.patches.shape == ref["pixel_values"][0].shape == (MAX_SOFT_TOKENS * 9, 768)
    real = (ref["image_position_ids"][0] != -1).all(-1).sum()
    assert ours.num_patches == real
    np.testing.assert_array_equal(ours.positions, ref["image_position_ids"][0])
    np.testing.assert_array_equal(ours.patches, ref["pixel_values"][0])


@pytest.mark.parametrize("size", SIZES)
def test_processed_size_is_hfs(size):
    from transformers.models.gemma4.image_processing_pil_gemma4 import get_aspect_ratio_preserving_size

    assert processed_size(*size) == get_aspect_ratio_preserving_size(*size, patch_size=16, max_patches=2520,
                                                                       pooling_kernel_size=3)


@pytest.mark.parametrize("size", SIZES)
def test_runtime_given_hf_processed_size_sees_hfs_pixels(size):
    """MNN's runtime rounding (omni.cpp gemma4VisionProcess) leaves HF's processed size unchanged,
    so an image resized with ``resize_to_processed`` reaches it as exactly HF's patches."""
    original = synthetic_image(*size, seed=1)
    image = resize_to_processed(original)
    h, w = image.height, image.width
    assert (h, w) == processed_size(*size) == runtime_size(h, w)
    assert h % 48 == 0 and w % 48 == 0 and (h // 16) * (w // 16) <= 2520
    runtime_pixels = (np.asarray(image) * (1 / 255)).astype(np.float32)
    hf = preprocess(original)
    np.testing.assert_array_equal(patchify(runtime_pixels), hf.patches[:hf.num_patches])


def test_runtime_size_distorts_other_sizes():
    """The runtime's own resize (rounding each side, shrinking the larger one) is not HF's: an
    image not at the processed size gets other pixels and often another token count."""
    assert runtime_size(1080, 1920) == (768, 816)
    assert processed_size(1080, 1920) == (576, 1056)
    assert runtime_size(317, 451) == (336, 432)


@pytest.mark.parametrize("size", SIZES + [(1080, 1920)])
def test_saved_image_fragment(tmp_path, size):
    original = synthetic_image(*size, seed=2)
    fragment = save_image_for_runtime(original, tmp_path / "i.png")
    h, w = processed_size(*size)
    assert fragment == f"<img><hw>{h},{w}</hw>{tmp_path / 'i.png'}</img>"
    from PIL import Image

    saved = Image.open(tmp_path / "i.png")
    assert (saved.height, saved.width) == (h, w)
    np.testing.assert_array_equal(np.asarray(saved), np.asarray(resize_to_processed(original)))


@pytest.mark.parametrize("size", [(300, 300), (200, 640), (1000, 40), (1080, 1920)])
def test_runtime_resize_of_a_saved_image_gives_hfs_pixels(hf_processor, tmp_path, size):
    """MNN's own ``cv.imread`` + ``cv.resize`` exactly as gemma4VisionProcess calls them (bilinear,
    BGR -> RGB, x 1/255) on the helper's file at its <hw> size: HF's pixel values (float32 rounding).
    Not at that size (a plain <img> of the original resized to 768x768), the pixels are other ones."""
    import MNN.cv as cv

    original = synthetic_image(*size, seed=3)
    save_image_for_runtime(original, tmp_path / "i.png")
    h, w = processed_size(*size)
    image = cv.imread(str(tmp_path / "i.png"))
    pixels = cv.resize(image, [w, h], 0.0, 0.0, cv.INTER_LINEAR, cv.COLOR_BGR2RGB, [0.0] * 3, [1 / 255] * 3)
    runtime = np.array(pixels.read(), dtype=np.float32).reshape(h, w, 3)
    ref = hf_processor(images=[original], return_tensors="np")
    hf = ref["pixel_values"][0][:(h // 16) * (w // 16)]
    assert float(np.abs(patchify(runtime) - hf).max()) < 1e-6
    original.save(tmp_path / "o.png")
    plain = cv.resize(cv.imread(str(tmp_path / "o.png")), [768, 768], 0.0, 0.0, cv.INTER_LINEAR, cv.COLOR_BGR2RGB,
                      [0.0] * 3, [1 / 255] * 3)
    assert (768 // 16) ** 2 != hf.shape[0] or float(np.abs(patchify(
        np.array(plain.read(), dtype=np.float32).reshape(768, 768, 3)) - hf).max()) > 0.01
