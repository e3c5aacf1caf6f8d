"""The base of every kernel spec: a frozen dataclass of plan-time facts only.

A spec holds exactly what a kernel is specialized on (arch, dtypes, heads, head dim, top-k width,
tile choices, ...). Sequence lengths, batch sizes, pointers and strides never go in a spec: they are
run-time kernel arguments, so a new sequence length never compiles a new kernel.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from typing import Any, ClassVar, TypeVar

from ..errors import DsagenError
from .arch import ARCHES

S = TypeVar("S", bound="KernelSpec")

_SPEC_TYPES: dict[str, type["KernelSpec"]] = {}

#: warps per CTA a one-warp-per-row kernel may be built with (its spec's `warps_per_cta`)
WARPS_PER_CTA = (1, 2, 4, 8, 16, 32)


def warps_per_cta_reasons(warps_per_cta: Any) -> list[str]:
    """[] when `warps_per_cta` is one of WARPS_PER_CTA, else the sentence that says so (for a spec's reasons())."""
    if warps_per_cta in WARPS_PER_CTA:
        return []
    return [f"warps_per_cta={warps_per_cta} must be one of {WARPS_PER_CTA}"]


def register_spec(cls: type[S]) -> type[S]:
    """Class decorator: make `cls` reachable by its `op` name (for manifests, spec files, the CLI)."""
    if not dataclasses.is_dataclass(cls) or not cls.__dataclass_params__.frozen:  # type: ignore[attr-defined]
        raise TypeError(f"{cls.__name__} must be a frozen dataclass")
    if cls.op in _SPEC_TYPES and _SPEC_TYPES[cls.op] is not cls:
        raise ValueError(f"op {cls.op!r} is already registered by {_SPEC_TYPES[cls.op].__name__}")
    _SPEC_TYPES[cls.op] = cls
    return cls


def load_families() -> None:
    """Import the spec module of every kernel family (dsagen/kernels/<family>/spec.py), which registers its
    specs: adding a family is adding its folder."""
    import importlib
    import importlib.util
    import pkgutil

    from .. import kernels

    for info in pkgutil.iter_modules(kernels.__path__):
        name = f"{kernels.__name__}.{info.name}.spec"
        if info.ispkg and importlib.util.find_spec(name) is not None:
            importlib.import_module(name)


def spec_types() -> dict[str, type["KernelSpec"]]:
    """op name -> spec class, for every registered family."""
    load_families()
    return dict(_SPEC_TYPES)


class SpecError(DsagenError, ValueError):
    """A spec that cannot be implemented; the message lists every reason."""


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """Base class. Subclasses are `@register_spec @dataclass(frozen=True)` and set `op` and `template`.

    arch: target name from dsagen.spec.arch.ARCHES (e.g. "sm_90a").
    """

    op: ClassVar[str] = ""
    template: ClassVar[str] = ""  # path under dsagen/kernels/, "{arch}" replaced by the arch's template family

    arch: str

    # ---- validation -------------------------------------------------------------------------------
    def type_reasons(self) -> list[str]:
        """Every field whose value is not of its annotated type, as sentences naming the field; [] when all are.

        The types are exact: 8.0 and true equal 8 and 1 in Python, but they are other canonical JSON and so
        another cache key, and a family's own checks (`x in (1, 2)`) would take them."""
        out = []
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            allowed = _field_types(type(self), f.name)
            if type(v) not in allowed:
                out.append(f"field {f.name} must be {_type_words(allowed)}, got {_shown(v)}")
        return out

    def reasons(self) -> list[str]:
        """Every reason this spec cannot be built, as sentences a person can act on; [] when valid."""
        out = self.type_reasons()
        if isinstance(self.arch, str) and self.arch not in ARCHES:
            out.append(f"arch {self.arch!r} is unknown; choose one of {', '.join(sorted(ARCHES))}")
        return out

    def _all_reasons(self) -> list[str]:
        # mistyped fields alone: a family's reasons() may compute with its fields and fail on a wrong type
        return self.type_reasons() or self.reasons()

    def can_implement(self) -> tuple[bool, str]:
        """(True, "") when the spec is buildable, else (False, all reasons joined)."""
        r = self._all_reasons()
        return (not r, "; ".join(r))

    def check(self: S) -> S:
        """Return self, or raise SpecError naming the spec and every reason it is invalid."""
        r = self._all_reasons()
        if r:
            raise SpecError(f"{self.name()}: " + "; ".join(r))
        return self

    # ---- identity ---------------------------------------------------------------------------------
    def canonical(self) -> dict[str, Any]:
        """JSON-safe dict: {"op": ..., "fields": {name: value}} with fields sorted by name."""
        return {"op": self.op, "fields": {f.name: getattr(self, f.name) for f in sorted(
            dataclasses.fields(self), key=lambda f: f.name)}}

    def canonical_json(self) -> str:
        """The canonical dict as compact, key-sorted JSON (the bytes the cache key hashes)."""
        return json.dumps(self.canonical(), sort_keys=True, separators=(",", ":"))

    def name(self) -> str:
        """A readable name for listings and kernel symbols: op + the non-default fields (not the key)."""
        parts = [self.op]
        for f in dataclasses.fields(self):
            if f.name == "arch":
                continue
            v = getattr(self, f.name)
            if f.default is not dataclasses.MISSING and v == f.default:
                continue
            parts.append(f"{_short(f.name)}{_fmt(v)}")
        parts.append(_fmt(self.arch))  # a mistyped arch still names its spec in check()'s message
        return "_".join(parts)

    def symbol(self) -> str:
        """A C identifier derived from name(), used as the kernel's entry-symbol prefix."""
        return "dsagen_" + re.sub(r"[^A-Za-z0-9_]", "_", self.name())

    @classmethod
    def from_canonical(cls, d: dict[str, Any]) -> "KernelSpec":
        """Rebuild a spec from canonical() output (any registered family): exactly the keys "op" and "fields".

        A key beside those (an "arch" put at the top level, say) is an error: ignoring it would build
        something other than what was asked for. Field types are checked by check()."""
        if not isinstance(d, dict):
            raise SpecError(f"a spec is a JSON object {{\"op\": ..., \"fields\": {{...}}}}, got {_shown(d)}")
        extra_keys = sorted(set(d) - CANONICAL_KEYS, key=str)
        if extra_keys:
            raise SpecError(f"unknown top-level key{'s' if len(extra_keys) > 1 else ''} "
                            f"{', '.join(map(repr, extra_keys))}: a spec has only \"op\" and \"fields\" "
                            f"(arch and every other setting go in \"fields\")")
        types = spec_types()
        if d.get("op") not in types:
            raise SpecError(f"unknown op {d.get('op')!r}; known: {', '.join(sorted(types))}")
        kind = types[d["op"]]
        fields = d.get("fields", {})
        if not isinstance(fields, dict):
            raise SpecError(f"{kind.__name__}: \"fields\" must be a JSON object, got {_shown(fields)}")
        names = {f.name for f in dataclasses.fields(kind)}
        extra = set(fields) - names
        if extra:
            raise SpecError(f"{kind.__name__}: unknown fields {sorted(extra)}")
        return kind(**fields)

    def template_context(self) -> dict[str, Any]:
        """Values the template renders with: every field plus `symbol` and `spec_name`."""
        ctx = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        ctx.update(symbol=self.symbol(), spec_name=self.name(), op=self.op)
        return ctx


#: the most bytes dsagen reads from one spec file or model config (a real one is a few KiB)
SPEC_FILE_MAX_BYTES = 16 << 20


def read_capped(path, where: str, error: type[DsagenError] | None = None) -> bytes:
    """The bytes of file `path`, read no further than SPEC_FILE_MAX_BYTES + 1 bytes: a larger file (or an endless
    one, /dev/zero) is an `error` (SpecError by default) naming `where`, never read whole into memory."""
    cap = SPEC_FILE_MAX_BYTES
    with open(path, "rb") as f:
        data = f.read(cap + 1)
    if len(data) > cap:
        size = f"{cap >> 20} MiB" if cap % (1 << 20) == 0 else f"{cap} bytes"
        raise (error or SpecError)(f"{where}: larger than {size} (the most dsagen reads from one spec or "
                                   f"config file)")
    return data


#: the keys of a spec's canonical dict
CANONICAL_KEYS = frozenset({"op", "fields"})

#: what a spec field may hold: JSON's scalars, by annotation name
_SCALARS = {"bool": bool, "int": int, "float": float, "str": str, "None": type(None)}
_WORDS = {bool: "a bool", int: "an int", float: "a float", str: "a str", type(None): "null"}


@functools.lru_cache(maxsize=None)
def _field_types(kind: type, name: str) -> tuple[type, ...]:
    """The exact types field `name` of spec class `kind` may hold, from its annotation ("int", "str | int",
    "int | None"); an annotation of anything else allows any JSON scalar."""
    annotation = {f.name: f.type for f in dataclasses.fields(kind)}[name]
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
    parts = [p.strip() for p in text.split("|")]
    if parts and all(p in _SCALARS for p in parts):
        return tuple(_SCALARS[p] for p in parts)
    return (bool, int, float, str)


def _type_words(types: tuple[type, ...]) -> str:
    """'an int', 'a str or an int', ... for a message."""
    return " or ".join(_WORDS[t] for t in types)


def _shown(v: Any) -> str:
    """`v` as JSON (as a spec file spells it) where it can be, else its repr; cut to 60 characters."""
    try:
        text = json.dumps(v)
    except (TypeError, ValueError):
        text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


_SHORT = {"feature": "", "smem_bytes": "smem", "num_heads": "h", "head_dim": "d", "topk": "k", "compress_ratio": "r", "dtype": "",
          "rows_per_cta": "rows", "threads": "t"}


def _short(name: str) -> str:
    return _SHORT.get(name, name)


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    return str(v)
