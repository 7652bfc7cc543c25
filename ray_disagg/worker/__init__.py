"""What runs inside each Ray Train worker: its runtime (mesh, channel), the loops that
execute the pipeline schedule, the optimizer step, metrics, checkpoints and ingest."""
