"""The package's structure as docs/architecture.md states it: floors, no import circle, no private name imported
from another module, the environment read in one module, no knob hidden in an environment variable."""
from __future__ import annotations

import ast
import os
import re
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = "megatron_jetrl"

# Lowest floor first; a module may import only from its own floor or below. Within a floor, imports go
# one way (checked as no circle). The first entry that prefixes a module's name gives its floor.
FLOORS = [
    ("errors", "env", "files", "platform", "memory", "precision.recipe", "precision.layout"),
    ("kernels",),
    ("precision",),
    ("config", "distributed"),
    ("models",),
    ("data", "rewards", "metrics", "trainer", "sync", "rollout"),
    ("scheduler",),
    ("run", "train", "launch", "bench", "cli"),
]


def modules() -> dict[str, str]:
    out = {}
    for dp, _, fs in os.walk(os.path.join(REPO, PKG)):
        for f in fs:
            if f.endswith(".py"):
                path = os.path.join(dp, f)
                name = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
                out[name[: -len(".__init__")] if name.endswith(".__init__") else name] = path
    return out


def imports(mods: dict[str, str]) -> tuple[dict[str, set[str]], list[tuple[str, str]]]:
    """Each module's imports of package modules (at any depth: lazy imports count) and private names imported."""
    edges, private = {m: set() for m in mods}, []
    for m, path in mods.items():
        pkg = m if path.endswith("__init__.py") else m.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = pkg.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
                if not base.startswith(PKG):
                    continue
                for a in node.names:
                    target = f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                    if target in mods and target != m:
                        edges[m].add(target)
                    if a.name.startswith("_") and not a.name.startswith("__"):
                        private.append((m, f"{base}.{a.name}"))
            elif isinstance(node, ast.Import):
                edges[m] |= {a.name for a in node.names if a.name in mods and a.name != m}
    return edges, private


def floor(mod: str) -> int:
    rel = mod[len(PKG) + 1:] if mod != PKG else ""
    for i, names in enumerate(FLOORS):
        if any(rel == n or rel.startswith(n + ".") for n in names):
            return i
    raise AssertionError(f"{mod}: on no floor of tests/test_architecture.py's FLOORS")


def test_floors_and_no_circle():
    mods = modules()
    edges, private = imports(mods)
    up = [(a, b) for a in edges for b in edges[a] if a != PKG and floor(b) > floor(a)]
    assert not up, f"imports from a higher floor: {up}"
    assert not private, f"private names imported from another module: {private}"
    # no circle: a depth-first search finds no back edge
    state: dict[str, int] = {}

    def visit(m, path):
        state[m] = 1
        for n in sorted(edges[m]):
            if state.get(n) == 1:
                raise AssertionError(f"import circle: {' -> '.join(path[path.index(n):] + [n])}")
            if n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(mods):
        if m not in state:
            visit(m, [m])


def test_the_checker_finds_a_circle_and_an_upward_import(tmp_path, monkeypatch):
    """The checks above on a package with a circle and a kernel importing the model layer."""
    pkg = tmp_path / PKG
    (pkg / "kernels").mkdir(parents=True)
    (pkg / "models").mkdir()
    for d in (pkg, pkg / "kernels", pkg / "models"):
        (d / "__init__.py").write_text("")
    (pkg / "kernels" / "k.py").write_text("from megatron_jetrl.models.m import f\n")
    (pkg / "models" / "m.py").write_text("from megatron_jetrl.kernels.k import g\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", str(tmp_path))
    try:
        test_floors_and_no_circle()
    except AssertionError as e:
        assert "higher floor" in str(e) and "kernels.k" in str(e)
    else:
        raise AssertionError("the upward import was not found")


def test_environment_is_read_in_one_module():
    """Settings are typed config; ``env.py`` alone reads the environment (a secret, a path, what launchers and
    Triton set)."""
    readers = []
    for m, path in modules().items():
        if m != f"{PKG}.env" and re.search(r"os\.environ|os\.getenv|getenv\(", open(path).read()):
            readers.append(m)
    assert not readers, f"read the environment outside megatron_jetrl/env.py: {readers}"
    names = set()
    for _, path in modules().items():
        names |= set(re.findall(r"JETRL_[A-Z_]+", open(path).read()))
    assert names <= {"JETRL_ADMIN_API_KEY", "JETRL_DEEPGEMM_DIR"}, names


def test_config_reference_is_generated_and_current():
    """docs/config.md is what tools/gen_config_docs.py writes from config.py, and every field has a docstring."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_config_docs", os.path.join(REPO, "tools", "gen_config_docs.py"))
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    text = gen.render()
    rows = [r for r in text.splitlines() if r.startswith("| `")]
    assert len(rows) > 90 and all(not r.endswith("|  |") for r in rows), [r for r in rows if r.endswith("|  |")]
    with open(os.path.join(REPO, "docs", "config.md")) as f:
        assert f.read() == text, "docs/config.md is out of date: run python tools/gen_config_docs.py"
