"""Tier 1: imports flow one way. The layers below the runtime (model adapters, parallel
techniques, transports, the pipeline) never import the worker, the launcher, the trainer,
the test machinery or Ray; nothing in the package but ``ray_disagg.testing`` itself and the
tests imports ``ray_disagg.testing`` from a user's path; family knowledge stays in
``ray_disagg.models``."""

import ast
import pathlib
import re

import pytest

import ray_disagg

ROOT = pathlib.Path(ray_disagg.__file__).parent
LOWER = ("models", "parallel", "transport", "pipeline", "rollout")
FORBIDDEN = (
    "ray",
    "ray_disagg.worker",
    "ray_disagg.launch",
    "ray_disagg.recipes",
    "ray_disagg.testing",
    "ray_disagg.trainer",
)


def _imports(path: pathlib.Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
    return names


def _bad(name: str, forbidden) -> list[str]:
    return [x for x in forbidden if name == x or name.startswith(x + ".")]


@pytest.mark.parametrize("package", LOWER)
def test_layers_below_the_runtime_do_not_import_it(package):
    files = sorted((ROOT / package).rglob("*.py"))  # every subpackage too
    assert files
    for f in files:
        for name in _imports(f):
            assert not _bad(name, FORBIDDEN), f"{f.relative_to(ROOT)} imports {name}"


# The one door from the package into the test machinery: the workers' fault-drill hook,
# which imports ``ray_disagg.testing.faults`` only when RAY_DISAGG_FAULT_DRILL is set.
TEST_MACHINERY_DOORS = {pathlib.Path("worker", "faults_hook.py")}


def test_only_tests_reach_the_test_machinery():
    """``ray_disagg.testing`` (reference runner, fault injection) is imported by no module
    of the package outside it but the fault-drill hook: a user's configuration cannot
    reach it."""
    doors = set()
    for f in sorted(ROOT.rglob("*.py")):
        rel = f.relative_to(ROOT)
        if rel.parts[0] == "testing":
            continue
        for name in _imports(f):
            if _bad(name, ("ray_disagg.testing",)):
                assert rel in TEST_MACHINERY_DOORS, f"{rel} imports {name}"
                assert name in ("ray_disagg.testing", "ray_disagg.testing.faults"), name
                doors.add(rel)
    assert doors == TEST_MACHINERY_DOORS  # the hook really is the door


def test_nothing_outside_tests_benchmarks_and_testing_imports_the_reference_runner():
    """The single-process reference runner is for tests and benchmarks only."""
    repo = ROOT.parent
    allowed = ("tests", "benchmarks", "ray_disagg/testing")
    for f in sorted(repo.rglob("*.py")):
        rel = f.relative_to(repo).as_posix()
        if rel.startswith((".", "build/")) or "/.venv/" in f"/{rel}" or rel.startswith(allowed):
            continue
        text = f.read_text()
        assert "testing.reference" not in text and "reference_train" not in text, rel


def test_every_registered_adapter_has_its_own_module_and_tiny_config():
    from ray_disagg.models import ADAPTERS

    for model_type, adapter in ADAPTERS.items():
        assert adapter.model_type == model_type
        assert adapter.__module__.rsplit(".", 1)[-1] != "base"
        cfg = adapter.tiny_config()
        assert cfg.model_type == model_type


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports explicitly, anywhere in its body
    (inside functions too): ``from a import b`` counts as ``a.b`` when that is a module,
    else as ``a``; the parent packages an import runs implicitly are not counted."""
    files = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        out = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                out |= {a.name for a in node.names if a.name in files}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                for a in node.names:
                    target = f"{base}.{a.name}"
                    out.add(target if target in files else base)
        graph[name] = (out & files.keys()) - {name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles_anywhere_in_the_package():
    """No cycle of explicit imports between the package's modules, imports inside
    functions included (a lazy import hides a cycle, it does not remove it)."""
    graph = _import_graph()
    assert len(graph) > 100 and "ray_disagg.launch.worker_groups" in graph
    assert _cycles(graph) == []


def test_the_cycle_check_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_reaches_into_another_modules_private_names():
    """``from ray_disagg.x import _name`` and ``x._name`` on an imported module of the
    package are refused: what crosses modules is public (the package's private module
    ``_legacy`` aside)."""
    files = {_module_name(p): p for p in ROOT.rglob("*.py")}
    offenders = []
    for name, path in files.items():
        tree = ast.parse(path.read_text())
        modules = set()  # local names bound to modules of the package
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ray_disagg"):
                for a in node.names:
                    if a.name.startswith("_") and a.name != "_legacy":
                        offenders.append(f"{name} imports {node.module}.{a.name}")
                    if f"{node.module}.{a.name}" in files:
                        modules.add(a.asname or a.name)
            elif isinstance(node, ast.Import):
                modules |= {a.asname for a in node.names if a.asname and a.name in files}
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in modules
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                offenders.append(f"{name} uses {node.value.id}.{node.attr}")
    assert offenders == []


def _modules_after_building(model_type: str) -> list[str]:
    """In a child of the numerics tier's fork server (which imported torch, transformers'
    modeling utilities and the worker loops, nothing else): the modules loaded once the
    trainer and the worker loops are imported and ``model_type``'s parts are built."""
    import sys

    import ray_disagg.trainer
    import ray_disagg.worker.encoder
    import ray_disagg.worker.llm  # noqa: F401 - the loops
    from ray_disagg import HFModelSpec
    from ray_disagg.models import ADAPTERS

    spec = HFModelSpec(config=ADAPTERS[model_type].tiny_config())
    for part in spec.adapter.parts:
        spec.build_part(part)
    return sorted(sys.modules)


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "gemma3"])
def test_building_one_family_imports_no_other_family(model_type):
    """In a process that loaded no family, the worker loops and one family's parts import
    that family's adapter and transformers modeling code only (and those of the adapters
    it derives from): families are registered lazily. (A child of the preloaded fork
    server, not a fresh interpreter: the same modules, without importing torch again.)"""
    from ray_disagg.models import ADAPTERS
    from ray_disagg.testing.local import process_context

    with process_context().Pool(1) as pool:
        loaded = set(pool.apply(_modules_after_building, (model_type,)))
    own = {c.__module__ for c in ADAPTERS[model_type].__mro__}
    own |= {getattr(c, "hf_class", type).__module__ for c in ADAPTERS[model_type].__mro__}
    for cls in ADAPTERS.values():
        for module in (cls.__module__, cls.hf_class.__module__):
            assert module in own or module not in loaded, f"{model_type} loaded {module}"


