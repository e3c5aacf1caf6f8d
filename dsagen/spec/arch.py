"""Target architectures, as data. Adding one is a row here plus, per kernel family, its `*_<template family>.py.j2` modules."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Arch:
    """A compile target.

    name: the `--gpu-arch` value (arch-specific cubins are not forward compatible).
    capability: the (major, minor) compute capability a device must report to run it.
    template_family: what `{arch}` becomes in a spec's template path (e.g. "sm90": sparse_mla/fwd_sm90.py.j2).
    """

    name: str
    capability: tuple[int, int]
    template_family: str


ARCHES: dict[str, Arch] = {
    a.name: a
    for a in (
        Arch("sm_90a", (9, 0), "sm90"),
        Arch("sm_100a", (10, 0), "sm100"),
    )
}


def get_arch(name: str) -> Arch:
    """The Arch called `name`; SpecError (a ValueError) listing the known ones otherwise."""
    try:
        return ARCHES[name]
    except KeyError:
        from .base import SpecError  # base imports this module

        raise SpecError(f"unknown arch {name!r}; known: {', '.join(sorted(ARCHES))}") from None


def arch_for_capability(capability: tuple[int, int]) -> Arch:
    """The Arch whose cubins run on a device of this compute capability."""
    for a in ARCHES.values():
        if a.capability == tuple(capability):
            return a
    raise ValueError(
        f"no dsagen target for compute capability {capability[0]}.{capability[1]}; "
        f"supported: {', '.join(f'{a.name} ({a.capability[0]}.{a.capability[1]})' for a in ARCHES.values())}")
