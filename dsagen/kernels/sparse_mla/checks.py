"""Spec checks and small config helpers shared by the MLA attention kernel families (sparse_mla, sparse_mla_bwd,
attn_score_recompute) and the head-padded indexer kernels. A leaf module: it imports no dsagen module, so each
family's spec.py can use it while `dsagen.spec` is still loading the families (a family's spec.py importing another
family's spec.py would meet it half-initialised)."""

from __future__ import annotations

# Register budgets of a 3-warpgroup (384-thread) kernel: a producer warpgroup and two consumers. The CTA launches with
# floor(65536 / 384 / 8) * 8 = 168 registers per thread (64512 in all) and setmaxnreg only moves registers
# between warpgroups inside that pool: the three budgets must sum to at most 3 * 168 = 504, or the
# increasing warpgroups spin in setmaxnreg.inc forever (a hang, not an error).
_REGS_AT_LAUNCH = 65536 // 384 // 8 * 8
_REG_TOTAL = 3 * _REGS_AT_LAUNCH


def mla_shape_reasons(what: str, arch: str, num_heads: int, d_qk: int) -> list[str]:
    """Why an MLA attention kernel (`what`: e.g. "sparse attention forward") cannot be built for these values ([]
    when it can): Hopper only, 64 or 128 heads (fewer are padded by the op), D_qk 512 or 576."""
    out = []
    if arch != "sm_90a":
        out.append(f"arch {arch!r}: the fused {what} exists for sm_90a only (Hopper wgmma); use impl='reference' "
                   f"elsewhere")
    if num_heads not in (64, 128):
        out.append(f"num_heads={num_heads} must be 64 or 128 (pad 16/32 heads to 64 in the op)")
    if d_qk not in (512, 576):
        out.append(f"d_qk={d_qk} must be 512 or 576")
    return out


def kernel_heads(num_heads: int) -> int:
    """The heads of the kernel that serves `num_heads` query heads: 64 for 1..64, 128 for 65..128 (the op's host
    pads the heads in between)."""
    return 64 if num_heads <= 64 else 128


def register_budget_reasons(budgets: dict[str, int]) -> list[str]:
    """Why the setmaxnreg budgets of a 3-warpgroup (384-thread) kernel are wrong ([] when they are right): each a
    multiple of 8 in [24, 256], together at most the launch's 3 x 168 registers (setmaxnreg only moves registers
    between warpgroups; asking for more makes setmaxnreg.inc wait forever)."""
    names, regs = "/".join(budgets), tuple(budgets.values())
    if any(r % 8 or not 24 <= r <= 256 for r in regs):
        return [f"{names}={regs} must each be a multiple of 8 in [24, 256]"]
    if sum(regs) > _REG_TOTAL:
        return [f"{' + '.join(budgets)} = {sum(regs)} exceeds {_REG_TOTAL} (3 warpgroups x {_REGS_AT_LAUNCH} "
                f"registers at launch; setmaxnreg cannot grow the pool)"]
    return []


def grid_ctas(grid, num_sms: int) -> int:
    """A config's n_ctas kernel argument: one CTA per SM for "persistent", else the int (the launch's grid is the
    smaller of it and the work items)."""
    return num_sms if grid == "persistent" else grid


def check_grid(grid, owner: str) -> None:
    """A config's grid: "persistent" or a positive int (ValueError naming `owner` otherwise)."""
    if not (grid == "persistent" or (isinstance(grid, int) and not isinstance(grid, bool) and grid >= 1)):
        raise ValueError(f"{owner}.grid={grid!r} must be 'persistent' or a positive int")


def dtype_name(dtype) -> str:
    """"bfloat16" / "float16" from a dtype name or a torch dtype (without importing torch)."""
    return str(dtype).removeprefix("torch.")
