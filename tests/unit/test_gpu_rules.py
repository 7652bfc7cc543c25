"""Tier 1: rules the GPU paths must keep, checked on the source (they cannot run here).

- objects (pickled) cross between ranks over gloo only: every object collective in the
  worker names one of the runtime's gloo ``object_group``s, never a model-parallel
  (NCCL on GPUs) group;
- the step issues no host synchronization before its transfers are posted: no
  ``.item()`` / ``.tolist()`` in the loops (the loss is read once the step's gradients
  are posted, from the exchanged stats: ``step_end.exchange``).
"""

import ast
import pathlib

import ray_disagg

ROOT = pathlib.Path(ray_disagg.__file__).parent
OBJECT_COLLECTIVES = {
    "broadcast_object_list",
    "all_gather_object",
    "gather_object",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
}


def _calls(path: pathlib.Path):
    tree = ast.parse(path.read_text())
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef):
            for node in ast.walk(fn):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                    yield fn.name, node


def test_object_collectives_go_over_gloo_object_groups():
    seen = 0
    for path in sorted((ROOT / "worker").rglob("*.py")):
        for fn, call in _calls(path):
            if call.func.attr in OBJECT_COLLECTIVES:
                seen += 1
                group = {k.arg: ast.unparse(k.value) for k in call.keywords}.get("group", "")
                assert "object_group" in group, f"{path.name}:{fn} {ast.unparse(call)}"
    assert seen >= 3  # the mp broadcast, the Ray Data split, the sample-id audit


def test_the_loops_read_no_device_value_on_the_host():
    for name in ("encoder.py", "llm.py", "llm_step.py", "llm_batch.py", "part_worker.py"):
        for fn, call in _calls(ROOT / "worker" / name):
            if call.func.attr in ("item", "tolist") and fn != "_plain":  # CPU sample ids
                raise AssertionError(f"{name}:{fn} {ast.unparse(call)} syncs with the device")


# Host reads outside the loops, each one documented where it is: expert parallelism's
# split sizes (all_to_all_single takes host ints), the step's expert-load metric (after
# the step's gradients).
HOST_READS = {
    ("parallel/expert_parallel.py", "_forward"),
    ("models/moe.py", "take"),
}


def test_model_and_parallel_code_reads_the_device_only_where_documented():
    found = set()
    for sub in ("parallel", "models"):
        for path in sorted((ROOT / sub).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for fn, call in _calls(path):
                if call.func.attr == "tolist" and (rel, fn) in HOST_READS:
                    found.add((rel, fn))
                elif call.func.attr == "bincount":  # reads its max on the host
                    raise AssertionError(f"{rel}:{fn} {ast.unparse(call)} syncs with the device")
    assert found == HOST_READS
