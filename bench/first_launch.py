"""Breakdown of the time to the first fused launch in a fresh process (GPU; warm cache hit)."""
import time
t0 = time.perf_counter()
import torch
torch.zeros(1, device="cuda"); torch.cuda.synchronize()
t1 = time.perf_counter()
import dsagen
from dsagen.ops import indices  # noqa: F401  (timed: the op module's import)
t2 = time.perf_counter()
import dsagen.runtime  # noqa: F401
import cuda.bindings.driver  # noqa: F401
t3 = time.perf_counter()
from dsagen.jit import resolve
from dsagen.spec import LocalToGlobalSpec
e = resolve(LocalToGlobalSpec(arch="sm_90a"))
t4 = time.perf_counter()
from dsagen.jit import get_kernel
k = get_kernel(LocalToGlobalSpec(arch="sm_90a"), 0)
t5 = time.perf_counter()
ids = torch.tensor([[[1, -1, 3]]], dtype=torch.int32, device="cuda")
out = dsagen.local_to_global(ids, 4, impl="fused"); torch.cuda.synchronize()
t6 = time.perf_counter()
print(f"import ops {1e3*(t2-t1):.1f} | import runtime+cuda.bindings {1e3*(t3-t2):.1f} | resolve {1e3*(t4-t3):.1f} | load cubin {1e3*(t5-t4):.1f} | first call+sync {1e3*(t6-t5):.1f} | total {1e3*(t6-t1):.1f} ms")
