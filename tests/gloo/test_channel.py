"""Tier 2: the channel's links over real gloo in separate processes."""

import glob
import pickle
import time

import torch

from ray_disagg.transport import channel as sg
from tests.dist_utils import process_context

WORLD = 3
TEXT, VISION, AUDIO = 0, 1, 2  # side ranks: three groups of one worker, text the hub


def _join(rank, port_q, timeout_s, tiers=None) -> sg.Channel:
    """Side ranks [text 0, vision 0, audio 0]; text 0 hosts the store and talks to both."""
    store = None
    if rank == TEXT:
        store, port = sg.host_store("127.0.0.1", timeout_s)
        for _ in range(WORLD - 1):
            port_q.put(port)
    else:
        port = port_q.get()
    groups = {"text": 0, "vision": 1, "audio": 2}
    spec = sg.ChannelSpec(
        "127.0.0.1", port, groups, dict.fromkeys(groups, 1), timeout_s, "t",
        tiers=tiers or {(TEXT, VISION): "gloo", (TEXT, AUDIO): "gloo"},
    )  # fmt: skip
    return sg.join(spec, rank, "127.0.0.1", store=store)


def _worker(rank, port_q, result_q, done, timeout_s):
    try:
        side = _join(rank, port_q, timeout_s)
        out = {"made": side.made, "peers": side.peers}
        if rank != TEXT:
            side.send_object({"from": rank, "ids": list(range(rank + 3))}, side.rank_of("text", 0))
            side.send(torch.full((2, 3), float(rank)), TEXT)
            out["grad"] = side.recv((2, 3), torch.float32, TEXT).tolist()
            try:  # the encoder groups do not talk to each other
                side.send(torch.ones(1), AUDIO if rank == VISION else VISION)
            except sg.TransferError as e:
                out["not_peer"] = str(e)
        else:
            for src in (VISION, AUDIO):
                out[src] = side.recv_object(src)
                emb = side.recv((2, 3), torch.float32, src)
                side.send(emb * 10, src)
        out["sum"] = side.all_reduce_sum(torch.tensor([rank + 1.0], dtype=torch.float64)).item()
        if rank == TEXT:
            t0 = time.monotonic()
            try:
                side.recv((1,), torch.float32, VISION)  # nobody sends: must time out, not hang
            except RuntimeError as e:
                out["timeout"] = (time.monotonic() - t0, str(e)[:80])
            done.set()
        else:
            done.wait(60)  # stay alive (and silent) while text 0 waits for the timeout
        result_q.put((rank, out))
    except Exception as e:  # pragma: no cover - reported to the test
        result_q.put((rank, repr(e)))


