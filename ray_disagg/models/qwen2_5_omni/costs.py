"""What Qwen2.5-Omni's audio tower costs (``ray_disagg.models.costs`` hooks): the FLOPs of
``Qwen2_5OmniAudioEncoder`` over one sample's audios, as transformers' eager path runs
it (:mod:`ray_disagg.models.flops` conventions: matrix products, 2 FLOPs per
multiply-add).

The encoder cuts every audio's mel frames into chunks of ``2 n_window`` frames (the last
one shorter), right-pads all chunks to the longest, runs ``conv1`` (stride 1) and
``conv2`` (stride 2) over the padded chunks, keeps each chunk's ``(frames - 1) // 2 + 1``
real positions and attends within each chunk only (``cu_seqlens``); after the layers it
average-pools pairs per audio and projects to the LLM's width.
"""

from __future__ import annotations

from collections.abc import Iterable

from ray_disagg.models.flops import Flops, attention, linear

__all__ = ["audio_chunks", "audio_tower_flops"]


def audio_chunks(frames: Iterable[int], n_window: int) -> list[int]:
    """Mel frames of every chunk the encoder attends within (HF's
    ``chunk_and_pad_features``): each audio of ``f`` frames split into chunks of
    ``2 n_window`` frames, the last one ``f mod 2 n_window`` (when not zero)."""
    size = 2 * n_window
    return [min(size, f - i) for f in frames for i in range(0, int(f), size)]


def audio_tower_flops(a, frames: Iterable[int]) -> Flops:
    """``Qwen2_5OmniAudioEncoder`` (audio config ``a``) over audios of ``frames`` mel
    frames each (one sample's; none: no FLOPs).

    - ``conv1`` (``num_mel_bins -> d_model``, kernel 3, stride 1; its input is the mel
      data, so it is the data input) and ``conv2`` (``d_model -> d_model``, kernel 3,
      stride 2) over every chunk padded to the sample's longest chunk (``2 n_window``
      frames whenever an audio has that many), as a one-sample forward runs them;
    - per layer, ``q, k, v, out_proj`` and ``fc1, fc2`` over the real positions (each
      chunk's ``(frames - 1) // 2 + 1``) and attention within each chunk;
    - the average pooling (nothing), and ``proj`` (``d_model -> output_dim``) over each
      audio's ``((frames - 1) // 2 + 1 - 2) // 2 + 1`` pooled rows.
    """
    frames = [int(f) for f in frames]
    chunks = audio_chunks(frames, a.n_window)
    if not chunks:
        return Flops()
    d, kernel = a.d_model, 3
    padded = max(chunks)
    conv1 = linear(len(chunks) * padded, kernel * a.num_mel_bins, d)
    conv2 = linear(len(chunks) * ((padded - 1) // 2 + 1), kernel * d, d)
    lengths = [(c - 1) // 2 + 1 for c in chunks]
    positions = sum(lengths)
    layer = linear(positions, d, 4 * d) + linear(positions, d, 2 * a.encoder_ffn_dim)
    layer += attention(lengths, d)
    pooled = sum(((f - 1) // 2 + 1 - 2) // 2 + 1 for f in frames)
    proj = linear(pooled, d, a.output_dim)
    return Flops(forward=conv1 + conv2 + a.encoder_layers * layer + proj, data_input=conv1)
