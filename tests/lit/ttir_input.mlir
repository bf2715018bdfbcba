// RUN: %python %S/compile_ir.py %s iluvatar 4 | FileCheck %s --check-prefix=ILU
// RUN: %python %S/compile_ir.py %s cuda 4 | FileCheck %s --check-prefix=CUDA
// RUN: %python %S/compile_ir.py %s ascend | FileCheck %s --check-prefix=NPU
//
// TTIR handed straight to the backends. iluvatar's compiler-side hook (num_stages <= 2) applies;
// its 64-bit atomic emulation does not, since spec semantics act in the Python front end and this
// IR already holds a 64-bit atomic. The ascend pipeline takes TTIR input as well.

module {
  tt.func public @add64(%out: !tt.ptr<i64> {tt.divisibility = 16 : i32}, %val: !tt.ptr<i64> {tt.divisibility = 16 : i32}) {
    %r = tt.make_range {end = 64 : i32, start = 0 : i32} : tensor<64xi32>
    %vp = tt.splat %val : !tt.ptr<i64> -> tensor<64x!tt.ptr<i64>>
    %vq = tt.addptr %vp, %r : tensor<64x!tt.ptr<i64>>, tensor<64xi32>
    %v = tt.load %vq : tensor<64x!tt.ptr<i64>>
    %op = tt.splat %out : !tt.ptr<i64> -> tensor<64x!tt.ptr<i64>>
    %oq = tt.addptr %op, %r : tensor<64x!tt.ptr<i64>>, tensor<64xi32>
    %m = arith.constant dense<true> : tensor<64xi1>
    %old = tt.atomic_rmw add, acq_rel, gpu, %oq, %v, %m : (tensor<64x!tt.ptr<i64>>, tensor<64xi64>, tensor<64xi1>) -> tensor<64xi64>
    tt.return
  }
}

// ILU: // iluvatar num_stages=2
// ILU: tt.atomic_rmw add, acq_rel, gpu, {{.*}} -> tensor<64xi64
// CUDA: // cuda num_stages=4
// NPU: // ascend num_stages=1
// NPU: tt.func public @add64
