"""Tier 2: the cross-group side process group over real gloo in separate processes."""

import glob
import pickle
import time

import torch

from ray_disagg.transport import channel as sg
from tests.dist_utils import process_context

WORLD = 3


def _join(rank, port_q, timeout_s, tiers=None) -> sg.Channel:
    """Side ranks [vision 0, vision 1, text 0]; rank 0 hosts the store."""
    store = None
    if rank == 0:
        store, port = sg.host_store("127.0.0.1", timeout_s)
        for _ in range(WORLD - 1):
            port_q.put(port)
    else:
        port = port_q.get()
    spec = sg.ChannelSpec(
        "127.0.0.1", port, {"vision": 0, "text": 2}, {"vision": 2, "text": 1}, timeout_s, "t",
        tiers=tiers or {},
    )  # fmt: skip
    return sg.join(spec, rank, "127.0.0.1", store=store)


def _worker(rank, port_q, result_q, done, timeout_s):
    try:
        side = _join(rank, port_q, timeout_s)
        out = {}
        if rank in (0, 1):
            side.send_object({"from": rank, "ids": list(range(rank + 3))}, side.rank_of("text", 0))
            side.send(torch.full((2, 3), float(rank)), 2)
            out["grad"] = side.recv((2, 3), torch.float32, 2).tolist()
        else:
            for src in (0, 1):
                out[src] = side.recv_object(src)
                emb = side.recv((2, 3), torch.float32, src)
                side.send(emb * 10, src)
        out["sum"] = side.all_reduce_sum(torch.tensor([rank + 1.0], dtype=torch.float64)).item()
        if rank == 2:
            t0 = time.monotonic()
            try:
                side.recv((1,), torch.float32, 0)  # nobody sends: must time out, not hang
            except RuntimeError as e:
                out["timeout"] = (time.monotonic() - t0, str(e)[:80])
            done.set()
        else:
            done.wait(60)  # stay alive (and silent) while rank 2 waits for the timeout
        result_q.put((rank, out))
    except Exception as e:  # pragma: no cover - reported to the test
        result_q.put((rank, repr(e)))


def test_side_group_transfers_objects_tensors_and_times_out():
    ctx = process_context()
    port_q, result_q, done = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = [
        ctx.Process(target=_worker, args=(r, port_q, result_q, done, 5.0)) for r in range(WORLD)
    ]
    for p in procs:
        p.start()
    results = dict(result_q.get(timeout=90) for _ in range(WORLD))
    for p in procs:
        p.join(timeout=30)
    assert all(isinstance(r, dict) for r in results.values()), results
    assert results[2][0] == {"from": 0, "ids": [0, 1, 2]}
    assert results[2][1] == {"from": 1, "ids": [0, 1, 2, 3]}
    assert results[0]["grad"] == [[0.0] * 3] * 2 and results[1]["grad"] == [[10.0] * 3] * 2
    assert all(r["sum"] == 6.0 for r in results.values())
    elapsed, _msg = results[2]["timeout"]
    assert 4.0 < elapsed < 30.0  # the side group's 5 s timeout, not a hang


def _tensors(rank: int) -> dict:
    g = torch.Generator().manual_seed(rank)
    return {
        "embeds": torch.randn(5, 7, generator=g),
        "deepstack": torch.randn(3, 7, generator=g).to(torch.bfloat16),
        "ids": torch.arange(4, dtype=torch.int64) + rank,
        "empty": torch.zeros(0, 7),
    }


def _tier_worker(rank, port_q, result_q, done, timeout_s):
    try:
        side = _join(rank, port_q, timeout_s, tiers={(0, 2): "shm", (1, 2): "gloo"})
        out = {"tier": side.tier_name(2) if rank < 2 else None}
        if rank in (0, 1):
            for step in range(3):  # buffers are reused once the receiver freed them
                if rank == 0 and step == 2:  # no room in /dev/shm: this message goes by gloo
                    side._tier("shm").min_bytes = 1 << 60
                side.send_tensors(2, _tensors(rank + step), {"step": step})
                meta, back = side.recv_tensors(2)
                out[step] = (meta, {k: v.clone() for k, v in back.items()})
        else:
            kept = []
            for step in range(3):
                for src in (0, 1):
                    meta, got = side.recv_tensors(src)
                    out[(src, step)] = (meta, {k: v.clone() for k, v in got.items()})
                    side.send_tensors(src, {"grad": got["embeds"] * 2}, {"step": step})
                    if src == 0:
                        kept.append(got)  # the receiver holds these buffers
            out["segments"] = len(side._tiers["shm"]._attached)
        if rank == 0:  # the receiver now holds every buffer: sending must time out
            out["fallbacks"] = side.fallbacks
            tier = side._tiers["shm"]
            tier.min_bytes = 1 << 20
            tier.max_segments = len(tier._pools[2])
            for seg in tier._pools[2]:
                seg.words[0] = 1  # busy
            t0 = time.monotonic()
            try:
                side.send_tensors(2, _tensors(0))
            except TimeoutError as e:
                out["timeout"] = (time.monotonic() - t0, str(e))
            side.close()
        done.wait(60) if rank else done.set()
        # plain pickle: torch would pass tensors as fds that vanish when this process exits
        result_q.put((rank, pickle.dumps(out)))
    except Exception as e:  # pragma: no cover - reported to the test
        import traceback

        result_q.put((rank, pickle.dumps(traceback.format_exc() + repr(e))))


