"""Tier 1: a streamed record whose sequence is shorter than the LLM group's
context-parallel degree is skipped as a broken record naming it (counted against
``max_bad_records``), not a failure on the worker; the driver passes the degree in the
batch plan."""

import json

from ray_disagg import tiny_qwen2_5_vl_config
from ray_disagg.data.preference import PreferenceProcessor
from ray_disagg.data.stream import ConversationStream
from ray_disagg.pipeline.assignment import BatchPlan
from ray_disagg.worker.record_source import RecordSource
from tests.conversation_data import build_media, build_model_dir, make_processor
from tests.preference_records import pair_record


def test_records_shorter_than_the_cp_degree_are_skipped_as_broken(tmp_path):
    cfg = tiny_qwen2_5_vl_config()
    proc = make_processor(build_model_dir(tmp_path / "model"), build_media(tmp_path), cfg)
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(pair_record(i)) for i in range(2)) + "\n")
    stream = ConversationStream(paths=path, processor=PreferenceProcessor(proc))

    def source(min_tokens):
        plan = BatchPlan(
            num_samples=2, global_batch_size=1, dp_sizes={"text": 1}, min_tokens=min_tokens
        )
        return RecordSource(stream, plan, "text", 0, True, None, None)

    fits = source(2)
    assert fits._next()[0] == 0 and fits.bad == 0
    short = source(10**6)
    assert short._next() is None  # both records skipped
    assert short.bad == 2
    assert "tokens, fewer than the LLM group's ContextParallel(size=1000000)" in short.bad_names[0]
