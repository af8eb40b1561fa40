"""Write docs/config.md from the typed config's docstrings (``megatron_jetrl/config.py``): every section, every
field with its type, default and docstring. ``--check`` exits 1 when docs/config.md is not what this writes.
Usage: python tools/gen_config_docs.py [--check]
"""
from __future__ import annotations

import argparse
import ast
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE = os.path.join(REPO, "megatron_jetrl", "config.py")
OUT = os.path.join(REPO, "docs", "config.md")


def _fields(cls: ast.ClassDef) -> list[tuple[str, str, str, str]]:
    """(name, type, default, docstring) of each annotated field, the docstring being the string right below it."""
    out, body = [], cls.body
    for i, node in enumerate(body):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            doc = ""
            nxt = body[i + 1] if i + 1 < len(body) else None
            if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
                doc = " ".join(nxt.value.value.split())
            default = ast.unparse(node.value) if node.value is not None else "(required)"
            if default.startswith("field(default_factory="):
                default = default[len("field(default_factory="):-1]
                default = {"list": "[]", "dict": "{}"}.get(default, default)
            out.append((node.target.id, ast.unparse(node.annotation), default, doc))
    return out


def render() -> str:
    tree = ast.parse(open(SOURCE).read())
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    top = classes["JetConfig"]
    lines = ["# Configuration reference", "",
             "Generated from the docstrings of `megatron_jetrl/config.py` by `python tools/gen_config_docs.py` "
             "(a test checks it is current). A run's config is one YAML file (`examples/configs/*.yaml`, "
             "`jetrl train --config FILE` or `--preset NAME`) plus `section.field=value` overrides on the command "
             "line; every value is checked when the config loads, and a bad one stops the run with one line naming "
             "the field and the fix.", ""]
    sections = [(n, t, d) for n, t, _, d in _fields(top) if t in classes]
    lines.append("Sections: " + ", ".join(f"[`{n}`](#{n})" for n, _, _ in sections) + ", and the top-level fields below.")
    lines += ["", "## Top level", "", "| field | type | default | meaning |", "|---|---|---|---|"]
    for name, typ, default, doc in _fields(top):
        if typ not in classes:
            lines.append(f"| `{name}` | `{typ}` | `{default}` | {doc} |")
    for name, typ, doc in sections:
        cls = classes[typ]
        cdoc = " ".join((ast.get_docstring(cls) or doc).split())
        lines += ["", f"## {name}", "", cdoc, "", "| field | type | default | meaning |", "|---|---|---|---|"]
        for fname, ftyp, default, fdoc in _fields(cls):
            lines.append(f"| `{name}.{fname}` | `{ftyp}` | `{default}` | {fdoc.replace('|', '&#124;')} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/config.md is out of date")
    a = ap.parse_args()
    text = render()
    if a.check:
        current = open(OUT).read() if os.path.isfile(OUT) else ""
        if current != text:
            print("docs/config.md is out of date: run python tools/gen_config_docs.py", file=sys.stderr)
            return 1
        return 0
    with open(OUT, "w") as f:
        f.write(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
