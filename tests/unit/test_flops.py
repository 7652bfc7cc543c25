"""MFU's FLOP count (``CostHooks.sample_flops``, :mod:`ray_disagg.models.flops`) against
``torch.utils.flop_counter.FlopCounterMode`` on every family's single-process HF model:
eager attention and eager experts, one unpadded sample, the loss's ``lm_head`` at the
label positions only, forward and backward within 5%.

FlopCounterMode's convolution backward counts a grouped convolution's weight gradient
``groups`` times over (its formula ignores ``groups``; Qwen3.5's depthwise conv1d has
``groups = channels``): the test counts it once (:func:`_grouped_conv_backward`)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from ray.train import ScalingConfig
from torch.utils.flop_counter import FlopCounterMode, conv_flop_count

from ray_disagg import ADAPTERS, HFModelSpec, TrainLoopConfig
from ray_disagg.data.examples import synthetic_samples
from ray_disagg.models.flops import Flops, decoder_flops, step_flops
from ray_disagg.testing.reference import reference_batch
from ray_disagg.worker.mfu import dense_peak, device_share, peak_flops
from ray_disagg.worker.stats import StepStats

MEDIA = [
    {"images": [(1, 8, 8), (1, 4, 12)]},
    {"videos": [(2, 8, 4)], "images": [(1, 12, 8)]},
    None,  # text only, made 14x longer (a linear-attention chunk is 64 tokens)
    {"images": [(1, 16, 16)], "audios": [40]},
    {"audios": [24, 17]},
]


def _grouped_conv_backward(grad_out_shape, x_shape, w_shape, _bias, _stride, _padding,
                           _dilation, transposed, _output_padding, groups, output_mask,
                           out_shape, **_):  # fmt: skip
    """torch's ``convolution_backward`` formula, the weight gradient counted once."""
    assert not transposed

    def t(shape):
        return [shape[1], shape[0], *shape[2:]]

    flops = 0
    if output_mask[0]:
        flops += conv_flop_count(grad_out_shape, w_shape, out_shape[0], transposed=True)
    if output_mask[1]:
        flops += conv_flop_count(t(x_shape), t(grad_out_shape), t(out_shape[1])) // groups
    return flops


def _samples(cfg) -> list[dict]:
    samples = [s for s in synthetic_samples(cfg, len(MEDIA), grids=MEDIA) if s]
    for s in samples:
        if all(k in ("id", "input_ids", "labels") for k in s):
            s["input_ids"], s["labels"] = np.tile(s["input_ids"], 14), np.tile(s["labels"], 14)
    return samples


def _with_absent_media(adapter, sample: dict) -> dict:
    """``sample`` with every encoder field it lacks set to ``None``, as conversation
    processors and nullable dataset columns give them."""
    fields = {f for p in adapter.encoder_parts for f in adapter.encoder_fields(p)}
    return {**{f: None for f in fields}, **sample}


def measured_flops(spec: HFModelSpec, sample: dict) -> float:
    """FlopCounterMode's FLOPs of one forward and backward of ``sample``, logits at the
    label positions only (``logits_to_keep``)."""
    model = spec.build_full()
    if getattr(spec.config.text_config, "num_experts", None):  # CPU grouped_mm: 0 FLOPs
        model.set_experts_implementation("eager")
    kwargs = reference_batch(spec, [sample])
    targets = kwargs.pop("labels")[0, 1:]
    index = (targets != -100).nonzero().flatten()
    # the lm_head at the label positions only (Qwen2.5-Omni takes no logits_to_keep)
    model.get_output_embeddings().register_forward_pre_hook(lambda _, a: (a[0][:, index],))
    custom = {torch.ops.aten.convolution_backward: _grouped_conv_backward}
    with FlopCounterMode(display=False, custom_mapping=custom) as counter:
        logits = model(**kwargs).logits[0]
        F.cross_entropy(logits.float(), targets[index]).backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("model_type", sorted(ADAPTERS))
def test_counted_flops_match_flop_counter(model_type):
    cfg = ADAPTERS[model_type].tiny_config()
    spec = HFModelSpec(config=cfg, seed=7, attn_implementation="eager")
    adapter = spec.adapter
    for i, sample in enumerate(_samples(cfg)):  # (media a family does not take are left out)
        counted = sum(adapter.sample_flops(p, sample).training for p in adapter.parts)
        absent = _with_absent_media(adapter, sample)  # the same count with None fields
        assert sum(adapter.sample_flops(p, absent).training for p in adapter.parts) == counted
        assert counted == pytest.approx(measured_flops(spec, sample), rel=0.05), (model_type, i)


def test_flops_conventions():
    a = Flops(forward=10.0, data_input=4.0)
    assert (a + Flops(forward=1.0)).training == 3 * 11 - 4
    assert step_flops(a, backward=False) == 10.0 and step_flops(a, backward=True) == 26.0
    assert step_flops(a, backward=True, trains=False) == 2 * 10 - 4  # input gradients only
    t = ADAPTERS["qwen2_vl"].tiny_config().text_config
    one, two = (decoder_flops(t, n, labels=0).forward for n in (10, 20))
    assert two > 2 * one  # attention grows with the square of the length
    lm_head = decoder_flops(t, 10, labels=5).forward - one
    assert lm_head == 2 * 5 * t.hidden_size * t.vocab_size
    assert np.isfinite(lm_head)


def test_peaks_and_the_mfu_of_a_step():
    assert dense_peak("NVIDIA H100 80GB HBM3", bf16=True) == 989.4e12
    assert dense_peak("NVIDIA H100 PCIe", bf16=False) == 51.2e12  # not the SXM's
    assert dense_peak("NVIDIA A100-SXM4-80GB", bf16=False) == 19.5e12
    assert dense_peak("NVIDIA L40", bf16=True) == 181.05e12  # not the L4's, not the L40S's
    assert dense_peak("NVIDIA A10G", bf16=True) is None  # not the A10's: unknown
    assert device_share(ScalingConfig(num_workers=2, use_gpu=True,
                                      resources_per_worker={"GPU": 0.5})) == 0.5  # fmt: skip
    assert device_share(ScalingConfig(num_workers=2)) == 1.0
    cpu, cfg = torch.device("cpu"), TrainLoopConfig(max_steps=1, global_batch_size=1)
    assert peak_flops(cpu, cfg, warn=True) is None  # a CPU: only with the setting
    cfg.peak_tflops = 2.0
    assert peak_flops(cpu, cfg, warn=True) == 2e12
    assert peak_flops(cpu, cfg, warn=True, share=0.5) == 1e12  # colocated: counted once
    stats = StepStats(["vision", "text"], [])
    s = stats.new()
    ix = stats.index
    s[ix["cycle"]], s[ix["llm_tokens"]] = 0.5, 100
    s[ix["vision_flops"]], s[ix["text_flops"]] = 1e12, 3e12
    s[ix["vision_peak_flops"]], s[ix["text_peak_flops"]] = 4e12, 8e12  # 1 and 2 workers
    m = stats.metrics(s, 0, 0, {"lr": 1e-3}, 0.5)
    assert m["vision_mfu"] == 0.5 and m["text_mfu"] == 0.75 and m["mfu"] == 4 / 6
    assert m["tflops_per_s"] == 8.0
    s[ix["text_peak_flops"]] = float("nan")  # a rank without a peak: no MFU of it, none overall
    m = stats.metrics(s, 0, 0, {"lr": 1e-3}, 0.5)
    assert "text_mfu" not in m and "mfu" not in m and m["vision_mfu"] == 0.5
