"""The cross-group path at cluster scale, simulated on the driver alone (no workers, no
GPUs): for 8 x 4 up to 512 x 256 encoder x LLM replicas (the tower in SP2, the LLM in
TP4), the old path (every encoder replica balanced against every LLM replica, a
two-rank NCCL communicator per pair, one gloo group over every worker) and the new one
(bounded neighbourhoods, ``ray_disagg.pipeline.neighbours``; one link per pair of groups,
``ray_disagg.transport.links``) side by side:

- cross-group peers per replica leader (max, mean) and the exchanging pairs in all,
- NCCL communicators per worker (max, mean over the leaders) and in all, and their
  estimated GPU memory (``--comm-mib`` per communicator: NCCL's tracker reported about
  544 MB for a used two-GPU communicator, NVIDIA/nccl#964; point-to-point and
  cross-node buffers differ, so read it as an estimate),
- the rendezvous depth at start-up (the longest chain of connection rounds that wait for
  each other: old, every rank connects its pairs one by one in the global order; new, a
  round of connections to the peers and one NCCL init per link, links in one order),
- side-channel connections per worker (old: one gloo group over every worker, connected
  eagerly; new: lazy link groups, each worker connected to its peers only),
- the widest collective of a step (old: the statistics over every worker; new: within a
  group, then the groups' rank 0s),
- the driver's planning time per step (``plan.assign``: every worker computes it too),
- control messages per replica leader per step (inputs, crossings, gradients),
- balance: the slowest encoder replica's cost over the mean per step, and the slowest
  LLM replica's tokens over the mean.

Samples carry a real cost skew: a fifth text-only, half one image of 336-1344 px a side,
a fifth two to four images, a tenth a video of 8-32 frames at 448 x 448 (two frames a
temporal patch); 14-px patches merged 2 x 2 into LLM tokens; an encoder costs ``n +
n^2/1024`` per image of ``n`` merged rows (the adapters' default estimate), the LLM its
tokens (a caption of 30-2,000 text tokens plus the image tokens).

    python benchmarks/scale.py [--steps 3] [--comm-mib 544]
"""

import argparse
import functools
import statistics
import time

import numpy as np

from ray_disagg.pipeline.assignment import BatchPlan, balanced_split
from ray_disagg.transport.channel import ChannelSpec
from ray_disagg.transport.links import plan_links
from ray_disagg.transport.select import Location

SCALES = [  # encoder replicas, LLM replicas, global batch, microbatches
    (8, 4, 256, 4),
    (64, 32, 2048, 4),
    (256, 128, 8192, 4),
    (512, 256, 8192, 4),
]
SP, TP = 2, 4  # workers per encoder replica, per LLM replica