# Where families may be named: their own packages, and the test machinery (which writes
# each family's model directory and chat template for the tests); the package's
# ``__init__`` exports each family's tiny config by name.
FAMILY_HOMES = ("models", "testing")


# The families' words (each built-in model_type starts with one; checked below) and the
# family features the generic code once named.
FAMILY_WORDS = ("gemma", "internvl", "llava", "qwen", "deepstack", "omni")


def _family_words() -> re.Pattern:
    """``FAMILY_WORDS`` as whole words of letters (``Qwen2VL``, ``_llava_parts``; not
    ``omnibus``), any case."""
    return re.compile(r"(?<![a-z])({})(?![a-z])".format("|".join(FAMILY_WORDS)), re.IGNORECASE)


def test_every_built_in_family_has_its_word():
    from ray_disagg.models import ADAPTERS

    words = _family_words()
    for model_type, cls in ADAPTERS.items():
        if cls.__module__.startswith("ray_disagg.models."):
            assert words.match(model_type.split("_")[0].rstrip("0123456789")), model_type


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of the string constants standing alone as a statement (docstrings)."""
    out = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        for stmt in body if isinstance(body, list) else []:
            if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
                out.add(id(stmt.value))
    return out


def _family_mentions(source: str, words: re.Pattern) -> list[str]:
    """What ``source`` names of a family outside docstrings and comments: an import of a
    family package (a subpackage of ``ray_disagg.models``) or of transformers' per-model
    modules, an identifier or a string with a family's word."""
    tree, found = ast.parse(source), []
    docs = _docstrings(tree)
    packages = {p.name for p in (ROOT / "models").iterdir() if (p / "__init__.py").exists()}
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ("ray_disagg." if node.level else "") + (node.module or "")
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        for name in names:
            top, _, rest = name.partition(".models.")
            family = rest.split(".")[0]
            if (top == "transformers" and family) or (top == "ray_disagg" and family in packages):
                found.append(f"line {node.lineno}: imports {name}")
        text = None
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            text = node.value
        elif isinstance(node, ast.Name):
            text = node.id
        elif isinstance(node, ast.Attribute):
            text = node.attr
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            text = node.name
        elif isinstance(node, ast.alias):
            text = f"{node.name} as {node.asname}"
        elif isinstance(node, (ast.arg, ast.keyword)):
            text = node.arg
        if text is not None and words.search(text):
            found.append(f"line {getattr(node, 'lineno', '?')}: {text[:60]!r}")
    return found


