"""Training loop of the text group's workers.

Text data-parallel replica ``t`` (its tp rank 0) receives, from every vision replica
routed to it, the text fields and image embeddings of its samples (in global-batch order)
and shares them with its tp peers. Every rank scatters the embeddings into the image-token
positions and computes the loss; the tp leader sends d(loss)/d(embeds) back to the vision
replicas; gradients are summed over ``"dp"`` and the optimizer steps.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ray_disagg._internal import loop_common as lc
from ray_disagg._internal import tensor_parallel as tp
from ray_disagg._internal.data_parallel import all_reduce_gradients
from ray_disagg._internal.runtime import get_runtime
from ray_disagg.data import SampleError, collate_text, count_label_tokens


def _check_image_tokens(items, n_embeddings: int, image_token_id: int) -> None:
    n_tokens = sum(int((it["input_ids"] == image_token_id).sum()) for it in items)
    if n_tokens != n_embeddings:
        names = [it.get("id") for it in items]
        raise SampleError(
            f"samples {names}: {n_tokens} image tokens but {n_embeddings} image embeddings "
            "were received from the vision group."
        )


def _receive(side, routes, step: int, args: lc.LoopArgs):
    """Items and embeddings of this replica's samples, from each routed vision replica."""
    items, embs, counts = [], [], []
    for vision_dp, _a, _b in routes:
        src = side.rank_of("vision", vision_dp * args.vision.model_parallel_size)
        meta = side.recv_object(src)
        if meta["step"] != step:
            raise RuntimeError(f"text group got step {meta['step']} data at step {step}")
        items += meta["items"]
        counts.append(meta["n_tokens"])
        if meta["n_tokens"]:
            embs.append(side.recv((meta["n_tokens"], args.text_hidden), torch.float32, src))
    emb = torch.cat(embs) if embs else torch.zeros(0, args.text_hidden)
    return items, emb, counts


def text_train_loop(args: lc.LoopArgs) -> None:
    cfg, plan = args.cfg, args.plan
    rt = get_runtime()
    side = rt.wait_side_group(cfg.collective_timeout_s)
    dp_mesh, tp_mesh = rt.mesh["dp"], rt.mesh["tp"]
    dp_rank, group_rank = dp_mesh.get_local_rank(), rt.mesh.get_rank()
    tp_size, tp_rank = tp_mesh.size(), tp_mesh.get_local_rank()
    leader = tp_rank == 0
    config = args.spec.load_config()
    pad_id = config.text_config.pad_token_id or 0

    model = args.spec.build_text().to(rt.device)
    if args.text.activation_checkpointing:
        model.language_model.gradient_checkpointing_enable({"use_reentrant": False})
    if tp_size > 1:
        tp.parallelize_text(model, tp_mesh)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = lc.build_optimizer(params, cfg, zero1=getattr(args.text.parallelism, "zero1", False))
    writer = lc.ShardWriter("text", lead=group_rank == 0, hf_config=config)
    start = lc.restore(model, opt, "text", args)
    timer = lc.StepTimer()

    for step in range(start, cfg.max_steps):
        lc.maybe_inject_failure(cfg, "text", group_rank, step)
        routes = plan.routes_to_text(dp_rank)
        t_wait = time.perf_counter()
        items, emb, counts = _receive(side, routes, step, args) if leader else (None, None, None)
        t_wait = time.perf_counter() - t_wait
        t0 = time.perf_counter()
        if tp_size > 1:
            box = [(items, counts, None if emb is None else emb.shape[0])]
            dist.broadcast_object_list(box, src=group_rank - tp_rank, group=tp_mesh.get_group())
            items, counts, n_emb = box[0]
            if not leader:
                emb = torch.empty(n_emb, args.text_hidden)
            if n_emb:
                dist.broadcast(emb, src=group_rank - tp_rank, group=tp_mesh.get_group())
        _check_image_tokens(items, emb.shape[0], args.image_token_id)
        emb = emb.to(rt.device).requires_grad_() if emb.shape[0] else None
        batch = collate_text(items, pad_id)
        local_labels = sum(count_label_tokens(it["labels"]) for it in items)
        n_labels = torch.tensor([local_labels], dtype=torch.float64)
        dist.all_reduce(n_labels, group=dp_mesh.get_group())
        with torch.autocast(rt.device.type, torch.bfloat16, enabled=cfg.bf16):
            loss = model(
                batch.input_ids.to(rt.device),
                batch.attention_mask.to(rt.device),
                batch.labels.to(rt.device),
                emb,
                None if batch.image_grid_thw is None else batch.image_grid_thw.to(rt.device),
                max(float(n_labels), 1.0),
            )
        loss.backward()
        t_compute = time.perf_counter() - t0

        t1 = time.perf_counter()
        if emb is not None and leader:
            grad = emb.grad.float()
            offset = 0
            for (vision_dp, _a, _b), n in zip(routes, counts):
                if n:
                    dst = side.rank_of("vision", vision_dp * args.vision.model_parallel_size)
                    side.send(grad[offset : offset + n], dst)
                offset += n
        t_wait += time.perf_counter() - t1

        t2 = time.perf_counter()
        all_reduce_gradients(params, dp_mesh.get_group())
        stats = lc.new_stats()
        sq = tp.grad_sq_norm(params, tp_mesh.get_group() if tp_size > 1 else None)
        if group_rank == 0:
            stats[lc.TEXT_SQ] = sq
        if leader:
            stats[lc.LOSS] = loss.item()
            stats[lc.LABEL_TOKENS] = local_labels
            stats[lc.TEXT_TOKENS] = int(batch.attention_mask.sum())
        t_compute += time.perf_counter() - t2
        if group_rank == 0:
            stats[lc.TEXT_TIME] = t_compute
            stats[lc.TEXT_WAIT] = t_wait
            stats[lc.TEXT_PEAK_MB] = lc.peak_memory_mb(rt.device)
        stats = timer.exchange(side, stats, is_vision_rank0=False)

        total_norm = float(stats[lc.VISION_SQ] + stats[lc.TEXT_SQ]) ** 0.5
        lc.scale_grads(params, lc.clip_coef(total_norm, cfg.max_grad_norm))
        opt.step()
        opt.zero_grad(set_to_none=True)
        lc.maybe_report(cfg, plan.steps_per_epoch, stats, step, writer, timer, model, opt)