def test_links_transfer_objects_tensors_sum_over_the_hub_and_time_out():
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
    assert results[TEXT][VISION] == {"from": 1, "ids": [0, 1, 2, 3]}
    assert results[TEXT][AUDIO] == {"from": 2, "ids": [0, 1, 2, 3, 4]}
    assert results[VISION]["grad"] == [[10.0] * 3] * 2
    assert results[AUDIO]["grad"] == [[20.0] * 3] * 2
    assert all(r["sum"] == 6.0 for r in results.values())  # over the hub, no collective
    # one link (a gloo group, lazily connected) per other group a worker talks to
    assert results[TEXT]["made"] == {"gloo": 2, "nccl": 0} and results[TEXT]["peers"] == [1, 2]
    assert results[VISION]["made"] == {"gloo": 1, "nccl": 0} and results[VISION]["peers"] == [0]
    assert "audio rank 0 is not a peer of vision rank 0" in results[VISION]["not_peer"]
    elapsed, _msg = results[TEXT]["timeout"]
    assert 4.0 < elapsed < 30.0  # the link's 5 s timeout, not a hang


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
        side = _join(rank, port_q, timeout_s, tiers={(TEXT, VISION): "shm", (TEXT, AUDIO): "gloo"})
        out = {"tier": side.tier_name(TEXT) if rank != TEXT else None}
        if rank != TEXT:
            for step in range(3):  # buffers are reused once the receiver freed them
                if rank == VISION and step == 2:  # no room in /dev/shm: this goes by gloo
                    side._tier("shm").min_bytes = 1 << 60
                side.send_tensors(TEXT, _tensors(rank + step), {"step": step})
                meta, back = side.recv_tensors(TEXT)
                out[step] = (meta, {k: v.clone() for k, v in back.items()})
        else:
            kept = []
            for step in range(3):
                for src in (VISION, AUDIO):
                    meta, got = side.recv_tensors(src)
                    out[(src, step)] = (meta, {k: v.clone() for k, v in got.items()})
                    side.send_tensors(src, {"grad": got["embeds"] * 2}, {"step": step})
                    if src == VISION:
                        kept.append(got)  # the receiver holds these buffers
            out["segments"] = len(side._tiers["shm"]._attached)
        if rank == VISION:  # the receiver now holds every buffer: sending must time out
            out["fallbacks"] = side.fallbacks
            tier = side._tiers["shm"]
            tier.min_bytes = 1 << 20
            tier.max_segments = len(tier._pools[TEXT])
            for seg in tier._pools[TEXT]:
                seg.words[0] = 1  # busy
            t0 = time.monotonic()
            try:
                side.send_tensors(TEXT, _tensors(0))
            except TimeoutError as e:
                out["timeout"] = (time.monotonic() - t0, str(e))
            side.close()
        done.wait(60) if rank != VISION else done.set()
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
    assert results[VISION]["tier"] == "shm" and results[AUDIO]["tier"] == "gloo"
    for src in (VISION, AUDIO):
        for step in range(3):
            meta, got = results[TEXT][(src, step)]
            want = _tensors(src + step)
            assert meta == {"step": step}
            assert list(got) == list(want)
            for k in want:
                assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
            meta, back = results[src][step]
            assert meta == {"step": step} and torch.equal(back["grad"], want["embeds"] * 2)
    # the receiver kept every step's tensors: two live shm buffers, the third went by gloo
    assert results[TEXT]["segments"] == 2 and results[VISION]["fallbacks"] == 1
    elapsed, msg = results[VISION]["timeout"]
    assert 2.5 < elapsed < 30 and "held by the receiver" in msg


def _close_worker(rank, port_q, result_q, done, timeout_s):
    try:
        side = _join(rank, port_q, timeout_s, tiers={(TEXT, VISION): "shm", (TEXT, AUDIO): "shm"})
        out = {}
        if rank != TEXT:
            side.send_tensors(TEXT, _tensors(rank), {"r": rank})
            out["segments"] = len(side._tiers["shm"]._pools[TEXT])
        else:
            got = [side.recv_tensors(src)[1]["embeds"].clone() for src in (VISION, AUDIO)]
            out["got"] = [
                torch.equal(g, _tensors(src)["embeds"]) for src, g in zip((VISION, AUDIO), got)
            ]
        side.all_reduce_sum(torch.ones(1))  # every message has been received
        side.close()
        side.close()  # idempotent
        out["closed"] = side.closed and not side._tiers
        try:
            side.send_tensors(VISION if rank == TEXT else TEXT, {"x": torch.ones(2)})
        except Exception as e:  # the links are shut down: no transfer after close
            out["after_close"] = str(e)
        result_q.put((rank, pickle.dumps(out)))
    except Exception as e:  # pragma: no cover - reported to the test
        import traceback

        result_q.put((rank, pickle.dumps(traceback.format_exc() + repr(e))))


def test_close_releases_shm_segments_and_the_links():
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
    assert results[VISION]["segments"] == 1 and results[AUDIO]["segments"] == 1
    assert results[TEXT]["got"] == [True, True]
    assert all(r["closed"] for r in results.values())
    assert all("is closed" in r["after_close"] for r in results.values()), results
    assert not [f for p in procs for f in glob.glob(f"/dev/shm/rdshm{p.pid}_*")]
