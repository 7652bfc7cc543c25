"""Videos for Qwen-style vision towers and tile towers, without torchvision.

Decoded with PyAV (its wheels bundle FFmpeg; extra ``video``), sampled at ``fps`` (at
most ``max_frames``, a multiple of the tower's ``temporal_patch_size``), each frame resized
within ``min_pixels`` .. ``max_pixels`` (``smart_resize``: sides multiples of
``patch_size * merge_size``) and normalized like the family's image processor, then the
frames grouped by ``temporal_patch_size`` (the last frame repeated to fill the last
group) and cut into the tower's patches, in the order the family's processors use: a
group of identical frames gives exactly the image processor's patches of that frame.

Tile towers (InternVL, LLaVA-OneVision, :func:`tile_frames`): frames sampled as the
family's video processor samples them, each resized to one tile, rescaled and normalized
with the video processor's settings.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import numpy as np

__all__ = [
    "decode_frames",
    "decode_video",
    "group_timestamps",
    "patchify",
    "tile_frame_indices",
    "tile_frames",
    "transform_frames",
    "video_patches",
    "video_setting",
]


def _sample(total: int, rate: float, fps: float, max_frames, multiple: int) -> np.ndarray:
    """Indices of the frames kept of ``total`` at ``rate`` fps (see :func:`decode_video`)."""
    want = int(total / rate * fps) // multiple * multiple
    if max_frames is not None:
        want = min(want, max_frames // multiple * multiple)
    want = max(multiple, min(want, total - total % multiple or multiple))
    return np.linspace(0, total - 1, want).round().astype(int)


def decode_frames(path, pick) -> tuple[np.ndarray, list[int], float, int]:
    """``(frames, their indices in the video, the video's frames per second, its frame
    count)`` of the frames ``pick(total frames, fps)`` chooses. Only the chosen frames are
    kept in memory when the container states its frame count."""
    import av

    with av.open(os.fspath(path)) as container:
        stream = container.streams.video[0]
        rate = float(stream.average_rate or stream.guessed_rate or 24.0)
        total = int(stream.frames or 0)
        keep = pick(total, rate) if total else None
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
        keep = [order[i] for i in pick(len(order), rate)]
    keep = [int(i) for i in keep]
    return np.stack([frames[i] for i in keep]), keep, rate, max(total, len(frames))


def decode_video(
    path: str | os.PathLike, *, fps: float = 2.0, max_frames: int | None = None, multiple: int = 2
) -> tuple[np.ndarray, float]:
    """``(frames [T, H, W, 3] uint8, sampled frames per second)``: ``T`` frames evenly
    spaced over the video, about ``fps`` per second of video, a multiple of ``multiple``
    (at least ``multiple``) and at most ``max_frames``."""

    def pick(total: int, rate: float) -> np.ndarray:
        return _sample(total, rate, fps, max_frames, multiple)

    frames, keep, rate, total = decode_frames(path, pick)
    return frames, len(keep) / (total / rate)


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
    return patchify(np.stack(out), p, m, t)


def transform_frames(frames, size, resample, factor, stats) -> np.ndarray:
    """Frames ``[T, H0, W0, C]`` uint8 -> ``[T, C, *size]`` float32 with transformers'
    transforms: resized (``resample``), rescaled by ``factor`` and normalized with
    ``stats = (mean, std)`` (each skipped when ``None``), as the video processors do."""
    from transformers.image_transforms import normalize, rescale, resize
    from transformers.image_utils import ChannelDimension

    out, first = [], ChannelDimension.FIRST
    for frame in frames:
        x = resize(frame.transpose(2, 0, 1), size, resample=resample, input_data_format=first)
        x = x.astype(np.float32)
        if factor is not None:
            x = rescale(x, factor, input_data_format=first)
        if stats is not None:
            x = normalize(x, *stats, input_data_format=first)
        out.append(x)
    return np.stack(out).astype(np.float32)


def patchify(x: np.ndarray, p: int, m: int, t: int) -> tuple[np.ndarray, np.ndarray]:
    """Frames ``[T, C, H, W]`` (the last repeated to a multiple of ``t``) as the tower's
    patches ``[groups * h * w, C * t * p * p]`` in merge-window order, and their grid."""
    if len(x) % t:
        x = np.concatenate([x, np.repeat(x[-1:], t - len(x) % t, axis=0)])
    gt, c, h, w = len(x) // t, x.shape[1], x.shape[2], x.shape[3]
    gh, gw = h // p, w // p
    x = x.reshape(gt, t, c, gh // m, m, p, gw // m, m, p)
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(gt * gh * gw, c * t * p * p), np.asarray([[gt, gh, gw]], dtype=np.int64)


def group_timestamps(indices: list[int], rate: float, t: int) -> list[float]:
    """Seconds of each group of ``t`` frames (the mean of its first and last frame's
    time; the last index repeated to fill the last group), as Qwen3-VL's processor puts
    them in front of each group's tokens."""
    indices = list(indices) + [indices[-1]] * (-len(indices) % t)
    times = [i / rate for i in indices]
    return [(times[k] + times[k + t - 1]) / 2 for k in range(0, len(times), t)]


