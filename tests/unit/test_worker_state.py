"""Who changes a worker's state (tier 1, source only): a worker's context
(``WorkerContext``, frozen), its state (``WorkerState``, ``StepClock``), its checkpoint
writer (``ShardWriter``) and the worker (``PartWorker``) change only through their own
methods. No function of ``ray_disagg`` assigns, augments or deletes an attribute of such
a value, sets an item of one of its attributes, or ``setattr``s it (``object.__setattr__``
included). The values are found by annotation, not by name: a parameter annotated with
one of these types, a local name bound to such a value (``ctx = w.ctx``), or an attribute
that holds one (``self.w`` set from such a parameter, ``self.state = WorkerState()``,
``self.w: PartWorker = ...``), through a value of the class that holds it. The classes
keep ``__slots__`` (or are frozen), so an old attribute name written by mistake fails at
once instead of creating a dead one. And no function of ``ray_disagg/worker`` takes a
worker, context, state, clock or writer without an annotation."""

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
    """The targets a statement writes (tuple targets unpacked; ``del`` included)."""
    if isinstance(node, ast.Assign):
        out = []
        for t in node.targets:
            out += list(t.elts) if isinstance(t, (ast.Tuple, ast.List)) else [t]
        return [t.value if isinstance(t, ast.Starred) else t for t in out]
    if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        return [node.target]
    if isinstance(node, ast.Delete):
        return list(node.targets)
    return []


def _pairs(node: ast.Assign) -> list:
    """``(target, value)`` of an assignment, tuples paired element by element."""
    out = []
    for target in node.targets:
        if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
            out += list(zip(target.elts, node.value.elts))
        else:
            out.append((target, node.value))
    return out


def _makes_guarded(value) -> bool:
    """``Guarded(...)`` or ``Guarded.create(...)``."""
    if not isinstance(value, ast.Call):
        return False
    chain = _chain(value.func) or ()
    return bool(set(chain) & GUARDED)


def holders(tree) -> dict[str, set[str]]:
    """Per class, the attributes of ``self`` that hold a guarded value: set from a
    parameter annotated with a guarded type, from ``Guarded(...)``, or annotated with a
    guarded type."""
    out: dict[str, set[str]] = {}
    for cls in ast.walk(tree):
        if not isinstance(cls, ast.ClassDef):
            continue
        attrs = out.setdefault(cls.name, set())
        for fn in cls.body:
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            every = fn.args.args + fn.args.kwonlyargs
            params = {a.arg for a in every if _guarded(a.annotation)}
            for node in ast.walk(fn):
                if isinstance(node, ast.AnnAssign) and _guarded(node.annotation):
                    chain = _chain(node.target)
                    if chain and chain[0] == "self" and len(chain) == 2:
                        attrs.add(chain[1])
                if not isinstance(node, ast.Assign):
                    continue
                for t, v in _pairs(node):
                    chain = _chain(t)
                    if not chain or len(chain) != 2 or chain[0] != "self":
                        continue
                    if (isinstance(v, ast.Name) and v.id in params) or _makes_guarded(v):
                        attrs.add(chain[1])
    return out


def _is_setattr(node) -> bool:
    """``setattr(x, ...)``, ``delattr(x, ...)``, ``object.__setattr__(x, ...)``."""
    if not isinstance(node, ast.Call) or not node.args:
        return False
    f = node.func
    if isinstance(f, ast.Name):
        return f.id in ("setattr", "delattr")
    return isinstance(f, ast.Attribute) and f.attr in ("__setattr__", "__delattr__")


class _Scope:
    """What a function's names refer to: guarded values, and values of classes that
    hold guarded values in attributes (``holders``)."""

    def __init__(self, fn, cls: str | None, holder_attrs: dict[str, set[str]]):
        self.holder_attrs = holder_attrs
        args = fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs
        self.guarded = {a.arg for a in args if _guarded(a.annotation)}
        self.types = {a.arg: _type_names(a.annotation) for a in args}
        if cls is not None and args and args[0].arg == "self":
            self.types["self"] = {cls}
        self._aliases(fn)

    def _aliases(self, fn) -> None:
        """Local names bound to a guarded value (``ctx = w.ctx``, ``w = self.w``)."""
        assigns = sorted(
            (n for n in ast.walk(fn) if isinstance(n, ast.Assign)), key=lambda n: n.lineno
        )
        for node in assigns:
            for t, v in _pairs(node):
                if isinstance(t, ast.Name) and self.is_guarded(_chain(v)):
                    self.guarded.add(t.id)

    def is_guarded(self, chain) -> bool:
        """Whether ``chain`` (``("w", "state")``) names a guarded value or one inside it."""
        if not chain:
            return False
        if chain[0] in self.guarded:
            return True
        if len(chain) < 2:
            return False
        held = set()
        for name in self.types.get(chain[0], ()):
            held |= self.holder_attrs.get(name, set())
        return chain[1] in held


