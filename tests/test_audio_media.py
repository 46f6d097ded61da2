"""Stage 0 (audio): our log-mel features equal HF's Gemma4 feature extractor; MNN's framing."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmexport.media.audio import (
    FRAME,
    HOP,
    MAX_SAMPLES,
    RUNTIME_TAIL,
    audio_for_runtime,
    audio_tokens,
    hf_frame_count,
    log_mel,
    read_wav,
    runtime_frame_count,
    runtime_log_mel,
    samples_for_tokens,
    save_audio_for_runtime,
    synthetic_clip,
    write_wav,
)

# shorter than a tiny chunk (3 tokens), not a multiple of it (9), several chunks (22), 1 s, and a
# length with samples % 160 in [1, 31] (where the runtime loses two frames)
LENGTHS = [samples_for_tokens(3), samples_for_tokens(9), samples_for_tokens(22), 16000, 16017]


@pytest.fixture(scope="module")
def extractor():
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor

    return Gemma4AudioFeatureExtractor()


@pytest.mark.parametrize("samples", LENGTHS)
def test_log_mel_equals_hf_extractor(extractor, samples):
    clip = synthetic_clip(samples, seed=samples)
    ref = extractor([clip], return_tensors="np")
    features, mask = log_mel(clip)
    np.testing.assert_array_equal(mask, ref["input_features_mask"][0])
    err = float(np.abs(features - ref["input_features"][0]).max())
    print(f"\n{samples} samples: {mask.sum()} frames, our mel vs HF max abs err {err:.2e}")
    assert features.shape == ref["input_features"][0].shape and err < 1e-4
    assert mask.sum() == hf_frame_count(samples)


@pytest.mark.parametrize("samples", LENGTHS)
def test_token_count_matches_hf_processor_arithmetic(extractor, samples):
    """Gemma4Processor.replace_audio_token: two stride-2 halvings of the mask, then its sum."""
    mask = extractor([synthetic_clip(samples)], return_tensors="np")["input_features_mask"][0]
    t = len(mask)
    for _ in range(2):
        t_out = (t + 2 - 3) // 2 + 1
        mask = mask[::2][:t_out]
        t = len(mask)
    assert audio_tokens(hf_frame_count(samples)) == int(mask.sum())


@pytest.mark.parametrize("samples", LENGTHS)
def test_runtime_framing_is_hfs_frames_minus_the_last(extractor, samples):
    """MNN 3.6.1 usm_fbank frames only whole 512-sample windows: each of its frames equals HF's,
    and it has one frame fewer (two when samples % 160 is 1..31)."""
    clip = synthetic_clip(samples, seed=1)
    hf = extractor([clip], return_tensors="np")["input_features"][0]
    runtime = runtime_log_mel(clip)
    missing = hf_frame_count(samples) - runtime_frame_count(samples)
    assert runtime.shape[0] == runtime_frame_count(samples)
    assert missing == (2 if 1 <= samples % HOP <= 31 else 1)
    assert float(np.abs(runtime - hf[:runtime.shape[0]]).max()) < 1e-4


def test_frame_counts_follow_the_formulas():
    for n in range(FRAME, 5000, 7):
        assert hf_frame_count(n) == (n + FRAME // 2 - (FRAME + 1)) // HOP + 1
        assert runtime_frame_count(n) == (n + FRAME // 2 - 512) // HOP + 1
    assert [audio_tokens(t) for t in (1, 4, 5, 8, 9)] == [1, 1, 2, 2, 3]
    assert audio_tokens(hf_frame_count(samples_for_tokens(7))) == 7


def test_wav_round_trip_is_exact(tmp_path):
    """Clips are 16-bit levels: MNN reads a 16-bit WAV as int16 / 32768, exactly these values."""
    import wave

    clip = synthetic_clip(3000, seed=3)
    write_wav(tmp_path / "a.wav", clip)
    with wave.open(str(tmp_path / "a.wav")) as f:
        pcm = np.frombuffer(f.readframes(f.getnframes()), dtype="<i2")
        assert (f.getframerate(), f.getnchannels(), f.getsampwidth()) == (16000, 1, 2)
    np.testing.assert_array_equal(pcm.astype(np.float32) / 32768, clip)


def test_191_zeros_give_hfs_frame_count_for_every_length():
    """runtime_frame_count(n + 191) == hf_frame_count(n) for all n up to 30 s, including every
    n with n % 160 in 1..31 (where the runtime loses two frames) and n below one frame."""
    n = np.arange(0, MAX_SAMPLES + 1)
    hf = np.maximum(0, (n + FRAME // 2 - (FRAME + 1)) // HOP + 1)
    runtime = np.maximum(0, (n + RUNTIME_TAIL + FRAME // 2 - 512) // HOP + 1)
    assert RUNTIME_TAIL == 191 and np.array_equal(hf, runtime)
    assert all(runtime_frame_count(int(k) + RUNTIME_TAIL) == hf_frame_count(int(k)) for k in n[::997])
    # one zero fewer loses a frame somewhere, one more adds one somewhere: 191 is the only tail
    assert not np.array_equal(hf, np.maximum(0, (n + RUNTIME_TAIL - 1 + FRAME // 2 - 512) // HOP + 1))
    assert not np.array_equal(hf, np.maximum(0, (n + RUNTIME_TAIL + 1 + FRAME // 2 - 512) // HOP + 1))


@settings(max_examples=60, deadline=None)
@given(frames=st.integers(1, 400), offset=st.integers(0, HOP - 1), seed=st.integers(0, 2 ** 16))
def test_padded_clip_gives_hfs_features(frames, offset, seed):
    """Every length (any frame count, any position within the hop): the runtime's filterbank on
    ``audio_for_runtime(clip)`` yields exactly HF's valid frames."""
    samples = (frames - 1) * HOP + (FRAME + 1) - FRAME // 2 + offset
    clip = synthetic_clip(samples, seed=seed)
    features, mask = log_mel(clip)
    runtime = runtime_log_mel(audio_for_runtime(clip))
    assert runtime.shape[0] == int(mask.sum()) == hf_frame_count(samples) >= frames
    np.testing.assert_array_equal(runtime, features[:runtime.shape[0]])


@pytest.mark.parametrize("samples", LENGTHS + [161 + 31, 480_000 + 5000])
def test_padded_clip_gives_hf_extractors_features(extractor, samples):
    clip = synthetic_clip(samples, seed=2)
    ref = extractor([clip], return_tensors="np")
    valid = ref["input_features"][0][ref["input_features_mask"][0]]
    runtime = runtime_log_mel(audio_for_runtime(clip))
    assert runtime.shape == valid.shape
    assert float(np.abs(runtime - valid).max()) < 1e-4


def test_saved_clip_is_the_padded_clip(tmp_path):
    clip = synthetic_clip(4017, seed=4)
    fragment = save_audio_for_runtime(clip, tmp_path / "c.wav")
    assert fragment == f"<audio>{tmp_path / 'c.wav'}</audio>"
    back = read_wav(tmp_path / "c.wav")
    assert len(back) == len(clip) + RUNTIME_TAIL
    np.testing.assert_array_equal(back[:len(clip)], clip)
    assert not back[len(clip):].any()


def test_read_wav_refuses_other_formats(tmp_path):
    import wave

    with wave.open(str(tmp_path / "s.wav"), "wb") as f:
        f.setnchannels(2)
        f.setsampwidth(2)
        f.setframerate(16000)
        f.writeframes(b"\0" * 8)
    with pytest.raises(ValueError, match="16-bit mono PCM at 16000 Hz"):
        read_wav(tmp_path / "s.wav")
