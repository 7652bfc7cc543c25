"""Training loop of the vision group's workers.

Vision data-parallel replica ``d`` reads its slice of each global batch (the single place
where a sample is read), runs the vision tower + merger, sends every text replica the
text fields and image embeddings of the samples routed to it, receives d(loss)/d(embeds)
back, and finishes backward, the gradient reduction and the optimizer step.
"""

from __future__ import annotations

import time

import ray
import torch
import torch.distributed as dist

from ray_disagg._internal import ingest, ulysses
from ray_disagg._internal import loop_common as lc
from ray_disagg._internal import tensor_parallel as tp
from ray_disagg._internal.data_parallel import all_reduce_gradients
from ray_disagg._internal.runtime import get_runtime
from ray_disagg.data import collate_vision, text_item, tokens_per_image


def _plain(v):
    return v.item() if hasattr(v, "item") else v


def vision_train_loop(args: lc.LoopArgs) -> None:
    cfg, plan = args.cfg, args.plan
    rt = get_runtime()
    side = rt.wait_side_group(cfg.collective_timeout_s)
    dp_mesh = rt.mesh["dp"]
    dp_rank, group_rank = dp_mesh.get_local_rank(), rt.mesh.get_rank()
    # the model-parallel axis: "sp" (Ulysses) or "tp" (uniform tensor parallel baseline)
    mp_axis = rt.mesh.mesh_dim_names[1]
    mp_mesh = rt.mesh[mp_axis]
    mp_size, mp_rank = mp_mesh.size(), mp_mesh.get_local_rank()
    sp_size = mp_size if mp_axis == "sp" else 1
    tp_size = mp_size if mp_axis == "tp" else 1
    leader = mp_rank == 0  # reads the samples and talks to the text group
    mp_src = group_rank - mp_rank
    text_tp = args.text.model_parallel_size

    model = args.spec.build_vision().to(rt.device)
    if args.vision.activation_checkpointing:
        model.visual.gradient_checkpointing_enable({"use_reentrant": False})
    if sp_size > 1:
        ulysses.enable_ulysses(model.visual, mp_mesh.get_group())
    if tp_size > 1:
        tp.parallelize_vision(model.visual, mp_mesh)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = lc.build_optimizer(params, cfg, zero1=getattr(args.vision.parallelism, "zero1", False))
    writer = lc.ShardWriter("vision", lead=group_rank == 0)
    start = lc.restore(model, opt, "vision", args)
    source = ingest.make_source(ray.get(args.dataset_ref[0]), plan, dp_rank, leader)
    timer = lc.StepTimer()

    for step in range(start, cfg.max_steps):
        lc.maybe_inject_failure(cfg, "vision", group_rank, step)
        t0 = time.perf_counter()
        samples = None
        if leader:
            samples = ingest.read_samples(source, step, dp_rank, args)
        if mp_size > 1:
            box = [samples]
            dist.broadcast_object_list(box, src=mp_src, group=mp_mesh.get_group())
            samples = box[0]
        pixels, grid = collate_vision(samples)
        emb = None
        if grid is not None:
            pixels, grid = pixels.to(rt.device), grid.to(rt.device)
            with torch.autocast(rt.device.type, torch.bfloat16, enabled=cfg.bf16):
                if sp_size > 1:
                    emb = ulysses.sp_vision_forward(model.visual, pixels, grid)
                else:
                    emb = model(pixels, grid)
        n_tok = [
            0
            if s.get("image_grid_thw") is None
            else int(tokens_per_image(s["image_grid_thw"], args.spatial_merge_size).sum())
            for s in samples
        ]
        starts = [sum(n_tok[:k]) for k in range(len(n_tok) + 1)]
        t_compute = time.perf_counter() - t0

        routes = plan.routes_from_vision(dp_rank) if leader else []
        lo = plan.vision_span(dp_rank)[0]
        t_wait = time.perf_counter()
        for text_dp, a, b in routes:
            dst = side.rank_of("text", text_dp * text_tp)
            items = [text_item(s, args.image_token_id) for s in samples[a - lo : b - lo]]
            n = starts[b - lo] - starts[a - lo]
            side.send_object({"step": step, "items": items, "n_tokens": n}, dst)
            if n:
                side.send(emb[starts[a - lo] : starts[b - lo]].detach().float(), dst)
        grads = []
        for text_dp, a, b in routes:
            n = starts[b - lo] - starts[a - lo]
            if n:
                src = side.rank_of("text", text_dp * text_tp)
                grads.append(side.recv((n, args.text_hidden), torch.float32, src))
        t_wait = time.perf_counter() - t_wait

        t1 = time.perf_counter()
        if emb is not None:
            # sp: non-leaders hold an empty slice of emb but must join the backward;
            # tp: every rank holds the replicated emb and needs the full gradient
            grad = torch.cat(grads) if leader else torch.zeros(emb.shape)
            if tp_size > 1:
                dist.broadcast(grad, src=mp_src, group=mp_mesh.get_group())
            emb.backward(grad.to(rt.device, emb.dtype))
        # tp: replicas of a shard differ in samples only; dp x sp: replicas hold different
        # samples and sp ranks partial sums of the replicated weights
        all_reduce_gradients(params, dp_mesh.get_group() if tp_size > 1 else dist.group.WORLD)
        sq = tp.grad_sq_norm(params, mp_mesh.get_group() if tp_size > 1 else None)
        stats = lc.new_stats()
        if group_rank == 0:
            stats[lc.VISION_SQ] = sq
        t_compute += time.perf_counter() - t1
        if group_rank == 0:
            stats[lc.VISION_TIME] = t_compute
            stats[lc.VISION_WAIT] = t_wait
            stats[lc.VISION_PEAK_MB] = lc.peak_memory_mb(rt.device)
        if leader:
            stats[lc.IMAGES] = 0 if grid is None else grid.shape[0]
        stats = timer.exchange(side, stats, is_vision_rank0=group_rank == 0)

        total_norm = float(stats[lc.VISION_SQ] + stats[lc.TEXT_SQ]) ** 0.5
        lc.scale_grads(params, lc.clip_coef(total_norm, cfg.max_grad_norm))
        opt.step()
        opt.zero_grad(set_to_none=True)
        extra = None
        if cfg.extra.get("report_sample_ids"):  # which samples this step used (for audits)
            ids = [_plain(s.get("id")) for s in samples] if leader else []
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, ids)
            extra = {"sample_ids": [i for part in gathered for i in part]}
        lc.maybe_report(cfg, plan.steps_per_epoch, stats, step, writer, timer, model, opt, extra)