def _writes(fn, scope: _Scope) -> list[tuple[int, str]]:
    """Writes into a guarded value anywhere in ``fn``: an attribute of it set, augmented
    or deleted, an item of one of its attributes set, or ``setattr`` on it."""
    found = []
    for node in ast.walk(fn):
        for t in _targets(node):
            if isinstance(t, ast.Attribute):
                inside = _chain(t.value)  # the object whose attribute is written
            elif isinstance(t, ast.Subscript):
                inside = _chain(t.value)  # the container written into
            else:
                continue
            if scope.is_guarded(inside):
                found.append((node.lineno, ast.unparse(t)))
        if _is_setattr(node) and scope.is_guarded(_chain(node.args[0])):
            found.append((node.lineno, ast.unparse(node)))
    return found


def violations(source: str, filename: str = "<src>", holder_attrs=None) -> list[str]:
    """Every write into a guarded value in a function of ``source`` (``holder_attrs``:
    :func:`holders` of the whole package; by default of ``source``)."""
    tree = ast.parse(source)
    holder_attrs = holders(tree) if holder_attrs is None else holder_attrs
    out = []

    def visit(node, cls: str | None):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, child.name)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                scope = _Scope(child, cls, holder_attrs)
                for line, what in _writes(child, scope):
                    out.append(f"{filename}:{line}: {what}")
                visit(child, None)
            else:
                visit(child, cls)

    visit(tree, None)
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
    sources = dict(_files(PACKAGE))
    held: dict[str, set[str]] = {}
    for src in sources.values():
        for cls, attrs in holders(ast.parse(src)).items():
            held.setdefault(cls, set()).update(attrs)
    assert held["PartWorker"] >= {"ctx", "state", "writer"} and held["WorkerState"] >= {"clock"}
    found = [v for name, src in sources.items() for v in violations(src, str(name), held)]
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
        # an alias of a guarded value, or of a value inside one
        "def f(w: PartWorker):\n    clock = w.state.clock\n    clock.excluded += 1.0",
        "def f(w: PartWorker):\n    ctx, n = w.ctx, 1\n    ctx.channel = None",
        "class A:\n    def __init__(self, w: PartWorker):\n        self.w = w\n"
        "    def go(self):\n        w = self.w\n        w.state.skipped = 0",
        # an item of a guarded value's attribute; object.__setattr__
        "def f(w: PartWorker):\n    w.state.pending[:] = []",
        "def f(ctx: WorkerContext):\n    ctx.args.groups['text'] = None",
        "def f(ctx: WorkerContext):\n    object.__setattr__(ctx, 'channel', None)",
        # through a holder: an attribute that holds a guarded value
        "class M:\n    def __init__(self, w: PartWorker):\n        self.w = w\n"
        "def f(llm: M):\n    llm.w.state.peer_failed = True",
        "class PartWorker:\n    def __init__(self):\n        self.state = WorkerState()\n"
        "    def go(self):\n        self.state.skipped = 0",
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
        "def f(opt):\n    opt.state[0] = {}",
        "class PartWorker:\n    def __init__(self):\n        self.state = WorkerState()\n"
        "    def go(self):\n        self.state = WorkerState()",
        "def f(w: PartWorker, stats):\n    ix = w.ctx.args.stats.index\n    stats[ix['loss']] = 0",
    ],
)
def test_the_check_allows_reads_and_owners(source):
    assert violations(textwrap.dedent(source)) == []


def test_the_check_finds_unannotated_workers():
    assert unannotated("def f(w, ctx: WorkerContext, writer):\n    pass") == [
        "<src>:1: f(w)",
        "<src>:1: f(writer)",
    ]
