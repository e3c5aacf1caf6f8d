"""The launch-expression language of manifests: integer expressions over a kernel's scalar param
names, with + - * // % unary -, integer literals and the functions ceil_div(a, b), min(a, b), max(a, b).
Checked with `ast` and turned into Python source for the generated launcher."""

from __future__ import annotations

import ast

from ..errors import DsagenError

_BINOPS = (ast.Add, ast.Sub, ast.Mult, ast.FloorDiv, ast.Mod)
FUNCTIONS = ("ceil_div", "min", "max")


class LaunchExprError(DsagenError, ValueError):
    """A manifest launch expression outside the language."""


def compile_expr(expr: str | int, names: set[str]) -> str:
    """Python source computing `expr`; LaunchExprError for anything outside the language."""
    if isinstance(expr, int) and not isinstance(expr, bool):
        return repr(expr)
    try:
        tree = ast.parse(str(expr), mode="eval")
    except SyntaxError as e:
        raise LaunchExprError(f"launch expression {expr!r}: {e.msg}") from None

    def walk(n: ast.AST) -> str:
        if isinstance(n, ast.Expression):
            return walk(n.body)
        if isinstance(n, ast.Constant) and isinstance(n.value, int) and not isinstance(n.value, bool):
            return repr(n.value)
        if isinstance(n, ast.Name):
            if n.id not in names:
                raise LaunchExprError(f"launch expression {expr!r}: unknown name {n.id!r} "
                                      f"(scalar params: {sorted(names)})")
            return n.id
        if isinstance(n, ast.BinOp) and isinstance(n.op, _BINOPS):
            op = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.FloorDiv: "//", ast.Mod: "%"}[type(n.op)]
            return f"({walk(n.left)} {op} {walk(n.right)})"
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.USub):
            return f"(-{walk(n.operand)})"
        if (isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in FUNCTIONS
                and len(n.args) == 2 and not n.keywords):
            a, b = walk(n.args[0]), walk(n.args[1])
            if n.func.id == "ceil_div":
                return f"(-((-{a}) // {b}))"
            return f"{n.func.id}({a}, {b})"
        raise LaunchExprError(f"launch expression {expr!r}: {type(n).__name__} is not allowed")

    return walk(tree)