def test_no_family_is_named_outside_the_models_package():
    """``data/``, ``recipes/``, ``parallel/``, ``pipeline/``, ``transport/``, ``worker/``,
    ``launch/`` and every other module outside ``models/`` ask the adapter's hooks: they
    import no family module and name no family (docstrings aside), so a family is one
    package (``register_family``)."""
    words, offenders, seen = _family_words(), [], set()
    for f in sorted(ROOT.rglob("*.py")):
        rel = f.relative_to(ROOT)
        if rel.parts[0] in FAMILY_HOMES or rel == pathlib.Path("__init__.py"):
            continue
        seen.add(rel.parts[0])
        offenders += [f"{rel} {m}" for m in _family_mentions(f.read_text(), words)]
    assert {"data", "recipes", "parallel", "pipeline", "transport", "worker", "launch"} <= seen
    assert offenders == []


def test_the_family_check_finds_a_family():
    source = (
        '"""Qwen in a docstring is fine."""\n'
        "import transformers.models.gemma3.modeling_gemma3\n"
        "from ray_disagg.models.internvl import adapter\n"
        "from ..models import llava_common as tiles\n"
        "omnibus = 1\n"
        "from ray_disagg.models import base\n"
        "if config.model_type == 'llava_onevision':\n"
        "    slice_deepstack(x)\n"
    )
    found = _family_mentions(source, _family_words())
    assert any("imports transformers.models.gemma3" in m for m in found)
    assert any("imports ray_disagg.models.internvl" in m for m in found)
    assert any("imports ray_disagg.models.llava_common" in m for m in found)  # relative
    assert not any("omnibus" in m for m in found)
    assert not any("models.base" in m for m in found)
    assert any("'llava_onevision'" in m for m in found)
    assert any("'slice_deepstack'" in m for m in found)
    assert not any("Qwen in" in m for m in found)


FIRST_IMPORTS = """
import importlib, json, pathlib, sys

import ray_disagg

root = pathlib.Path(ray_disagg.__file__).parent
packages = sorted(
    ".".join(("ray_disagg", *p.parent.relative_to(root).parts))
    for p in root.rglob("__init__.py") if p.parent != root
)
failed = []
for what in [*ray_disagg.__all__, *packages]:
    for m in [m for m in sys.modules if m == "ray_disagg" or m.startswith("ray_disagg.")]:
        del sys.modules[m]
    try:
        if what.startswith("ray_disagg."):
            importlib.import_module(what)
        else:
            getattr(importlib.import_module("ray_disagg"), what)
    except Exception as e:
        failed.append(f"{what}: {type(e).__name__}: {e}")
print(json.dumps({"tried": len(ray_disagg.__all__) + len(packages), "failed": failed}))
"""


def test_every_public_name_and_package_imports_first():
    """Whatever a program imports first from the package (each public name, each
    subpackage) loads: no import cycle that only bites in one order (the cycle test above
    reads explicit imports; a package's ``__init__`` runs implicitly). One interpreter,
    the package's modules dropped before each try (torch and Ray stay loaded)."""
    import json
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", FIRST_IMPORTS], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["tried"] > 50 and got["failed"] == []
