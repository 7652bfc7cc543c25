"""Audio for Qwen2.5-Omni's audio tower, through the family's own feature extractor.

Decoded with PyAV (extra ``video``; its wheels bundle FFmpeg: wav, flac, mp3, the audio
track of a video, ...), resampled to the extractor's rate, mono float32, then the
extractor's log-mel features computed as the family's processor computes them (padded to
its 30 s window, with the attention mask; longer audio is cut there, as the processor
does). The frames past the longest audio of a sample are dropped: the tower reads only
the masked frames.
"""

from __future__ import annotations

import os

import numpy as np

__all__ = ["audio_features", "decode_audio"]


def decode_audio(path: str | os.PathLike, sampling_rate: int) -> np.ndarray:
    """The first audio track of ``path`` as mono float32 samples at ``sampling_rate``."""
    import av

    chunks = []
    with av.open(os.fspath(path)) as container:
        if not container.streams.audio:
            raise ValueError("no audio track")
        resampler = av.AudioResampler(format="flt", layout="mono", rate=sampling_rate)
        for frame in container.decode(audio=0):
            chunks += [f.to_ndarray().reshape(-1) for f in resampler.resample(frame)]
        chunks += [f.to_ndarray().reshape(-1) for f in resampler.resample(None)]
    if not chunks:
        raise ValueError("the audio track is empty")
    return np.concatenate(chunks).astype(np.float32)


def audio_features(path: str | os.PathLike, feature_extractor) -> tuple[np.ndarray, np.ndarray]:
    """``(input_features [mel, frames] float32, attention mask [frames] int64)`` of the
    audio file at ``path``, as the Omni processor computes them (``padding="max_length"``)."""
    sr = feature_extractor.sampling_rate
    enc = feature_extractor(
        decode_audio(path, sr),
        sampling_rate=sr,
        padding="max_length",
        return_attention_mask=True,
        return_tensors="np",
    )
    feats = np.asarray(enc["input_features"], dtype=np.float32)[0]
    return feats, np.asarray(enc["attention_mask"], dtype=np.int64)[0]
