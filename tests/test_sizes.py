"""Size limits that keep the code readable in one sitting (issue 28): no module over 450 lines, no class
over 300, no function over 80 in the core and the plugin packages. Split by responsibility, not by
line count, when one is exceeded."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("fedsim", "strategies", "clients", "attacks", "channels")
MAX_MODULE, MAX_CLASS, MAX_FUNCTION = 450, 300, 80
# over the limits when they landed on main beside issue 28's split (2026-11-26): to be split next; the
# test fails when one of them is back under its limit, so that it leaves this list
KNOWN: set[str] = set()


def oversized(path: str, source: str) -> list[str]:
    """What in ``source`` exceeds the limits, as ``path[:name]: kind N lines > limit``."""
    out = []
    n = len(source.splitlines())
    if n > MAX_MODULE:
        out.append(f"{path}: module {n} lines > {MAX_MODULE}")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            kind, limit = "class", MAX_CLASS
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            kind, limit = "function", MAX_FUNCTION
        else:
            continue
        n = node.end_lineno - node.lineno + 1
        if n > limit:
            out.append(f"{path}:{node.name}: {kind} {n} lines > {limit}")
    return out


def test_no_module_class_or_function_is_over_its_limit():
    files = [p for pkg in PACKAGES if (ROOT / pkg).is_dir() for p in sorted((ROOT / pkg).rglob("*.py"))]
    assert len(files) > 40  # the scan sees the tree at all
    found = [v for p in files for v in oversized(str(p.relative_to(ROOT)), p.read_text())]
    assert [v for v in found if v.split(": ")[0] not in KNOWN] == []
    assert sorted(v.split(": ")[0] for v in found if v.split(": ")[0] in KNOWN) == sorted(KNOWN)


def test_the_size_check_catches_each_kind():
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION))  # a function of MAX_FUNCTION + 1 lines
    assert oversized("m.py", f"def f():\n{body}") == [f"m.py:f: function {MAX_FUNCTION + 1} lines > {MAX_FUNCTION}"]
    assert oversized("m.py", "def f():\n" + body[: -len(f"    x{MAX_FUNCTION - 1} = {MAX_FUNCTION - 1}\n")]) == []
    methods = "".join(f"    def m{i}(self):\n        return {i}\n\n" for i in range(MAX_CLASS // 3 + 1))
    assert [v.split(":")[1] for v in oversized("m.py", f"class C:\n{methods}")] == ["C"]
    assert oversized("m.py", "x = 1\n" * (MAX_MODULE + 1)) == [f"m.py: module {MAX_MODULE + 1} lines > {MAX_MODULE}"]
