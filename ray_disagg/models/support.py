"""What each family supports, read from its adapter's declarations (``sp_parts``,
``sp_refusals``, ``tower_tp_plan``, ``tp_parts``, ``tp_refusals``, ``cp_parts``,
``packing_refusal``, ``generation_refusal``, ``media``, the config's experts): the
README's support matrix is generated from it (between the markers :data:`BEGIN` and
:data:`END`; a test fails when they disagree) and ``ray-disagg plan`` prints the recipe
family's row. The driver's checks (``ray_disagg.launch.checks``) read the same
declarations, so a "yes" here is a layout the driver accepts and a refusal is the reason
its ``ValueError`` names.

Regenerate the README's table with ``python -m ray_disagg.models.support --write
README.md``.

Example:
    >>> from ray_disagg.models import ADAPTERS
    >>> family_support(ADAPTERS["qwen2_5_vl"])["encoder SP"]
    'yes'
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import NamedTuple

__all__ = [
    "BEGIN",
    "COLUMNS",
    "END",
    "Support",
    "family_checks",
    "family_row",
    "family_support",
    "support_markdown",
]

BEGIN = "<!-- support-matrix:begin (generated: python -m ray_disagg.models.support) -->"
END = "<!-- support-matrix:end -->"
COLUMNS = (
    "groups",
    "media",
    "encoder SP",
    "encoder TP",
    "LLM TP",
    "LLM CP",
    "experts (EP)",
    "packing",
    "generation",
)
"""The matrix's columns after ``model_type`` (``encoder``: each encoder group, named
where there are several)."""


class Support(NamedTuple):
    """Whether ``part`` supports a ``column`` of the matrix, else the driver's reason."""

    column: str
    part: str
    refusal: str | None
    condition: str = ""
    """A setting the support needs (e.g. the router's auxiliary loss off)."""


def family_checks(adapter_cls) -> list[Support]:
    """The parallelisms of one family (an adapter class; its tiny config is read) per
    part: every encoder group's ``SequenceParallel`` and ``TensorParallel``, the LLM's
    ``TensorParallel`` and ``ContextParallel``, ``pack_sequences``, and generation
    (GRPO's rollouts on the training groups)."""
    a = adapter_cls(adapter_cls.tiny_config())
    llm, out = a.llm_part, []
    text = getattr(a.config, "text_config", a.config)
    for part in a.encoder_parts:
        sp = None if part in a.sp_parts else a.sp_refusals.get(part, "no Ulysses plan")
        has_tp = part in a.tp_parts and a.tower_tp_plan(part) is not None
        tp = None if has_tp else a.tp_refusals.get(part, "no tensor-parallel plan")
        out += [Support("encoder SP", part, sp), Support("encoder TP", part, tp)]
    tp = a.tp_refusals.get(llm) or (None if llm in a.tp_parts else "no tensor-parallel plan")
    out.append(Support("LLM TP", llm, tp))
    cp = None if llm in a.cp_parts else "no context plan"
    out.append(Support("LLM CP", llm, cp, f"tp=1: {a.cp_tp_refusal}" if a.cp_tp_refusal else ""))
    aux = "with output_router_logits off" if getattr(text, "num_experts", None) else ""
    out.append(Support("packing", llm, a.packing_refusal, aux))
    out.append(Support("generation", llm, a.generation_refusal))
    return out


def family_support(adapter_cls) -> dict[str, str]:
    """``column -> cell`` of one family: ``yes``, ``no: <the reason the driver names>``,
    or ``-`` where the column does not apply (per encoder group where there are
    several)."""
    a = adapter_cls(adapter_cls.tiny_config())
    text = getattr(a.config, "text_config", a.config)
    cells: dict[str, list[str]] = {}
    for check in family_checks(adapter_cls):
        cell = "yes" if check.refusal is None else f"no: {check.refusal}"
        cell += f" ({check.condition})" if check.condition else ""
        if check.column.startswith("encoder") and len(a.encoder_parts) > 1:
            cell = f"`{check.part}` {cell}"
        cells.setdefault(check.column, []).append(cell)
    out = {
        "groups": ", ".join(f"`{p}`" for p in a.parts),
        "media": ", ".join(a.media),
        **{k: "; ".join(v) for k, v in cells.items()},
        "experts (EP)": "yes" if getattr(text, "num_experts", None) else "-",
    }
    return {c: out[c] for c in COLUMNS}


def support_markdown() -> str:
    """The support matrix of every registered family, as a Markdown table."""
    from ray_disagg.models import ADAPTERS

    head = ["`model_type`", *COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for model_type, cls in ADAPTERS.items():
        cells = family_support(cls)
        lines.append("| " + " | ".join([f"`{model_type}`", *cells.values()]) + " |")
    return "\n".join(lines)


def family_row(model_type: str) -> str:
    """One family's support as a line (``ray-disagg plan`` prints it)."""
    from ray_disagg.models import ADAPTERS

    cells = family_support(ADAPTERS[model_type])
    return f"support ({model_type}): " + "; ".join(f"{k} {v}" for k, v in cells.items())


def _replace(readme: str, table: str) -> str:
    pattern = re.escape(BEGIN) + r".*?" + re.escape(END)
    if not re.search(pattern, readme, flags=re.S):
        raise ValueError(f"the markers {BEGIN!r} ... {END!r} are missing")
    return re.sub(pattern, lambda _: f"{BEGIN}\n{table}\n{END}", readme, flags=re.S)


def main(argv=None) -> int:
    """Print the matrix, or ``--write FILE``: replace the table between the markers."""
    parser = argparse.ArgumentParser(prog="python -m ray_disagg.models.support")
    parser.add_argument("--write", metavar="FILE", help="rewrite the table in FILE")
    args = parser.parse_args(argv)
    table = support_markdown()
    if args.write is None:
        print(table)
        return 0
    path = Path(args.write)
    path.write_text(_replace(path.read_text(), table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
