# RUN: %python %s > %t.spec
# RUN: env TRITONSPEC_DISABLE=1 %python %s > %t.stock
# RUN: diff %t.spec %t.stock
# RUN: FileCheck %s < %t.spec
#
# nvidia and amd: kernels that ask for nothing compile to exactly stock Triton's IR, at every
# stage, with tritonspec active (nvidia spec and the empty amd spec) as without it.
import os

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.language.extra import libdevice

import tritonspec.specialization.install

assert tritonspec.specialization.install.is_active() == (os.environ.get("TRITONSPEC_DISABLE") != "1")


@triton.jit
def kernel(x_ptr, idx_ptr, out_ptr, acc_ptr, a_ptr, b_ptr, c_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, libdevice.tanh(x) + tl.exp(x) * tl.sum(x, axis=0), mask=mask)
    tl.atomic_add(acc_ptr + tl.load(idx_ptr + offs, mask=mask), x.to(tl.int64), mask=mask)
    r = tl.arange(0, 16)
    c = tl.dot(tl.load(a_ptr + r[:, None] * 16 + r[None, :]), tl.load(b_ptr + r[:, None] * 16 + r[None, :]))
    tl.store(c_ptr + r[:, None] * 16 + r[None, :], c)


SIG = {
    "x_ptr": "*fp32",
    "idx_ptr": "*i32",
    "out_ptr": "*fp32",
    "acc_ptr": "*i64",
    "a_ptr": "*fp16",
    "b_ptr": "*fp16",
    "c_ptr": "*fp32",
    "n": "i32",
    "BLOCK": "constexpr",
}
for target in (GPUTarget("cuda", 90, 32), GPUTarget("hip", "gfx942", 64)):
    k = triton.compile(ASTSource(kernel, SIG, {"BLOCK": 128}), target=target)
    for stage in ("ttir", "ttgir", "llir", "ptx", "amdgcn"):
        if stage in k.asm:
            print(f"// ===== {target.backend} {stage}")
            print(k.asm[stage])

# CHECK-LABEL: // ===== cuda ttir
# CHECK: symbol = "__nv_tanhf"
# CHECK: tt.atomic_rmw add, {{.*}} -> tensor<128xi64>
# CHECK-LABEL: // ===== cuda ptx
# CHECK: atom.global.gpu.acq_rel.add.u64
# CHECK-LABEL: // ===== hip ttir
# CHECK: symbol = "__ocml_tanh_f32"
# CHECK: tt.atomic_rmw add, {{.*}} -> tensor<128xi64>
# CHECK-LABEL: // ===== hip amdgcn
# CHECK: v_mfma
