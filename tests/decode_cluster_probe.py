"""decode_splitkv_regs' clusters (regs_cluster) on this GPU, not a test: how many clusters of 2..16
CTAs of the regs kernel can be resident at once (cuOccupancyMaxActiveClusters, through cuda.bindings),
for the plain kernel (a run-time cluster dimension) and the kCluster kernels, at 8 warps (one CTA per
SM: its 245-247 registers per thread) and 4 warps; then one 1 x 8k call of each kCluster config
against the plain kernel's output.

    python tests/decode_cluster_probe.py [--json out.json]
"""
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def max_clusters(kernel, grid, threads, smem, cluster):
    from cuda.bindings import driver as cu

    cfg = cu.CUlaunchConfig()
    cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = grid
    cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = threads, 1, 1
    cfg.sharedMemBytes = smem
    attr = cu.CUlaunchAttribute()
    attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = cluster, 1, 1
    cfg.attrs, cfg.numAttrs = [attr], 1
    fn = cu.CUfunction(kernel.kernel.ptr)
    if cluster > 8:
        cu.cuFuncSetAttribute(fn, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)
    err, n = cu.cuOccupancyMaxActiveClusters(fn, cfg)
    return int(n) if int(err) == 0 else f"error {err}"


def main():
    import torch

    from cuflash.compile import get_kernels
    from cuflash.decode import kvcache_with_config
    from cuflash.families.decode_splitkv import DecodeConfig

    out = {"gpu": torch.cuda.get_device_name(0), "sms": torch.cuda.get_device_properties(0).multi_processor_count,
           "occupancy": [], "calls": []}
    base = DecodeConfig(8, 16, 3, 1, 4, 128, "bf16", False, regs=6)
    for warps in (8, 4):
        plain = base.replace(warps=warps, fused_combine=True, light_fence=True)
        k = get_kernels(plain, 0)["main"]
        for cl in (2, 4, 8, 16):
            n = max_clusters(k, (cl, 8, 1), 32 * warps, plain.smem_bytes, cl)
            out["occupancy"].append(dict(kernel=plain.name, cluster=cl, max_active_clusters=n))
            print(f"{plain.name:48s} run-time cluster {cl:2d}: max active clusters {n}", flush=True)
        for cl in (16, 8):
            c = base.replace(warps=warps, regs_cluster=cl)
            try:
                k = get_kernels(c, 0)["main"]
                n = max_clusters(k, (cl, 8, 1), 32 * warps, c.smem_bytes, cl)
            except Exception as exc:  # noqa: BLE001 - a probe: report and go on
                n = f"{type(exc).__name__}: {str(exc)[:200]}"
            out["occupancy"].append(dict(kernel=c.name, cluster=cl, max_active_clusters=n))
            print(f"{c.name:48s} kCluster {cl:2d}: max active clusters {n}", flush=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    kc = torch.randn(1, 8192, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    vc = torch.randn_like(kc)
    q = torch.randn(1, 1, 32, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    lens = torch.full((1,), 8192, dtype=torch.int32, device="cuda")
    ref, ref_lse = kvcache_with_config(base.replace(fused_combine=True, light_fence=True), q, kc, vc, cache_seqlens=lens)
    for cl in (16, 8, 4, 2):
        c = base.replace(regs_cluster=cl)
        try:
            o, lse = kvcache_with_config(c, q, kc, vc, cache_seqlens=lens)
            torch.cuda.synchronize()
            rec = dict(config=c.name, max_diff=(o.float() - ref.float()).abs().max().item(),
                       lse_diff=(lse - ref_lse).abs().max().item())
        except Exception as exc:  # noqa: BLE001
            rec = dict(config=c.name, error=f"{type(exc).__name__}: {str(exc)[:300]}")
        out["calls"].append(rec)
        print(rec, flush=True)
    if "--json" in sys.argv:
        from cuflash.bench.common import write_json

        write_json(Path(sys.argv[sys.argv.index("--json") + 1]), out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
