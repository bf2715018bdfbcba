# RUN: %python %s | FileCheck %s
#
# iluvatar: tl.atomic_add on int64 becomes two 32-bit atomics (low word, then high word plus
# carry); there is no 64-bit atomic_rmw left in TTIR and no 64-bit atom in PTX. The same source
# compiled for stock cuda keeps its single 64-bit atomic.
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


@triton.jit
def add64(out_ptr, val_ptr, idx_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.atomic_add(out_ptr + tl.load(idx_ptr + offs, mask=mask), tl.load(val_ptr + offs, mask=mask), mask=mask)


SIG = {"out_ptr": "*i64", "val_ptr": "*i64", "idx_ptr": "*i32", "n": "i32", "BLOCK": "constexpr"}
for name, target in (("iluvatar", GPUTarget("iluvatar", 90, 32)), ("cuda", GPUTarget("cuda", 90, 32))):
    k = triton.compile(ASTSource(add64, SIG, {"BLOCK": 64}), target=target)
    print(f"// {name} ttir")
    print(k.asm["ttir"])
    print(f"// {name} ptx")
    print("\n".join(line for line in k.asm["ptx"].splitlines() if " atom." in line))

# CHECK-LABEL: // iluvatar ttir
# CHECK-NOT: tt.atomic_rmw {{.*}}xi64>
# CHECK: tt.atomic_rmw add, acq_rel, gpu, {{.*}} : (tensor<64x!tt.ptr<i32>>, tensor<64xi32>, tensor<64xi1>) -> tensor<64xi32>
# CHECK: arith.cmpi ult
# CHECK: tt.atomic_rmw add, acq_rel, gpu, {{.*}} : (tensor<64x!tt.ptr<i32>>, tensor<64xi32>, tensor<64xi1>) -> tensor<64xi32>
# CHECK-NOT: tt.atomic_rmw
# CHECK-LABEL: // iluvatar ptx
# CHECK-COUNT-2: atom.global.gpu.acq_rel.add.u32
# CHECK-NOT: .u64
# CHECK-LABEL: // cuda ttir
# CHECK: tt.atomic_rmw add, acq_rel, gpu, {{.*}} -> tensor<64xi64>
# CHECK-NOT: tt.atomic_rmw
# CHECK-LABEL: // cuda ptx
# CHECK: atom.global.gpu.acq_rel.add.u64
