"""The TMA form of the tile producer: a tile of an SW128 shared layout loaded as 64-column (128-byte) boxes by one
elected thread (`tma_load_tile`; `tma_load_box`: one box at any column), completing a ring stage's ready mbarrier by
its transaction count (ring.py: a TMA ring's ready[s] expects 1 arrival). `tma_recipe` is the host side: the
`encode` recipe of a `tensormap` PARAMS entry, which the runtime turns into the CUtensorMap of the tensor the op
passes (notes/design.md, "The rendered module").

An SW128 tile (layout.sw128) of R rows x D columns stores its 64-column blocks one after the other, each exactly one
TMA box of R rows x 64 columns, so box kb lands at the tile's first element + kb * R * 64.
"""

import cutlass
import cutlass.cute as cute
from cutlass.experimental import primitives as prims


def tma_recipe(dtype: str, box: list) -> dict:
    """The `encode` recipe of a tensormap param for 128-byte-swizzled boxes of `dtype` (the runtime's tensormap
    dtypes: "bfloat16", "float16", or "uint8" for 8-bit data such as FP8): `box` are the box dims innermost first
    (128 bytes of columns, then rows, then any outer modes of size 1 or more); no interleave, L2 promotion of 128
    bytes, no out-of-bounds fill (the host keeps boxes in bounds)."""
    return {"dtype": dtype, "box": box, "element_strides": [1] * len(box), "interleave": "NONE",
            "swizzle": "128B", "l2_promotion": "L2_128B", "oob_fill": "NONE"}


@cute.jit
def tma_load_tile(tma_ptr, boxes, full, tile_bytes: int) -> None:
    """One elected thread of the calling warp announces `tile_bytes` on the mbarrier `full` (arrive + expect_tx),
    then issues every box: boxes = ((dst, box_elems, n_boxes, coord_tail), ...), where box kb < n_boxes of an entry
    goes to dst + kb * box_elems (dst: the shared tile's first element) from the tensor coordinates
    (kb * 64,) + coord_tail (innermost first): 64-column boxes of a 16-bit type (an 8-bit tile of 128 columns is one
    box, n_boxes = 1). `full` completes when all bytes arrived."""
    with cute.arch.elect_one():
        cute.arch.mbarrier_arrive_and_expect_tx(full, tile_bytes)
        for t in cutlass.range_constexpr(len(boxes)):
            dst, box_elems, n_boxes, coord_tail = boxes[t]
            for kb in cutlass.range_constexpr(n_boxes):
                prims.cp_async_bulk_tensor_shared_cta_global(dst + kb * box_elems, tma_ptr, (kb * 64,) + coord_tail,
                                                             full)


@cute.jit
def tma_load_box(tma_ptr, dst, coords, full, nbytes: int) -> None:
    """One elected thread of the calling warp announces `nbytes` (one box's) on the mbarrier `full` (arrive +
    expect_tx) and loads the box at tensor coordinates `coords` (innermost first) to the shared pointer `dst`: a
    single box of any column offset, where tma_load_tile takes a tile's boxes from column 0 on."""
    with cute.arch.elect_one():
        cute.arch.mbarrier_arrive_and_expect_tx(full, nbytes)
        prims.cp_async_bulk_tensor_shared_cta_global(dst, tma_ptr, coords, full)
