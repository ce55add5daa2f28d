"""The cross-entropy output-Hessian product with a row's statistics shared inside a thread-block
cluster (issue 27, the fused kernel on the H200): an experiment, outside the library.

    python -m benchmarks.ce_cluster [--shapes "B64 T256 V50304 bf16,..."] > rows.jsonl

The library's kernel (NOTE [split rows] in ``hessian_eigenthings/kernels/cross_entropy_triton.py``)
splits a long row over programs that meet through global memory: a ticket, a row counter released
and spun on, the partial statistics read back from L2. On Hopper the programs of one row can
instead be one cluster, which the hardware schedules together (no ticket, no deadlock to guard),
whose CTAs exchange ``(max, sum exp, sum exp * u)`` through distributed shared memory behind a
cluster barrier. Two builds of that idea are timed against the library's default:

- ``cuda``: CUDA C++ (compiled here with ``torch.utils.cpp_extension.load_inline``, sm_90), C
  CTAs a row, each holding ``ceil(V / C)`` columns in registers from their one read to their one
  write; ``cuda_persistent``: a grid of as many clusters as fit, each looping over rows with
  double-buffered statistics (one cluster barrier a row); ``cuda_prefetch``: persistent, and each
  CTA issues its next row's loads (kept packed in registers) before its current row's barrier;
- ``triton_ctas``: one Triton program a row, whole row in one block, launched with
  ``num_ctas=C`` (Triton spreads the program's tensors over a cluster of C CTAs; whether its
  reductions then cross CTAs depends on the Triton version: the row shows what it does).

Each row: ms (``triton.testing.do_bench`` median), × the bandwidth floor (one read of logits and
direction, one write of the output, at the measured copy bandwidth), relative error against an
fp32 reference.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch
import triton
import triton.language as tl

CUDA_SRC = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

namespace {

__device__ __forceinline__ void store8(__nv_bfloat16* p, const float* f) {
  uint4 v;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
  __stcs(reinterpret_cast<uint4*>(p), v);
}
__device__ __forceinline__ void store8(float* p, const float* f) {
  __stcs(reinterpret_cast<float4*>(p), make_float4(f[0], f[1], f[2], f[3]));
  __stcs(reinterpret_cast<float4*>(p) + 1, make_float4(f[4], f[5], f[6], f[7]));
}

template <typename T> struct Raw;
template <> struct Raw<__nv_bfloat16> { uint4 v; };
template <> struct Raw<float> { float4 a, b; };
__device__ __forceinline__ void ld_raw(const __nv_bfloat16* p, Raw<__nv_bfloat16>& r) {
  r.v = __ldcs(reinterpret_cast<const uint4*>(p));
}
__device__ __forceinline__ void ld_raw(const float* p, Raw<float>& r) {
  r.a = __ldcs(reinterpret_cast<const float4*>(p));
  r.b = __ldcs(reinterpret_cast<const float4*>(p) + 1);
}
__device__ __forceinline__ void unpack(const Raw<__nv_bfloat16>& r, float* f) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&r.v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 x = __bfloat1622float2(h[i]);
    f[2 * i] = x.x;
    f[2 * i + 1] = x.y;
  }
}
__device__ __forceinline__ void unpack(const Raw<float>& r, float* f) {
  f[0] = r.a.x; f[1] = r.a.y; f[2] = r.a.z; f[3] = r.a.w;
  f[4] = r.b.x; f[5] = r.b.y; f[6] = r.b.z; f[7] = r.b.w;
}
// eight values of a row as floats (streamed: read once)
template <typename T>
__device__ __forceinline__ void load8(const T* p, float* f) {
  Raw<T> r;
  ld_raw(p, r);
  unpack(r, f);
}

constexpr float kMin = -3.0e38f;

struct Stat { float m, s, t; };

__device__ __forceinline__ Stat merge(Stat a, Stat b) {
  float M = fmaxf(a.m, b.m);
  float wa = __expf(a.m - M), wb = __expf(b.m - M);
  return {M, a.s * wa + b.s * wb, a.t * wa + b.t * wb};
}

__device__ __forceinline__ Stat warp_merge(Stat x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    Stat y{__shfl_xor_sync(0xffffffffu, x.m, o), __shfl_xor_sync(0xffffffffu, x.s, o),
           __shfl_xor_sync(0xffffffffu, x.t, o)};
    x = merge(x, y);
  }
  return x;
}

// a special register: this CTA's rank in its cluster, the cluster's index, the clusters
#define SREG(name, reg)                                      \
  __device__ __forceinline__ unsigned name() {               \
    unsigned r;                                              \
    asm volatile("mov.u32 %0, %%" reg ";" : "=r"(r));        \
    return r;                                                \
  }
SREG(cluster_rank, "cluster_ctarank")
SREG(cluster_id_x, "clusterid.x")
SREG(num_clusters_x, "nclusterid.x")
#undef SREG
__device__ __forceinline__ void cluster_arrive() {
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() {
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// a float of CTA `rank`'s shared memory at the address of `p` in ours
__device__ __forceinline__ float ld_peer(const float* p, unsigned rank) {
  unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p)), r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(rank));
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(r) : "memory");
  return v;
}

// One cluster of C CTAs per row (PERSISTENT: each cluster loops over rows r, r + clusters, ...,
// and with PREFETCH loads its next row while the current one meets and is written).
// CTA `rank` holds columns [rank * chunk, min(V, (rank + 1) * chunk)), ITEMS groups of 8 a thread.
template <typename T, int THREADS, int ITEMS, bool PERSISTENT, bool PREFETCH>
__global__ void __launch_bounds__(THREADS) ce_cluster(
    const T* __restrict__ z, const T* __restrict__ u, T* __restrict__ out, long rows, int V,
    int chunk, int C, float inv_n) {
  __shared__ Stat warp_stats[THREADS / 32];
  __shared__ float cta_stat[2][4];  // double-buffered (m, s, t) of this CTA
  __shared__ float row_stat[4];
  const unsigned rank = cluster_rank();
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int lo = rank * chunk;
  const int len = max(0, min(V, lo + chunk) - lo);
  long row = PERSISTENT ? cluster_id_x() : blockIdx.x / C;
  const long step = PERSISTENT ? num_clusters_x() : rows;
  int buf = 0;
  Raw<T> rz[ITEMS], ru[ITEMS];
  if (PREFETCH && row < rows) {
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int c = (tid + i * THREADS) * 8;
      if (c < len) {
        ld_raw(z + row * (long)V + lo + c, rz[i]);
        ld_raw(u + row * (long)V + lo + c, ru[i]);
      }
    }
  }
  for (; row < rows; row += step, buf ^= 1) {
    const T* zr = z + row * (long)V + lo;
    const T* ur = u + row * (long)V + lo;
    float e[ITEMS][8], uu[ITEMS][8];
    Stat mine{kMin, 0.f, 0.f};
    if (PREFETCH) {
      const long next = row + step;
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        const int c = (tid + i * THREADS) * 8;
        if (c < len) {
          unpack(rz[i], e[i]);
          unpack(ru[i], uu[i]);
          if (next < rows) {
            ld_raw(z + next * (long)V + lo + c, rz[i]);
            ld_raw(u + next * (long)V + lo + c, ru[i]);
          }
#pragma unroll
          for (int j = 0; j < 8; ++j) mine.m = fmaxf(mine.m, e[i][j]);
        }
      }
    } else {
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        const int c = (tid + i * THREADS) * 8;
        if (c < len) {
          load8(zr + c, e[i]);
          load8(ur + c, uu[i]);
#pragma unroll
          for (int j = 0; j < 8; ++j) mine.m = fmaxf(mine.m, e[i][j]);
        }
      }
    }
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int c = (tid + i * THREADS) * 8;
      if (c < len) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          e[i][j] = __expf(e[i][j] - mine.m);
          mine.s += e[i][j];
          mine.t += e[i][j] * uu[i][j];
        }
      }
    }
    Stat w = warp_merge(mine);
    if (lane == 0) warp_stats[warp] = w;
    __syncthreads();
    if (warp == 0) {
      Stat x = lane < THREADS / 32 ? warp_stats[lane] : Stat{kMin, 0.f, 0.f};
      x = warp_merge(x);
      if (lane == 0) {
        cta_stat[buf][0] = x.m; cta_stat[buf][1] = x.s; cta_stat[buf][2] = x.t;
      }
    }
    cluster_arrive();  // this CTA's statistics are written (release)
    cluster_wait();    // every CTA's are (acquire)
    if (warp == 0) {
      Stat x{kMin, 0.f, 0.f};
      if (lane < C)
        x = Stat{ld_peer(&cta_stat[buf][0], lane), ld_peer(&cta_stat[buf][1], lane),
                 ld_peer(&cta_stat[buf][2], lane)};
      x = warp_merge(x);
      if (lane == 0) { row_stat[0] = x.m; row_stat[1] = x.s; row_stat[2] = x.t; }
    }
    __syncthreads();
    const float M = row_stat[0], S = row_stat[1], Tt = row_stat[2];
    const float a = inv_n / S * __expf(mine.m - M), b = Tt / S;
    T* orow = out + row * (long)V + lo;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int c = (tid + i * THREADS) * 8;
      if (c < len) {
        float o[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) o[j] = e[i][j] * a * (uu[i][j] - b);
        store8(orow + c, o);
      }
    }
    // row_stat is rewritten next row only after every thread read it
    __syncthreads();
  }
  // no CTA leaves while a peer may still read its shared memory
  cluster_arrive();
  cluster_wait();
}

// a launch of `clusters` clusters of C CTAs of `threads` threads (non-portable sizes allowed)
struct ClusterLaunch {
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[1];
  template <typename K>
  ClusterLaunch(K kern, int C, long clusters, int threads) {
    if (C > 8)
      C10_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    cfg.gridDim = dim3(static_cast<unsigned>(clusters * C), 1, 1);
    cfg.blockDim = dim3(threads, 1, 1);
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = C;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
  }
  ClusterLaunch(const ClusterLaunch&) = delete;  // cfg points into attr
};

template <typename T, int THREADS, int ITEMS, int MODE>
void launch_t(const torch::Tensor& z, const torch::Tensor& u, torch::Tensor& out, int C,
              double inv_n, long grid_clusters) {
  const long rows = z.size(0);
  const int V = z.size(1);
  int chunk = (V + C - 1) / C;
  chunk = (chunk + 7) / 8 * 8;
  TORCH_CHECK(chunk <= THREADS * ITEMS * 8, "chunk ", chunk, " exceeds ", THREADS * ITEMS * 8);
  auto kern = ce_cluster<T, THREADS, ITEMS, MODE >= 1, MODE == 2>;
  long clusters = MODE >= 1 ? std::min(rows, grid_clusters) : rows;
  ClusterLaunch launch(kern, C, clusters, THREADS);
  launch.cfg.stream = at::cuda::getCurrentCUDAStream();
  cudaLaunchConfig_t& cfg = launch.cfg;
  const T* zp = reinterpret_cast<const T*>(z.data_ptr());
  const T* up = reinterpret_cast<const T*>(u.data_ptr());
  T* op = reinterpret_cast<T*>(out.data_ptr());
  C10_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kern, zp, up, op, rows, V, chunk, C, (float)inv_n));
}

template <typename T, int P>
void dispatch_shape(const torch::Tensor& z, const torch::Tensor& u, torch::Tensor& out, int C,
                    int threads, int items, double inv_n, long grid_clusters) {
#define CASE(TH, IT) \
  if (threads == TH && items == IT) return launch_t<T, TH, IT, P>(z, u, out, C, inv_n, grid_clusters);
  CASE(128, 4) CASE(128, 8) CASE(256, 2) CASE(256, 3) CASE(256, 4) CASE(256, 8)
  CASE(512, 2) CASE(512, 4) CASE(1024, 2)
#undef CASE
  TORCH_CHECK(false, "no instance for threads ", threads, " items ", items);
}

// how many clusters of C CTAs of this instance fit on the device at once
template <typename T, int THREADS, int ITEMS, bool PREFETCH>
int fit(int C) {
  auto kern = ce_cluster<T, THREADS, ITEMS, true, PREFETCH>;
  ClusterLaunch launch(kern, C, 1024, THREADS);
  int n = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&n, kern, &launch.cfg));
  return n;
}

}  // namespace

int max_clusters(torch::Tensor z, int C, int threads, int items, int mode) {
#define FIT(TY, TH, IT) \
  if (threads == TH && items == IT) return mode == 2 ? fit<TY, TH, IT, true>(C) : fit<TY, TH, IT, false>(C);
  if (z.scalar_type() == at::kBFloat16) {
    FIT(__nv_bfloat16, 128, 4) FIT(__nv_bfloat16, 128, 8) FIT(__nv_bfloat16, 256, 2)
    FIT(__nv_bfloat16, 256, 3) FIT(__nv_bfloat16, 256, 4) FIT(__nv_bfloat16, 256, 8)
    FIT(__nv_bfloat16, 512, 2) FIT(__nv_bfloat16, 512, 4) FIT(__nv_bfloat16, 1024, 2)
  } else {
    FIT(float, 128, 4) FIT(float, 128, 8) FIT(float, 256, 2) FIT(float, 256, 3)
    FIT(float, 256, 4) FIT(float, 256, 8) FIT(float, 512, 2) FIT(float, 512, 4)
    FIT(float, 1024, 2)
  }
#undef FIT
  TORCH_CHECK(false, "no instance");
}

void ce_cluster_hvp(torch::Tensor z, torch::Tensor u, torch::Tensor out, int C, int threads,
                    int items, double inv_n, int mode, long grid_clusters) {
  TORCH_CHECK(z.is_contiguous() && u.is_contiguous() && out.is_contiguous(), "contiguous rows");
  TORCH_CHECK(z.dim() == 2 && z.size(1) % 8 == 0, "(rows, V) with V a multiple of 8");
  if (z.scalar_type() == at::kBFloat16) {
    if (mode == 2) dispatch_shape<__nv_bfloat16, 2>(z, u, out, C, threads, items, inv_n, grid_clusters);
    else if (mode == 1) dispatch_shape<__nv_bfloat16, 1>(z, u, out, C, threads, items, inv_n, grid_clusters);
    else dispatch_shape<__nv_bfloat16, 0>(z, u, out, C, threads, items, inv_n, grid_clusters);
  } else {
    TORCH_CHECK(z.scalar_type() == at::kFloat, "bf16 or fp32");
    if (mode == 2) dispatch_shape<float, 2>(z, u, out, C, threads, items, inv_n, grid_clusters);
    else if (mode == 1) dispatch_shape<float, 1>(z, u, out, C, threads, items, inv_n, grid_clusters);
    else dispatch_shape<float, 0>(z, u, out, C, threads, items, inv_n, grid_clusters);
  }
}
"""

