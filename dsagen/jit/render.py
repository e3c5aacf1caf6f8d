"""Render a spec's CuTe-DSL kernel module from its jinja2 template (StrictUndefined: a template that
uses a value the spec does not provide fails to render instead of rendering a blank)."""

from __future__ import annotations

import functools
import hashlib
import re
from pathlib import Path


from ..errors import DsagenError
from ..spec import KernelSpec, get_arch

KERNEL_LIB = Path(__file__).resolve().parent.parent / "kernels"
TEMPLATES = KERNEL_LIB  # template names are paths under dsagen/kernels: "<family>/<file>"


class TemplateNotFound(DsagenError, LookupError):
    """No template implements a spec's op for its arch."""


@functools.lru_cache(maxsize=None)
def _environment():
    import jinja2  # only where modules are rendered: a deployment computing identities never needs it

    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )


def template_name(spec: KernelSpec) -> str:
    """The template file (relative to dsagen/kernels/) that renders `spec`: `spec.template` with `{arch}`
    replaced by the arch's template family (e.g. "sparse_mla/fwd_{arch}.py.j2" -> "sparse_mla/fwd_sm90.py.j2");
    a template without `{arch}` is arch-independent. TemplateNotFound when the family has none for the arch."""
    family = get_arch(spec.arch).template_family
    name = spec.template.replace("{arch}", family)
    if not (TEMPLATES / name).is_file():
        raise TemplateNotFound(f"no template {name!r} for op {spec.op!r} on {spec.arch} (dsagen/kernels/{name} "
                               f"does not exist: the family has no {family} kernel yet)")
    return name


_TEMPLATE_REF_RE = re.compile(r"""{%-?\s*(?:extends|include|import|from)\s+["']([^"']+)["']""")


def template_sources(spec: KernelSpec) -> dict[str, str]:
    """{template path: sha256 of its text} for the spec's template and every template it extends,
    includes or imports, followed transitively. With the spec and the helper modules this determines
    the rendered source, without running jinja2 (so a deployment can compute identities cheaply)."""
    out: dict[str, str] = {}
    todo = [template_name(spec)]
    while todo:
        name = todo.pop()
        if name in out:
            continue
        text = (TEMPLATES / name).read_text()
        out[name] = hashlib.sha256(text.encode()).hexdigest()
        todo.extend(_TEMPLATE_REF_RE.findall(text))
    return dict(sorted(out.items()))


def template_helper_modules(spec: KernelSpec) -> dict[str, str]:
    """helper_modules() of the spec's templates' text (the imports a rendered module will contain)."""
    text = "\n".join((TEMPLATES / name).read_text() for name in template_sources(spec))
    return helper_modules(text)


def render(spec: KernelSpec) -> str:
    """The kernel module source for `spec` (validated first)."""
    spec.check()
    return _environment().get_template(template_name(spec)).render(**spec.template_context())


_FROM_RE = re.compile(r"^[ \t]*from[ \t]+(\.*[\w.]*)[ \t]+import[ \t]+(\([^)]*\)|[^\n#]+)", re.M)
_IMPORT_RE = re.compile(r"^[ \t]*import[ \t]+(dsagen\.kernels(?:\.\w+)*)", re.M)


def _module_file(mod: str) -> Path | None:
    """The file of module `mod` (a dsagen.kernels.* name), or None when there is none."""
    rel = mod.split(".")[2:]
    for path in (KERNEL_LIB.joinpath(*rel).with_suffix(".py") if rel else None, KERNEL_LIB.joinpath(*rel, "__init__.py")):
        if path is not None and path.is_file():
            return path
    return None


def _imported_kernel_modules(text: str, package: str | None) -> list[str]:
    """The dsagen.kernels.* modules `text` imports: `import X`, `from X import names` (X, and each name
    that is a submodule of X), and, inside a package, relative imports."""
    found = [m.group(1) for m in _IMPORT_RE.finditer(text)]
    for m in _FROM_RE.finditer(text):
        base, names = m.group(1), m.group(2).strip("() \n")
        if base.startswith("."):
            if package is None:
                continue
            up = len(base) - len(base.lstrip("."))
            parts = package.split(".")[:len(package.split(".")) - (up - 1)] if up > 1 else package.split(".")
            base = ".".join(parts + ([base.lstrip(".")] if base.lstrip(".") else []))
        if not (base == "dsagen.kernels" or base.startswith("dsagen.kernels.")):
            continue
        found.append(base)
        for name in names.replace("\n", " ").split(","):
            name = name.strip().split(" as ")[0].strip()
            if name.isidentifier() and _module_file(f"{base}.{name}") is not None:
                found.append(f"{base}.{name}")
    return found


def helper_modules(source: str) -> dict[str, str]:
    """{module name: sha256 of its file} for every hand-written module under dsagen/kernels/ (kernel
    modules and device helpers) that `source` imports, followed transitively (absolute imports, `from
    package import submodule`, and relative imports inside those modules). These hashes are part of the
    cache key."""
    out: dict[str, str] = {}
    todo = _imported_kernel_modules(source, None)
    while todo:
        mod = todo.pop()
        if mod in out or mod == "dsagen.kernels":
            continue
        path = _module_file(mod)
        if path is None:
            continue
        text = path.read_text()
        out[mod] = hashlib.sha256(text.encode()).hexdigest()
        package = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
        todo.extend(_imported_kernel_modules(text, package))
    return dict(sorted(out.items()))