def tile_frame_indices(
    total: int, rate: float, fps: float, max_frames: int | None, initial_shift
) -> np.ndarray:
    """Indices of the frames kept of ``total`` at ``rate`` fps: ``int(seconds * fps)`` of
    them (at least 1, at most ``max_frames`` and ``total``) spread evenly, as the tile
    families' video processors sample a given frame count: from frame 0 (``initial_shift``
    falsy; LLaVA-OneVision's, HF's ``default_sample_indices_fn``) or from a shift
    (InternVL's ``sample_frames``; ``True``: half a step, each frame mid-interval).

    Example:
        >>> tile_frame_indices(8, 4.0, 2.0, None, True).tolist()
        [1, 3, 5, 7]
    """
    n = min(max(1, int(total / rate * fps)), total, max_frames or total)
    if not initial_shift:
        from transformers.video_utils import VideoMetadata, default_sample_indices_fn

        meta = VideoMetadata(total_num_frames=total, fps=rate)
        return np.asarray(default_sample_indices_fn(meta, num_frames=n))
    import torch

    shift = total / n / 2 if initial_shift is True else float(initial_shift)
    # InternVLVideoProcessor.sample_frames' arange (its module needs torchvision to import)
    return torch.arange(shift, total, total / n).int().numpy()


def video_setting(settings, name: str, default=None):
    """``settings[name]`` of a mapping, else ``settings.name`` (``default`` if missing)."""
    if isinstance(settings, Mapping):
        return settings.get(name, default)
    return getattr(settings, name, default)


def tile_frames(
    path: str | os.PathLike,
    settings,
    *,
    fps: float,
    max_frames: int | None = None,
    initial_shift=False,
) -> np.ndarray:
    """``[frames, C, H, W]`` float32 tiles of the video at ``path``: decoded with PyAV,
    frames picked by :func:`tile_frame_indices`, each resized to ``size`` (height, width)
    and rescaled and normalized as ``settings`` say (the family's video processor, its
    ``video_preprocessor_config.json`` as a mapping, or the image processor; only read),
    with transformers' own transforms (PIL resampling: the torchvision video processors'
    pixels differ within resampling error; the token ids do not). ``ValueError`` naming a
    setting it cannot apply."""
    from transformers.image_utils import PILImageResampling

    def get(name, default=None):
        return video_setting(settings, name, default)

    size = get("size")
    try:  # a dict, or transformers' SizeDict
        height, width = int(size["height"]), int(size["width"])
    except (KeyError, TypeError):
        raise ValueError(
            f"video_processor size={size!r}: tile videos are resized to one tile, "
            "{'height': H, 'width': W} (the family's video_preprocessor_config.json)"
        ) from None
    if get("do_center_crop", False):
        raise ValueError("video_processor do_center_crop=True is not applied to tile videos")
    resample = PILImageResampling(get("resample", None) or PILImageResampling.BICUBIC)

    def pick(total: int, rate: float) -> np.ndarray:
        return tile_frame_indices(total, rate, fps, max_frames, initial_shift)

    frames, _, _, _ = decode_frames(path, pick)
    factor = get("rescale_factor", 1 / 255) if get("do_rescale", True) else None
    stats = (get("image_mean"), get("image_std")) if get("do_normalize", True) else None
    return transform_frames(frames, (height, width), resample, factor, stats)
