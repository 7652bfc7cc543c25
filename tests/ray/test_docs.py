"""Tier 3: the README's and ``docs/``'s Python blocks marked ``<!-- docs-test: ray -->``
(a ``fit()`` on tiny models) run on a real local Ray cluster, each on its own; their runs
go under the test's temporary directory instead of ``/tmp/ray_disagg_runs``.
(``tests/unit/test_docs.py`` runs the other blocks and checks the links.)"""

import pytest

from ray_disagg import load_metrics
from tests.unit.test_docs import PAGES, python_blocks

RAY_BLOCKS = [
    (page, i, code)
    for page in PAGES
    for i, (marker, code) in enumerate(python_blocks(page))
    if marker == "ray"
]


@pytest.mark.parametrize(
    "page,index,code", RAY_BLOCKS, ids=[f"{p.name}[{i}]" for p, i, _ in RAY_BLOCKS]
)
def test_ray_blocks_train(ray_start_4_cpus, tmp_path, monkeypatch, page, index, code):
    monkeypatch.chdir(tmp_path)
    code = code.replace('"/tmp/ray_disagg_runs"', repr(str(tmp_path / "runs")))
    namespace = {"__name__": "__docs__"}
    exec(compile(code, f"{page.name}[block {index}]", "exec"), namespace)  # noqa: S102
    result = namespace["result"]  # every such block fits a trainer
    assert result.error is None and result.checkpoint is not None
    history = load_metrics(result)
    if "reward" in history:  # GRPO: each step generated and scored its completions
        assert (history["rollout_s"] > 0).all() and history["reward"].notna().all()
        return
    losses = history["loss"].tolist()
    assert losses[-1] < losses[0]
