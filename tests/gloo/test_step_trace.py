"""How far one step reaches (tier 2, the workers without Ray): a tracing drill
(``fault_drill(trace=True)``) records the ``ray_disagg`` files and functions that one
dense step enters on a group's rank 0 (``sys.setprofile`` on the training thread, from
the start of step 2 to the start of step 3 of a 1 + 1 run without a checkpoint at step 2;
comprehensions and lambdas not counted), for the LLM group and for the encoder group.

The limits are the counts of the step rearranged into one function of named phases per
side (``worker/llm_step.py``, ``worker/encoder.py``, December 2026): the LLM step entered
40 files and 184 functions (21 and 91 of them in ``worker/``), the encoder step 37 and
143 (18 and 68). Before the typed context and the rearrangement they were 34 and 167 (15
and 75), 32 and 129 (13 and 55): the new owners (context, state, clock, stats,
reporting, the end-of-step phases) are small functions of their own. The limits leave
room for another transfer tier (gloo where /dev/shm is full: a file and a few
functions). The links between groups (issue 52, milestone 2, December 2026) added two
functions to a step: a peer's route and the LLM rank 0's share of the statistics' sum
over the groups' rank 0s (text: 190); the step's data wait (issue 54) one, the time a
group spends getting its inputs. A change that spreads a step over more modules
fails here; one that brings a step together lowers the limits."""

import json

import pytest

from ray_disagg.testing.faults import fault_drill
from tests.helpers import RESTART_LOOP, group, restart_setup, vt
from tests.helpers import run_layout as fit

LIMITS = {"text": (41, 191), "vision": (38, 150)}
"""Per group: the most ``ray_disagg`` files and functions one step may enter."""


@pytest.mark.parametrize("part", ["text", "vision"])
def test_one_step_enters_at_most_the_limits_files_and_functions(part, tmp_path):
    _, spec, data = restart_setup()
    marker = tmp_path / "trace.json"
    loop = dict(RESTART_LOOP, max_steps=3, checkpoint_every=None)  # step 2: no checkpoint
    with fault_drill(group=part, step=1, marker=marker, trace=True):
        fit(spec, data, loop, vt(group(1), group(1)), tmp_path, "traced", local=True)
    trace = json.loads(marker.read_text())
    files, functions = trace["files"], trace["functions"]
    assert ["worker/faults_hook.py", "drill"] in functions  # the step's start was seen
    max_files, max_functions = LIMITS[part]
    assert len(files) <= max_files, files
    assert len(functions) <= max_functions, functions