def test_named_tensors_over_shm_and_gloo_tiers_are_bit_exact_and_time_out():
    ctx = process_context()
    port_q, result_q, done = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = [
        ctx.Process(target=_tier_worker, args=(r, port_q, result_q, done, 3.0))
        for r in range(WORLD)
    ]
    for p in procs:
        p.start()
    results = {r: pickle.loads(b) for r, b in (result_q.get(timeout=120) for _ in range(WORLD))}
    for p in procs:
        p.join(timeout=30)
    assert all(isinstance(r, dict) for r in results.values()), results
    assert [p.exitcode for p in procs] == [0] * WORLD  # no process crashed on exit
    # no segment name outlives the run (receivers remove them once mapped)
    assert not [f for p in procs for f in glob.glob(f"/dev/shm/rdshm{p.pid}_*")]
    assert results[0]["tier"] == "shm" and results[1]["tier"] == "gloo"
    for src in (0, 1):
        for step in range(3):
            meta, got = results[2][(src, step)]
            want = _tensors(src + step)
            assert meta == {"step": step}
            assert list(got) == list(want)
            for k in want:
                assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
            meta, back = results[src][step]
            assert meta == {"step": step} and torch.equal(back["grad"], want["embeds"] * 2)
    # the receiver kept every step's tensors: two live shm buffers, the third went by gloo
    assert results[2]["segments"] == 2 and results[0]["fallbacks"] == 1
    elapsed, msg = results[0]["timeout"]
    assert 2.5 < elapsed < 30 and "held by the receiver" in msg


def _close_worker(rank, port_q, result_q, done, timeout_s):
    try:
        side = _join(rank, port_q, timeout_s, tiers={(0, 2): "shm", (1, 2): "shm"})
        out = {}
        if rank in (0, 1):
            side.send_tensors(2, _tensors(rank), {"r": rank})
            out["segments"] = len(side._tiers["shm"]._pools[2])
        else:
            got = [side.recv_tensors(src)[1]["embeds"].clone() for src in (0, 1)]
            out["got"] = [torch.equal(g, _tensors(src)["embeds"]) for src, g in zip((0, 1), got)]
        side.all_reduce_sum(torch.ones(1))  # every message has been received
        side.close()
        side.close()  # idempotent
        out["closed"] = side.closed and not side._tiers
        try:
            side.send_tensors(0 if rank == 2 else 2, {"x": torch.ones(2)})
        except Exception as e:  # the side group is shut down: no transfer after close
            out["after_close"] = str(e)
        result_q.put((rank, pickle.dumps(out)))
    except Exception as e:  # pragma: no cover - reported to the test
        import traceback

        result_q.put((rank, pickle.dumps(traceback.format_exc() + repr(e))))


def test_close_releases_shm_segments_and_the_side_group():
    ctx = process_context()
    port_q, result_q, done = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = [
        ctx.Process(target=_close_worker, args=(r, port_q, result_q, done, 3.0))
        for r in range(WORLD)
    ]
    for p in procs:
        p.start()
    results = {r: pickle.loads(b) for r, b in (result_q.get(timeout=180) for _ in range(WORLD))}
    for p in procs:
        p.join(timeout=30)
    assert all(isinstance(r, dict) for r in results.values()), results
    assert results[0]["segments"] == 1 and results[1]["segments"] == 1
    assert results[2]["got"] == [True, True]
    assert all(r["closed"] for r in results.values())
    assert all("is closed" in r["after_close"] for r in results.values()), results
    assert not [f for p in procs for f in glob.glob(f"/dev/shm/rdshm{p.pid}_*")]
