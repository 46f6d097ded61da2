"""Gemma4 log-mel features, equal to transformers' ``Gemma4AudioFeatureExtractor``, and MNN's framing.

HF (feature_extraction_gemma4.py, transformers 5.x): the waveform is padded to a multiple of 128
samples (with a mask), 160 zeros are prepended ("semicausal"), frames of 321 samples are taken
every 160 and their first 320 are windowed with a periodic Hann window, |rfft| over 512 points,
an HTK mel filterbank (128 bins, 0-8000 Hz, no area normalisation), ``log(mel + 1e-3)``; a frame
counts only when its last (321st) sample is real audio, and invalid frames are zeroed.

MNN 3.6.1 (tools/audio/source/audio.cpp ``usm_fbank``) frames the same padded signal with
512-sample STFT frames (the 320-sample window zero-padded to 512) and keeps only frames that fit
entirely: ``(n + 160 - 512) // 160 + 1`` instead of HF's ``(n + 160 - 321) // 160 + 1``. Each kept
frame equals HF's; the runtime just has one (sometimes two) fewer at the end, and no mask.

The difference is exactly 512 - 321 = 191 samples of frame reach, and only the first 320 samples
of a frame are windowed: ``audio_for_runtime`` appends 191 zeros (after HF's 30 s cap), and the
runtime then computes exactly HF's valid frames, hence HF's token count and soft tokens;
``save_audio_for_runtime`` writes that as a WAV and returns the prompt fragment.
"""

from __future__ import annotations

import math
import wave
from pathlib import Path

import numpy as np

SAMPLE_RATE = 16_000
FRAME = 320
HOP = 160
FFT = 512
MELS = 128
MEL_FLOOR = 1e-3
PAD_MULTIPLE = 128
MAX_SAMPLES = 480_000  # HF truncates at 30 s; the runtime does not
RUNTIME_TAIL = FFT - (FRAME + 1)  # 191 zeros: the runtime's last whole 512-sample frame is HF's last valid one


def _hz_to_mel(f: np.ndarray) -> np.ndarray:
    return 2595.0 * np.log10(1.0 + f / 700.0)


def _mel_to_hz(m: np.ndarray) -> np.ndarray:
    return 700.0 * (10.0 ** (m / 2595.0) - 1.0)


