"""Who changes a worker's state (tier 1, source only): a worker's context
(``WorkerContext``, frozen), its state (``WorkerState``, ``StepClock``), its checkpoint
writer (``ShardWriter``) and the worker (``PartWorker``) change only through their own
methods. No function of ``ray_disagg`` assigns, augments, ``setattr``s or ``delattr``s an
attribute (nested attributes included) of such a value it was passed; the values are
found by annotation (a parameter annotated with one of these types, or an attribute of
``self`` set from such a parameter or annotated with such a type), not by name. And no
function of ``ray_disagg/worker`` takes a worker, context, state, clock or writer without
an annotation."""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "ray_disagg"
GUARDED = {"PartWorker", "WorkerContext", "WorkerState", "StepClock", "ShardWriter"}
"""The types whose attributes only their own methods write."""
WORKER_NAMES = {"w", "worker", "ctx", "state", "clock", "writer"}
"""Parameter names that, in ``ray_disagg/worker``, must carry an annotation."""


def _type_names(annotation) -> set[str]:
    """The class names an annotation mentions (``A``, ``m.A``, ``A | None``, ``"A"``,
    ``Optional[A]``)."""
    if annotation is None:
        return set()
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        return _type_names(ast.parse(annotation.value, mode="eval").body)
    names = set()
    for node in ast.walk(annotation):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
    return names


def _guarded(annotation) -> bool:
    return bool(_type_names(annotation) & GUARDED)


def _chain(node) -> tuple[str, ...] | None:
    """``a.b.c`` as ``("a", "b", "c")``; ``None`` for anything not a plain chain."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Subscript):  # a.b[0].c: the chain of a.b
        return _chain(node.value)
    if isinstance(node, ast.Name):
        return (node.id, *reversed(parts))
    return None


def _targets(node) -> list:
    if isinstance(node, ast.Assign):
        out = []
        for t in node.targets:
            out += list(t.elts) if isinstance(t, (ast.Tuple, ast.List)) else [t]
        return [t.value if isinstance(t, ast.Starred) else t for t in out]
    if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        return [node.target]
    return []


def _self_attributes(cls: ast.ClassDef) -> set[str]:
    """Attributes of ``self`` that hold a guarded value: set in ``__init__`` from a
    parameter annotated with a guarded type, or annotated so themselves."""
    out = set()
    for fn in cls.body:
        if not isinstance(fn, ast.FunctionDef):
            continue
        params = {a.arg for a in fn.args.args + fn.args.kwonlyargs if _guarded(a.annotation)}
        for node in ast.walk(fn):
            if isinstance(node, ast.AnnAssign) and _guarded(node.annotation):
                chain = _chain(node.target)
                if chain and chain[0] == "self" and len(chain) == 2:
                    out.add(chain[1])
            if not isinstance(node, ast.Assign) or fn.name != "__init__":
                continue
            for target in node.targets:
                pairs = [(target, node.value)]
                if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                    pairs = list(zip(target.elts, node.value.elts))
                for t, v in pairs:
                    chain = _chain(t)
                    from_param = isinstance(v, ast.Name) and v.id in params
                    if from_param and chain and len(chain) == 2 and chain[0] == "self":
                        out.add(chain[1])
    return out


def _is_setattr(node) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("setattr", "delattr")
        and bool(node.args)
    )


def _writes(fn, roots: set[tuple[str, ...]]) -> list[tuple[int, str]]:
    """Writes into attributes of the values ``roots`` (chains: ``("w",)``,
    ``("self", "w")``) anywhere in ``fn``."""

    def under(chain) -> bool:
        return chain is not None and any(
            chain[: len(r)] == r and len(chain) > len(r) for r in roots
        )

    found = []
    for node in ast.walk(fn):
        for t in _targets(node):
            if isinstance(t, ast.Attribute) and under(_chain(t)):
                found.append((node.lineno, ast.unparse(t)))
        if _is_setattr(node):
            chain = _chain(node.args[0])
            if chain is not None and any(chain[: len(r)] == r for r in roots):
                found.append((node.lineno, ast.unparse(node)))
        if isinstance(node, ast.Delete):
            for t in node.targets:
                if isinstance(t, ast.Attribute) and under(_chain(t)):
                    found.append((node.lineno, ast.unparse(t)))
    return found


def violations(source: str, filename: str = "<src>") -> list[str]:
    """Every write into a guarded value passed into a function of ``source``."""
    tree = ast.parse(source)
    out = []

    def visit(node, self_attrs: set[str]):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, _self_attributes(child))
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = child.args
                every = args.posonlyargs + args.args + args.kwonlyargs
                roots = {(a.arg,) for a in every if _guarded(a.annotation)}
                roots |= {("self", a) for a in self_attrs}
                for line, what in _writes(child, roots):
                    out.append(f"{filename}:{line}: {what}")
                visit(child, set())
            else:
                visit(child, self_attrs)

    visit(tree, set())
    return sorted(set(out))


def unannotated(source: str, filename: str = "<src>") -> list[str]:
    """Parameters named like a worker, context, state, clock or writer without an
    annotation."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            for a in args.posonlyargs + args.args + args.kwonlyargs:
                if a.arg in WORKER_NAMES and a.annotation is None:
                    out.append(f"{filename}:{node.lineno}: {node.name}({a.arg})")
    return out


