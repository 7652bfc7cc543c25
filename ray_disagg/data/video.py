"""Videos for Qwen-style vision towers, without torchvision.

Decoded with PyAV (its wheels bundle FFmpeg; extra ``video``), sampled at ``fps`` (at
most ``max_frames``, a multiple of the tower's ``temporal_patch_size``), each frame resized
within ``min_pixels`` .. ``max_pixels`` (``smart_resize``: sides multiples of
``patch_size * merge_size``) and normalized like the family's image processor, then the
frames grouped by ``temporal_patch_size`` (the last frame repeated to fill the last
group) and cut into the tower's patches, in the order the family's processors use: a
group of identical frames gives exactly the image processor's patches of that frame.
"""

from __future__ import annotations

import os

import numpy as np

__all__ = ["decode_video", "video_patches"]


def _sample(total: int, rate: float, fps: float, max_frames, multiple: int) -> np.ndarray:
    """Indices of the frames kept of ``total`` at ``rate`` fps (see :func:`decode_video`)."""
    want = int(total / rate * fps) // multiple * multiple
    if max_frames is not None:
        want = min(want, max_frames // multiple * multiple)
    want = max(multiple, min(want, total - total % multiple or multiple))
    return np.linspace(0, total - 1, want).round().astype(int)


def decode_video(
    path: str | os.PathLike, *, fps: float = 2.0, max_frames: int | None = None, multiple: int = 2
) -> tuple[np.ndarray, float]:
    """``(frames [T, H, W, 3] uint8, sampled frames per second)``: ``T`` frames evenly
    spaced over the video, about ``fps`` per second of video, a multiple of ``multiple``
    (at least ``multiple``) and at most ``max_frames``. Only the sampled frames are kept
    in memory when the container states its frame count."""
    import av

    with av.open(os.fspath(path)) as container:
        stream = container.streams.video[0]
        rate = float(stream.average_rate or stream.guessed_rate or fps)
        total = int(stream.frames or 0)
        keep = _sample(total, rate, fps, max_frames, multiple) if total else None
        wanted = None if keep is None else set(keep.tolist())
        frames = {}
        for i, frame in enumerate(container.decode(stream)):
            if wanted is None or i in wanted:
                frames[i] = frame.to_ndarray(format="rgb24")
            if keep is not None and i >= keep[-1]:
                break
    if not frames:
        raise ValueError(f"video {os.fspath(path)!r} has no frames")
    if keep is None or any(i not in frames for i in keep):  # no (or a wrong) frame count
        order = sorted(frames)
        keep = [order[i] for i in _sample(len(order), rate, fps, max_frames, multiple)]
    return np.stack([frames[i] for i in keep]), len(keep) / (max(total, len(frames)) / rate)


def video_patches(frames: np.ndarray, image_processor) -> tuple[np.ndarray, np.ndarray]:
    """``(pixel_values_videos [n, C*T*P*P], video_grid_thw [1, 3])`` of ``frames``
    (``[T, H, W, 3]`` uint8), each frame resized and normalized by ``image_processor`` (a
    Qwen2-VL image processor: its own ``resize``, ``rescale`` and ``normalize``)."""
    from transformers.image_processing_utils import SizeDict

    ip = image_processor
    p, m, t = ip.patch_size, ip.merge_size, ip.temporal_patch_size
    size = ip.size if isinstance(ip.size, SizeDict) else SizeDict(**dict(ip.size))
    out = []
    for frame in frames:
        x = ip.resize(frame.transpose(2, 0, 1), size=size, resample=ip.resample, factor=p * m)
        x = ip.normalize(ip.rescale(x, ip.rescale_factor), ip.image_mean, ip.image_std)
        out.append(np.asarray(x, dtype=np.float32))
    x = np.stack(out)  # T, C, H, W
    if len(x) % t:
        x = np.concatenate([x, np.repeat(x[-1:], t - len(x) % t, axis=0)])
    gt, c, h, w = len(x) // t, x.shape[1], x.shape[2], x.shape[3]
    gh, gw = h // p, w // p
    x = x.reshape(gt, t, c, gh // m, m, p, gw // m, m, p)
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(gt * gh * gw, c * t * p * p), np.asarray([[gt, gh, gw]], dtype=np.int64)