def mel_filters(bins: int = MELS, fft: int = FFT, rate: int = SAMPLE_RATE) -> np.ndarray:
    """[fft/2 + 1, bins] HTK triangular filters between 0 and rate/2, no normalisation
    (transformers ``mel_filter_bank(norm=None, mel_scale="htk")``)."""
    edges = _mel_to_hz(np.linspace(_hz_to_mel(np.array(0.0)), _hz_to_mel(np.array(rate / 2)), bins + 2))
    freqs = np.linspace(0, rate // 2, fft // 2 + 1)
    slopes = edges[None, :] - freqs[:, None]
    widths = np.diff(edges)
    down = -slopes[:, :-2] / widths[:-1]
    up = slopes[:, 2:] / widths[1:]
    return np.maximum(0.0, np.minimum(down, up))


def hann(length: int = FRAME) -> np.ndarray:
    """Periodic Hann window in float32 (transformers ``window_function``)."""
    return np.hanning(length + 1)[:-1].astype(np.float32)


def _log_mel_frames(padded: np.ndarray, count: int) -> np.ndarray:
    """log-mel of ``count`` frames of 320 samples every 160 of an already left-padded signal."""
    if count <= 0:
        return np.zeros((0, MELS), np.float32)
    starts = np.arange(count)[:, None] * HOP + np.arange(FRAME)[None, :]
    frames = padded[starts] * hann()
    spectrum = np.abs(np.fft.rfft(frames, n=FFT, axis=-1))
    return np.log(spectrum @ mel_filters() + MEL_FLOOR).astype(np.float32)


def hf_frame_count(samples: int) -> int:
    """Valid mel frames of HF's extractor for a clip of ``samples`` (frames whose 321st sample is real)."""
    return max(0, (samples + FRAME // 2 - (FRAME + 1)) // HOP + 1)


def runtime_frame_count(samples: int) -> int:
    """Mel frames MNN 3.6.1's ``usm_fbank`` produces (whole 512-sample frames only)."""
    return max(0, (samples + FRAME // 2 - FFT) // HOP + 1)


def audio_tokens(frames: int) -> int:
    """Soft tokens of the audio tower for ``frames`` mel frames (two stride-2 convolutions)."""
    return math.ceil(math.ceil(frames / 2) / 2)


def log_mel(waveform: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """HF's features for one clip: ([T, 128] float32 with invalid frames zeroed, mask [T] bool);
    T covers the clip padded to a multiple of 128 samples (and truncated at 30 s)."""
    wav = np.asarray(waveform, dtype=np.float32).reshape(-1)[:MAX_SAMPLES]
    length = len(wav)
    padded_len = -(-length // PAD_MULTIPLE) * PAD_MULTIPLE
    signal = np.concatenate([np.zeros(FRAME // 2, np.float32), wav, np.zeros(padded_len - length, np.float32)])
    total = (len(signal) - (FRAME + 1)) // HOP + 1
    features = _log_mel_frames(signal, total)
    mask = np.arange(total) < hf_frame_count(length)
    return features * mask[:, None], mask


def runtime_log_mel(waveform: np.ndarray) -> np.ndarray:
    """The features MNN's runtime computes for a clip ([T_runtime, 128]): HF's frames, fewer of them."""
    wav = np.asarray(waveform, dtype=np.float32).reshape(-1)
    signal = np.concatenate([np.zeros(FRAME // 2, np.float32), wav])
    return _log_mel_frames(signal, runtime_frame_count(len(wav)))


def audio_for_runtime(waveform: np.ndarray) -> np.ndarray:
    """The samples to give MNN 3.6.1's runtime so that it computes HF's features for ``waveform``:
    HF's 30 s truncation, then ``RUNTIME_TAIL`` zeros (``runtime_frame_count(n + 191) ==
    hf_frame_count(n)`` for every n, and the added zeros lie outside every valid frame's window)."""
    wav = np.asarray(waveform, dtype=np.float32).reshape(-1)[:MAX_SAMPLES]
    return np.concatenate([wav, np.zeros(RUNTIME_TAIL, np.float32)])


def save_audio_for_runtime(waveform: np.ndarray, path: Path | str) -> str:
    """Write ``audio_for_runtime(waveform)`` as a 16 kHz 16-bit WAV at ``path`` and return the
    prompt fragment ``<audio>path</audio>``. The WAV holds 16-bit levels: give HF the same levels
    (``read_wav(path)`` without its tail, or a clip already on them) for a bit-exact comparison."""
    write_wav(Path(path), audio_for_runtime(waveform))
    return f"<audio>{path}</audio>"


def synthetic_clip(samples: int, seed: int = 0) -> np.ndarray:
    """A deterministic clip (chirps and noise) quantised to 16-bit PCM levels, so that a WAV file
    written with ``write_wav`` reads back bit-exactly (MNN reads int16 / 32768)."""
    rng = np.random.default_rng(seed)
    t = np.arange(samples) / SAMPLE_RATE
    f0 = rng.uniform(150, 400)
    wav = 0.3 * np.sin(2 * np.pi * (f0 * t + 600 * t * t)) + 0.2 * np.sin(2 * np.pi * 3 * f0 * t)
    wav += rng.normal(0, 0.02, samples)
    return (np.clip(np.round(wav * 32768), -32768, 32767) / 32768).astype(np.float32)


def write_wav(path: Path, waveform: np.ndarray) -> None:
    """16-bit mono PCM at 16 kHz."""
    pcm = np.clip(np.round(np.asarray(waveform, dtype=np.float64) * 32768), -32768, 32767).astype("<i2")
    with wave.open(str(path), "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(SAMPLE_RATE)
        f.writeframes(pcm.tobytes())


def read_wav(path: Path | str) -> np.ndarray:
    """A 16 kHz 16-bit mono WAV as float32 samples (int16 / 32768, as MNN's runtime reads it)."""
    with wave.open(str(path), "rb") as f:
        if (f.getsampwidth(), f.getnchannels(), f.getframerate()) != (2, 1, SAMPLE_RATE):
            raise ValueError(f"{path}: expected 16-bit mono PCM at {SAMPLE_RATE} Hz")
        pcm = np.frombuffer(f.readframes(f.getnframes()), dtype="<i2")
    return (pcm.astype(np.float32) / 32768).astype(np.float32)


def samples_for_tokens(tokens: int, extra: int = 37) -> int:
    """A clip length whose HF features give ``tokens`` audio tokens (``extra`` samples past the
    minimum, so the length is not on a frame boundary)."""
    frames = 4 * tokens - 3  # the fewest frames giving ``tokens`` tokens
    return (frames - 1) * HOP + (FRAME + 1) - FRAME // 2 + extra