def _files(folder: Path):
    for path in sorted(folder.rglob("*.py")):
        yield path.relative_to(PACKAGE.parent), path.read_text()


def test_no_function_writes_into_a_worker_context_or_state_it_was_passed():
    found = [v for name, src in _files(PACKAGE) for v in violations(src, str(name))]
    assert found == [], "change these through the owner's methods:\n" + "\n".join(found)


def test_every_worker_argument_is_annotated():
    found = [v for name, src in _files(PACKAGE / "worker") for v in unannotated(src, str(name))]
    assert found == [], "annotate:\n" + "\n".join(found)


def test_the_context_is_frozen_and_annotated():
    import dataclasses

    from ray_disagg.worker.context import WorkerContext

    assert WorkerContext.__dataclass_params__.frozen
    fields = dataclasses.fields(WorkerContext)
    assert all(f.kw_only and f.type not in (None, "") for f in fields)
    assert {"args", "channel", "device", "dp_mesh", "group_rank", "leader"} <= {
        f.name for f in fields
    }


@pytest.mark.parametrize(
    "source",
    [
        "def f(w: PartWorker):\n    w.clock = 1",
        "def f(w: 'PartWorker'):\n    w.state.clock.excluded += 1.0",
        "def f(ctx: WorkerContext | None):\n    ctx.channel, x = None, 1",
        "def f(s: WorkerState):\n    setattr(s, 'skipped', 0)",
        "def f(s: WorkerState):\n    setattr(s.clock, 'trace', None)",
        "def f(x: ShardWriter):\n    del x.pending",
        "def f(w: PartWorker):\n    def g():\n        w.writer.mixture = {}\n    g()",
        "def f(w: PartWorker):\n    w.args[0].x = 1",
        "class A:\n    def __init__(self, w: PartWorker):\n        self.w = w\n"
        "    def go(self):\n        self.w.peer_failed = True",
        "class A:\n    def __init__(self, llm):\n        self.w: PartWorker = llm.w\n"
        "    def go(self):\n        self.w.skipped += 1",
    ],
)
def test_the_check_finds_writes(source):
    assert len(violations(textwrap.dedent(source))) == 1


@pytest.mark.parametrize(
    "source",
    [
        "def f(w: PartWorker):\n    w.state.count_skipped()\n    x = w.ctx.part",
        "def f(w: PartWorker):\n    w = make()\n    other.x = w",
        "def f(p: torch.nn.Parameter):\n    p.grad = None",
        "class WorkerState:\n    def count(self):\n        self.skipped += 1",
        "def f(w: PartWorker):\n    setattr(other, 'x', w)",
    ],
)
def test_the_check_allows_reads_and_owners(source):
    assert violations(textwrap.dedent(source)) == []


def test_the_check_finds_unannotated_workers():
    assert unannotated("def f(w, ctx: WorkerContext, writer):\n    pass") == [
        "<src>:1: f(w)",
        "<src>:1: f(writer)",
    ]
