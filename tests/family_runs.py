"""The family runs of the later families, on the workers without Ray
(``tests/gloo/test_family_runs.py``; Ray adds nothing to a family's numerics): the groups
equal the family's single-process HF model (losses and parameters, fp32, 1e-5).

The 2026 families (Qwen3-VL-MoE, Qwen3.5, Qwen3.5-MoE) with the router's auxiliary loss
over the global batch: Qwen3-VL-MoE under LLM context parallelism, Qwen3.5 with its Gated
DeltaNet under text TP2 and packed rows. The LLaVA-shaped families (Gemma 3, InternVL,
LLaVA-OneVision) with text TP2 over tied (or untied) embeddings, a frozen tower
(InternVL's under tile SP2), packed rows, validation and an export that
``from_pretrained`` loads. Every family's other layouts are in
``tests/gloo/test_families_match_hf.py``."""

import torch

from ray_disagg import (
    ADAPTERS,
    ContextParallel,
    DataParallel,
    HFModelSpec,
    SequenceParallel,
    TensorParallel,
    TrainLoopConfig,
    export_hf,
    load_metrics,
)
from ray_disagg.data.examples import synthetic_samples
from ray_disagg.testing.reference import reference_train
from tests.helpers import (
    assert_matches_reference,
    assert_params_close,
    checkpoint_state,
    group,
    run_layout,
    vt,
)

LOOP = {"max_steps": 2, "global_batch_size": 4, "lr": 1e-3, "eps": 1e-6, "seed": 3}
GRIDS = [{"images": [(1, 4, 4), (1, 8, 4)]}, None, {"videos": [(2, 4, 8)]}, (1, 8, 8)]
LAYOUTS = {
    # DeepStack and the router's aux loss over the 2 context-parallel ranks' tokens
    "qwen3_vl_moe": lambda: vt(group(1), group(2, ContextParallel(size=2))),
    "qwen3_5": lambda: vt(group(1), group(2, TensorParallel(size=2))),  # DeltaNet TP
    "qwen3_5_moe": lambda: vt(group(1), group(2, DataParallel(fsdp=True))),
}
EXTRA = {"qwen3_5": {"pack_sequences": True, "max_seq_len": 128}}  # DeltaNet per sample


def check_family_trains_like_hf(tmp_path, model_type: str) -> None:
    """``model_type``'s layout of :data:`LAYOUTS` equals HF."""
    cfg = ADAPTERS[model_type].tiny_config()
    spec = HFModelSpec(config=cfg, seed=11)
    data = synthetic_samples(cfg, 8, grids=GRIDS)
    loop = dict(LOOP, **EXTRA.get(model_type, {}))
    groups = LAYOUTS[model_type]()
    result = run_layout(spec, data, loop, groups, tmp_path, model_type, local=True)
    assert_matches_reference(result, spec, data, loop)


LLAVA_LOOP = dict(LOOP, eval_every=1, pack_sequences=True, max_seq_len=128)
LLAVA_GRIDS = [{"images": [(1, 4, 4), (1, 8, 4)]}, None, (1, 4, 8), (1, 8, 8), None, (1, 4, 4)]


LLAVA_FAMILIES = ("gemma3", "internvl", "llava_onevision")


def check_llava_family_trains_like_hf(tmp_path, model_type: str) -> None:
    """A LLaVA-shaped family with text TP2, a frozen tower, packing, validation and an
    export equals HF."""
    cfg = ADAPTERS[model_type].tiny_config()
    spec = HFModelSpec(config=cfg, seed=11)
    data = synthetic_samples(cfg, 8, grids=LLAVA_GRIDS)
    val = synthetic_samples(cfg, 4, grids=LLAVA_GRIDS, seed=1)
    # InternVL: tile SP (an image's tiles split over 2 ranks, gathered to SP rank 0)
    vision = group(2, SequenceParallel(size=2)) if model_type == "internvl" else group(1)
    groups = vt(vision, group(2, TensorParallel(size=2)))
    groups["vision"].freeze = ("model.vision_tower",)  # the projector trains
    result = run_layout(
        spec, data, LLAVA_LOOP, groups, tmp_path, model_type, validation=val, local=True
    )
    loop = TrainLoopConfig(**LLAVA_LOOP)
    ref_losses, _, ref_model, ref_val = reference_train(spec, data, loop, groups, val)
    history = load_metrics(result)
    for key, ref in (("loss", ref_losses), ("val_loss", ref_val)):
        torch.testing.assert_close(
            torch.tensor(history[key].tolist()), torch.tensor(ref), rtol=1e-5, atol=0.0
        )
    state, initial = checkpoint_state(result.checkpoint), spec.build_full().state_dict()
    tower = [k for k in state if k.startswith("model.vision_tower")]
    assert tower and all(torch.equal(state[k], initial[k]) for k in tower)
    assert_params_close(state, ref_model.state_dict())
    exported = spec.adapter.hf_class.from_pretrained(export_hf(result.checkpoint, tmp_path / "hf"))
    for key, value in exported.state_dict().items():
        torch.testing.assert_close(value, state[key], rtol=0, atol=0, msg=key)