def skewed_costs(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Per sample: the LLM's tokens and the vision encoder's estimated cost."""
    rng = np.random.default_rng(seed)
    tokens, enc = np.zeros(n), np.zeros(n)
    for i in range(n):
        kind = rng.random()
        if kind < 0.2:
            images = []
        elif kind < 0.7:
            images = [rng.integers(12, 49, 2)]  # 336-1344 px in 28-px merged patches
        elif kind < 0.9:
            images = [rng.integers(12, 49, 2) for _ in range(rng.integers(2, 5))]
        else:
            images = [np.array([16, 16])] * (int(rng.integers(8, 33)) // 2)
        rows = [int(h * w) for h, w in images]
        tokens[i] = rng.integers(30, 2000) + sum(rows)
        enc[i] = sum(r + r * r / 1024 for r in rows)
    return {"text": tokens, "vision": enc}


def old_assign(plan: BatchPlan, step: int) -> list[dict]:
    """The previous main's balanced assignment: the LLM replicas by tokens (equal
    counts, cut into consecutive microbatches), each microbatch over every encoder
    replica by its cost."""
    b, k, n = plan.global_batch_size, plan.micro_batches, plan.dp_sizes["text"]
    idx = plan.global_indices(step)
    cost = {g: [float(v[i]) for i in idx] for g, v in plan.costs.items()}
    shares = balanced_split(list(range(b)), cost["text"], n)
    per, out = b // (n * k), []
    for j in range(k):
        mb = {"text": [s[j * per : (j + 1) * per] for s in shares]}
        union = sorted(p for s in mb["text"] for p in s)
        costs = [cost["vision"][p] for p in union]
        mb["vision"] = balanced_split(union, costs, plan.dp_sizes["vision"], equal_counts=False)
        out.append(mb)
    return out


def rendezvous_depth(pairs) -> int:
    """The longest chain of pair connections when every rank connects its pairs one by
    one in the global (sorted) order."""
    done: dict[int, int] = {}
    for a, b in sorted(pairs):
        done[a] = done[b] = 1 + max(done.get(a, 0), done.get(b, 0))
    return max(done.values(), default=0)


def step_figures(plan, mbs, step: int) -> dict:
    """Per step: messages per leader, the balance of both groups."""
    nv, nt = plan.dp_sizes["vision"], plan.dp_sizes["text"]
    idx = plan.global_indices(step)
    enc, tok = plan.costs["vision"], plan.costs["text"]
    load, tokens = np.zeros(nv), np.zeros(nt)
    per_mb = []
    for mb in mbs:
        owner = {p: d for d, s in enumerate(mb["text"]) for p in s}
        talks = set()
        for e, share in enumerate(mb["vision"]):
            load[e] += sum(enc[idx[p]] for p in share)
            talks |= {(e, owner[p]) for p in share}
        for d, share in enumerate(mb["text"]):
            tokens[d] += sum(tok[idx[p]] for p in share)
        per_mb.append(talks)
    step_pairs = set().union(*per_mb)
    # inputs once per step and pair; crossings and gradients per microbatch and pair
    msgs_v, msgs_t = np.zeros(nv), np.zeros(nt)
    for e, d in step_pairs:
        msgs_v[e] += 1
        msgs_t[d] += 1
    for talks in per_mb:
        for e, d in talks:
            msgs_v[e] += 2
            msgs_t[d] += 2
    msgs = np.concatenate([msgs_v, msgs_t])
    return {
        "msgs": (msgs.max(), msgs.mean()),
        "enc_balance": load.max() / load.mean(),
        "llm_balance": tokens.max() / tokens.mean(),
    }


def old_transport(nv: int, nt: int, pairs, comm_mib: float) -> dict:
    """The previous transport: a two-rank NCCL communicator per pair, connected one after
    another in the global order of pairs; one gloo group over every worker."""
    peers = [sum(1 for e, _ in pairs if e == r) for r in range(nv)]
    peers += [sum(1 for _, d in pairs if d == r) for r in range(nt)]
    world = nv * SP + nt * TP
    # channel ranks: the LLM group first (TP ranks), then the tower's (SP ranks)
    global_pairs = {(d * TP, nt * TP + e * SP) for e, d in pairs}
    return {
        "communicators per worker (max / mean)": f"{max(peers)} / {statistics.mean(peers):.1f}",
        "communicators in all": f"{len(pairs):,}",
        "est. GPU memory per worker": f"{max(peers) * comm_mib / 1024:.1f} GiB",
        "rendezvous depth": f"{rendezvous_depth(global_pairs)}",
        "side-channel connections (max)": f"{world - 1:,}",
        "widest per-step collective": f"{world:,} workers",
    }


def new_transport(nv: int, nt: int, pairs, comm_mib: float) -> dict:
    """This transport, from the channel's own link plan (``plan_links``) with every pair
    on the NCCL tier (separate placement, eight GPUs a node)."""
    n_text, world = nt * TP, nv * SP + nt * TP
    where = [Location(node=f"n{r // 8}", pid=r, device="cuda", gpu=f"gpu{r}") for r in range(world)]
    spec = ChannelSpec(
        "127.0.0.1", 0, {"text": 0, "vision": n_text}, {"text": n_text, "vision": nv * SP},
        60.0, "scale", where, {(d * TP, n_text + e * SP): "nccl" for e, d in pairs},
    )  # fmt: skip
    links = plan_links(spec)
    leaders = sorted({m for link in links for m in link.members})
    nccl = [sum(link.part(w) is not None for link in links) for w in leaders]
    conns = [sum(len(link.peers(w)) for link in links if w in link.members) for w in leaders]
    clock: dict[int, int] = {}
    for link in links:  # each link: one round of connections, one NCCL init of each part
        t = 1 + bool(link.nccl_parts) + max(clock.get(m, 0) for m in link.members)
        clock.update(dict.fromkeys(link.members, t))
    widest = max(nv * SP, nt * TP)
    return {
        "communicators per worker (max / mean)": f"{max(nccl)} / {statistics.mean(nccl):.1f}",
        "communicators in all": f"{sum(len(link.nccl_parts) for link in links):,}",
        "est. GPU memory per worker": f"{max(nccl) * comm_mib / 1024:.1f} GiB",
        "rendezvous depth": f"{max(clock.values())}",
        "side-channel connections (max)": f"{max(conns):,}",
        "widest per-step collective": f"{widest:,} workers",
    }


def path_figures(plan: BatchPlan, assign, pairs, transport: dict, steps: int) -> dict:
    nv, nt = plan.dp_sizes["vision"], plan.dp_sizes["text"]
    peers = [sum(1 for e, _ in pairs if e == r) for r in range(nv)]
    peers += [sum(1 for _, d in pairs if d == r) for r in range(nt)]
    times, figs = [], []
    for step in range(steps):
        t0 = time.perf_counter()
        mbs = assign(step)
        times.append(time.perf_counter() - t0)
        figs.append(step_figures(plan, mbs, step))
    return {
        "peers": f"{max(peers)} / {statistics.mean(peers):.1f}",
        "exchanging pairs": f"{len(pairs):,}",
        **transport,
        "planning per step": f"{1e3 * statistics.median(times):.1f} ms",
        "messages per leader per step": "{:.0f} / {:.1f}".format(
            max(f["msgs"][0] for f in figs), statistics.mean(f["msgs"][1] for f in figs)
        ),
        "encoder balance (max/mean)": f"{max(f['enc_balance'] for f in figs):.3f}",
        "LLM balance (max/mean)": f"{max(f['llm_balance'] for f in figs):.3f}",
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--comm-mib", type=float, default=544.0)
    args = p.parse_args()
    for nv, nt, b, k in SCALES:
        plan = BatchPlan(
            num_samples=4 * b, global_batch_size=b, dp_sizes={"text": nt, "vision": nv},
            shuffle=True, micro_batches=k, reader="text", costs=skewed_costs(4 * b),
        )  # fmt: skip
        old_pairs = {(e, d) for e in range(nv) for d in range(nt)}
        before = old_transport(nv, nt, old_pairs, args.comm_mib)
        old = path_figures(plan, functools.partial(old_assign, plan), old_pairs, before, args.steps)
        new_pairs = plan.exchange_pairs("vision", "text")
        after = new_transport(nv, nt, new_pairs, args.comm_mib)
        new = path_figures(plan, plan.assign, new_pairs, after, args.steps)
        gpus = nv * SP + nt * TP
        print(f"\n{nv} x {nt} replicas ({gpus:,} GPUs), global batch {b}, {k} microbatches")
        print(f"  {'':38s} {'old':>20s} {'new':>20s}")
        for key in old:
            print(f"  {key:38s} {old[key]:>20s} {new[key]:>20s}")
        ratio = float(new["encoder balance (max/mean)"]) / float(old["encoder balance (max/mean)"])
        print(f"  slowest encoder replica, neighbours over every pair: {ratio:.3f}x")


if __name__ == "__main__":
    main()
