"""The recipe keys' reference in ``docs/recipes-and-cli.md``, generated from the schema
(``MODEL`` and ``DATA`` with their defaults, and the descriptions beside them); a test
fails while the page is stale. Rewrite it with::

    python -m ray_disagg.recipes.reference --write docs/recipes-and-cli.md
"""

from __future__ import annotations

import argparse
import json

from ray_disagg.recipes.data import DATA, KEY_HELP, TYPE_HELP
from ray_disagg.recipes.schema import REQUIRED
from ray_disagg.recipes.sections import MODEL, MODEL_HELP

__all__ = ["END", "START", "render", "replace"]

START = "<!-- recipe-reference: python -m ray_disagg.recipes.reference --write -->"
END = "<!-- recipe-reference: end -->"


def _default(value) -> str:
    if value is REQUIRED:
        return "required"
    return "" if value is None else f"`{json.dumps(value)}`"


def _table(keys: dict, help_: dict) -> list[str]:
    rows = ["| key | default | |", "|---|---|---|"]
    rows += [f"| `{k}` | {_default(v)} | {help_[k]} |" for k, v in keys.items()]
    return rows


def render() -> str:
    """The reference: the ``model`` keys, then each data type and its keys."""
    out = ["**`model`**", "", *_table(MODEL, MODEL_HELP), ""]
    out += ["**`data.train` / `data.validation`** (`type:` one of "
            + ", ".join(f"`{t}`" for t in DATA) + "; a list of sources, each with `name` "
            "and `weight`, is a training mixture)", ""]  # fmt: skip
    for kind, keys in DATA.items():
        out += [f"`type: {kind}`: {TYPE_HELP[kind]}.", "", *_table(keys, KEY_HELP), ""]
    return "\n".join(out).rstrip("\n") + "\n"


def replace(text: str) -> str:
    """``text`` with the part between :data:`START` and :data:`END` rendered anew."""
    if START not in text or END not in text.split(START, 1)[1]:
        raise ValueError(f"the page needs the markers {START!r} and {END!r}")
    head, rest = text.split(START, 1)
    return f"{head}{START}\n{render()}{END}{rest.split(END, 1)[1]}"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Print or write the recipe keys' reference.")
    p.add_argument("--write", metavar="PAGE", help="rewrite the reference in PAGE")
    args = p.parse_args(argv)
    if args.write is None:
        print(render(), end="")
        return
    with open(args.write, encoding="utf-8") as f:
        text = replace(f.read())  # before the page is opened for writing: no markers, no write
    with open(args.write, "w", encoding="utf-8") as f:
        f.write(text)


if __name__ == "__main__":
    main()
