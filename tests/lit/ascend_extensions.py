# RUN: %python %s | FileCheck %s
#
# ascend (TTIR, no toolchain needed): tl.math.isnan / isinf are extern calls to the NPU library
# symbols, libdevice maps to the NPU libdevice, tl.exp takes fp16 directly (mainline only fp32 /
# fp64), and the slice extensions are built from tt.gather (get_element ends in tt.unsplat).
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.language.extra import libdevice


@triton.jit
def npu(x_ptr, out_ptr, flags_ptr, m_ptr, s_ptr, e_ptr, off):
    r = tl.arange(0, 16)
    x = tl.load(x_ptr + r)
    tl.store(out_ptr + r, tl.exp(x) + libdevice.tanh(x))
    tl.store(flags_ptr + r, tl.math.isnan(x).to(tl.int32) + libdevice.isinf(x).to(tl.int32))
    c = tl.arange(0, 8)
    m = tl.load(m_ptr + c[:, None] * 8 + c[None, :])
    s = tl.extract_slice(m, (off, 0), (4, 2), (1, 4))
    tl.store(s_ptr + tl.arange(0, 4)[:, None] * 2 + tl.arange(0, 2)[None, :], s)
    tl.store(e_ptr, tl.get_element(m, (off, 3)))


SIG = {
    "x_ptr": "*fp16",
    "out_ptr": "*fp16",
    "flags_ptr": "*i32",
    "m_ptr": "*fp32",
    "s_ptr": "*fp32",
    "e_ptr": "*fp32",
    "off": "i32",
}
k = triton.compile(ASTSource(npu, SIG, {}), target=GPUTarget("ascend", "Ascend910B3", 0))
print(k.asm["ttir"])
print("// npubin bytes:", len(k.asm["npubin"]), "toolchain:", k.metadata.npu_toolchain)

# CHECK-LABEL: tt.func public @npu
# CHECK: math.exp {{.*}} : tensor<16xf16>
# CHECK: tt.extern_elementwise {{.*}} {libname = "", libpath = "", pure = true, symbol = "__hmf_tanhDh"} : (tensor<16xf16>) -> tensor<16xf16>
# CHECK: tt.extern_elementwise {{.*}} {libname = "", libpath = "", pure = true, symbol = "__hmf_isnan"} : (tensor<16xf16>) -> tensor<16xi1>
# CHECK: tt.extern_elementwise {{.*}} {libname = "", libpath = "", pure = true, symbol = "__hmf_isinf"} : (tensor<16xf16>) -> tensor<16xi1>
# CHECK: tt.gather {{.*}} {axis = 0 : i32} : (tensor<8x8xf32>, tensor<4x8xi32>) -> tensor<4x8xf32>
# CHECK: tt.gather {{.*}} {axis = 1 : i32} : (tensor<4x8xf32>, tensor<4x2xi32>) -> tensor<4x2xf32>
# CHECK: tt.unsplat {{.*}} : tensor<1xf32>
# CHECK-NOT: __nv_
# CHECK: // npubin bytes: 0 toolchain: None
