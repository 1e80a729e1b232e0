"""Sizes the house keeps (issue 43): no module of the package over 600 lines, no function over
60 lines of code (its docstring not counted: a public function's Args/Returns/Raises sections
are documentation, not size)."""

from __future__ import annotations

import ast

from helpers.paths import SRC

MODULE_LINES, FUNCTION_LINES = 600, 60


def _modules():
    return sorted(p for p in SRC.rglob("*.py") if not p.name.endswith(("_pb2.py", "_pb2_grpc.py")))


def _code_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    lines = node.end_lineno - node.lineno + 1
    first = node.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
        if isinstance(first.value.value, str):  # the docstring
            lines -= first.end_lineno - first.lineno + 1
    return lines


def test_no_module_is_over_600_lines():
    long = {
        str(p.relative_to(SRC)): n
        for p in _modules()
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > MODULE_LINES
    }
    assert long == {}, f"split these modules by concept (at most {MODULE_LINES} lines): {long}"


def test_no_function_is_over_60_lines_of_code():
    long = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                if (n := _code_lines(node)) > FUNCTION_LINES:
                    long.append(f"{path.relative_to(SRC)}:{node.lineno} {node.name} ({n})")
    assert long == [], f"split these functions (at most {FUNCTION_LINES} lines): {long}"


def test_the_measure_counts_code_and_leaves_out_the_docstring():
    src = 'def f(x):\n    """Doc.\n\n    More.\n    """\n    y = x\n    return y\n'
    node = ast.parse(src).body[0]
    assert isinstance(node, ast.FunctionDef)
    assert _code_lines(node) == 3  # def, y = x, return y
