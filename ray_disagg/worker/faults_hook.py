"""Placeholder until the fault-drill hook lands (replaced at merge)."""


def drill(module: str, group_rank: int, step: int, micro_batch: int | None = None) -> None:
    return None