CPP_SRC = r"""
#include <torch/extension.h>
void ce_cluster_hvp(torch::Tensor z, torch::Tensor u, torch::Tensor out, int C, int threads,
                    int items, double inv_n, int mode, long grid_clusters);
int max_clusters(torch::Tensor z, int C, int threads, int items, int mode);
"""


@triton.jit
def _row_kernel(z_ptr, u_ptr, out_ptr, V, inv_n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    cin = c < V
    z = tl.load(z_ptr + row * V + c, mask=cin, other=-float("inf")).to(tl.float32)
    u = tl.load(u_ptr + row * V + c, mask=cin, other=0.0).to(tl.float32)
    m = tl.max(z, axis=0)
    e = tl.exp(z - m)
    s = tl.sum(e, axis=0)
    t = tl.sum(e * u, axis=0)
    o = e * (inv_n / s) * (u - t / s)
    tl.store(out_ptr + row * V + c, o.to(out_ptr.dtype.element_ty), mask=cin)


def reference(z: torch.Tensor, u: torch.Tensor, inv_n: float) -> torch.Tensor:
    p = torch.softmax(z.float(), dim=-1)
    uf = u.float()
    return p * (uf - (p * uf).sum(-1, keepdim=True)) * inv_n


def run_shape(spec: str, ext: Any, bw: float, args: argparse.Namespace, emit: Any) -> None:
    """Every variant on one shape ("B64 T256 V50304 bf16"): rows through ``emit``."""
    from benchmarks.bench_kernels import bench, rel_err
    from hessian_eigenthings.kernels.cross_entropy_triton import cross_entropy_hvp_triton

    b, t, v, dt = spec.split()
    B, T, V = int(b[1:]), int(t[1:]), int(v[1:])
    dtype = torch.bfloat16 if dt == "bf16" else torch.float32
    rows = B * T
    g = torch.Generator(device="cuda").manual_seed(0)
    z = (torch.randn(rows, V, device="cuda", generator=g) * 4).to(dtype)
    u = torch.randn(rows, V, device="cuda", generator=g).to(dtype)
    out = torch.empty_like(z)
    inv_n = 1.0 / rows
    ref = reference(z, u, inv_n)
    floor_ms = 3 * z.numel() * z.element_size() / bw * 1e3

    def row(name: str, fn: Any, **extra: Any) -> None:
        out.fill_(float("nan"))
        try:
            fn()
            torch.cuda.synchronize()
            err = rel_err(out, ref)
            nan = bool(torch.isnan(out).any())
            ms = bench(fn)
        except Exception as exc:
            emit({"cell": "variant", "shape": spec, "variant": name, **extra,
                  "error": f"{type(exc).__name__}: {str(exc)[:400]}"})
            return
        emit({"cell": "variant", "shape": spec, "variant": name, **extra, "ms": ms,
              "x_floor": ms / floor_ms, "rel_err": err, "nan": nan})

    row("library_default", lambda: cross_entropy_hvp_triton(z, u, None, float(rows), out=out))
    if ext is not None:
        for C in (4, 8, 16):
            chunk = -(-V // C)
            for threads in (128, 256, 512, 1024):
                items = -(-chunk // (threads * 8))
                if items not in (2, 3, 4, 8) or (threads, items) not in {
                    (128, 4), (128, 8), (256, 2), (256, 3), (256, 4), (256, 8), (512, 2), (512, 4), (1024, 2)
                }:
                    continue
                for mode in (int(m) for m in args.modes.split(",")):
                    try:
                        fit = int(ext.max_clusters(z, C, threads, items, mode))
                    except Exception as exc:
                        emit({"cell": "variant", "shape": spec, "variant": "cuda", "C": C, "threads": threads,
                              "items": items, "error": f"fit: {str(exc)[:300]}"})
                        continue
                    row(("cuda", "cuda_persistent", "cuda_prefetch")[mode],
                        lambda C=C, th=threads, it=items, p=mode, f=fit: ext.ce_cluster_hvp(
                            z, u, out, C, th, it, inv_n, p, f),
                        C=C, threads=threads, items=items, clusters_fit=fit)
    block = triton.next_power_of_2(V)
    for ctas in (int(c) for c in args.triton_ctas.split(",") if c):
        for warps in (8, 16, 32):
            if block // (ctas * warps * 32) > 128:
                continue  # over 128 columns a thread and tensor: spills
            row("triton_ctas", lambda c=ctas, w=warps: _row_kernel[(rows,)](
                z, u, out, V, inv_n, BLOCK=block, num_warps=w, num_ctas=c), ctas=ctas, warps=warps)


def main() -> None:
    from benchmarks.bench_kernels import copy_bandwidth

    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="B64 T256 V50304 bf16,B64 T256 V50304 fp32,B8 T1024 V128256 bf16")
    ap.add_argument("--triton-ctas", default="1,2,4,8")
    ap.add_argument("--skip-cuda", action="store_true")
    ap.add_argument("--modes", default="0,1,2", help="0: a cluster a row; 1: persistent; 2: persistent, "
                    "the next row loaded while the current one meets")
    args = ap.parse_args()

    def emit(row: dict[str, Any]) -> None:
        print(json.dumps(row), flush=True)

    ext = None
    if not args.skip_cuda:
        from torch.utils.cpp_extension import load_inline

        t0 = time.perf_counter()
        try:
            ext = load_inline(
                name="ce_cluster_ext", cpp_sources=CPP_SRC, cuda_sources=CUDA_SRC,
                functions=["ce_cluster_hvp", "max_clusters"],
                extra_cuda_cflags=["-O3", "-gencode=arch=compute_90,code=sm_90", "--use_fast_math",
                                   "-Xptxas", "-v"],
                verbose=False,
            )
            emit({"cell": "build", "s": time.perf_counter() - t0})
        except Exception as exc:  # the row says why; the Triton variants still run
            emit({"cell": "build", "error": f"{type(exc).__name__}: {str(exc)[-3000:]}"})

    bw = copy_bandwidth(2 << 30)
    emit({"cell": "env", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
          "triton": triton.__version__, "copy_bw_tbs": bw / 1e12})
    for spec in args.shapes.split(","):
        run_shape(spec, ext, bw, args, emit)
        torch.cuda.empty_cache()

if __name__ == "__main__":
    main()
