"""The manifest's `kernel` record: the contract between the generator (which writes it from the
compiled cubin), the cache (which checks it) and the runtime (which builds a kernel's launcher from it).

Its launch expressions are integer expressions over a kernel's scalar param names, with + - * // %
unary -, integer literals and the functions ceil_div(a, b), min(a, b), max(a, b), checked with `ast`
and turned into Python source for the generated launcher. No torch, no CUDA, no compiler here.
"""

from __future__ import annotations

import ast
import hashlib
import json
import keyword
from typing import Any

from .errors import DsagenError

PARAM_KINDS = ("ptr", "i32", "i64", "f32", "tensormap")
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


def is_str_keyed_dict(v: Any) -> bool:
    """Whether `v` is a JSON object: a dict whose keys are all str."""
    return isinstance(v, dict) and all(isinstance(k, str) for k in v)


def _nat(v: Any, lo: int = 0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= lo


def kernel_record_problem(k: dict) -> str | None:
    """What is wrong with a manifest's `kernel` record (None when nothing): the runtime builds its
    launcher from it, so every name must be an identifier and every number a plain int."""
    ident = lambda v: isinstance(v, str) and v.isidentifier() and not keyword.iskeyword(v)  # noqa: E731
    if not ident(k.get("symbol")):
        return "symbol is not an identifier"
    params, launch = k.get("params"), k.get("launch")
    if not isinstance(params, list) or not is_str_keyed_dict(launch):
        return "params is not a list or launch is not an object"
    names = set()
    for i, p in enumerate(params):
        if not is_str_keyed_dict(p) or not ident(p.get("name")) or p["name"] in names or p["name"] == "stream":
            return f"param {i} has no identifier name of its own"
        names.add(p["name"])
        if p.get("kind") not in PARAM_KINDS or not _nat(p.get("offset")) or not _nat(p.get("size"), 1):
            return f"param {p['name']}: kind, offset or size is invalid"
        if p["kind"] == "ptr" and not (ident(p.get("dtype")) and _nat(p.get("align"), 1)):
            return f"param {p['name']}: a ptr needs a dtype name and an alignment"
        if p["kind"] == "tensormap" and not is_str_keyed_dict(p.get("encode")):
            return f"param {p['name']}: a tensormap needs its encode recipe"
    grid, block, cluster = launch.get("grid"), launch.get("block"), launch.get("cluster", [1, 1, 1])
    if not (isinstance(block, list) and len(block) == 3 and all(_nat(b, 1) for b in block)
            and isinstance(cluster, list) and len(cluster) == 3 and all(_nat(c, 1) for c in cluster)
            and _nat(launch.get("smem", 0))):
        return "block, cluster or smem is invalid"
    scalars = {p["name"] for p in params if p["kind"] in ("i32", "i64", "f32")}
    if not (isinstance(grid, list) and len(grid) == 3 and all(isinstance(g, (str, int)) for g in grid)):
        return "grid is not three expressions"
    try:
        for g in grid:
            compile_expr(g, scalars)
    except (LaunchExprError, RecursionError) as e:
        return f"grid: {e}"
    for f in ("regcount", "static_smem"):
        if f in k and not _nat(k[f]):
            return f"{f} is not a non-negative int"
    return None


def kernel_record_sha256(kernel: Any) -> str:
    """The sha256 of a kernel record's canonical JSON (recorded as the manifest's `kernel_sha256`: the
    record is compiler output the key cannot cover, so an edit of it alone is caught)."""
    try:
        return hashlib.sha256(json.dumps(kernel, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                                          allow_nan=False).encode()).hexdigest()
    except (TypeError, ValueError, RecursionError):
        return ""  # matches no recorded hash
