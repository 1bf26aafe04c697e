"""A small fused LayerNorm / RMSNorm workload for compute-sanitizer (not a test): forward and
backward (dx, the dweight partials and their sum; fused and two-pass) with one-element (n = 17) and
16-byte (n = 1024, 4104) accesses, residual + prenorm, residual_in_fp32, bias, bf16 and fp32, and
more rows than the fused backward's CTAs (300 x 4104), synchronized at the end.

    compute-sanitizer --tool memcheck python tests/layer_norm_sanitize.py
"""
import torch

from cuflash import layer_norm as ln_kernels
from cuflash.ops.layer_norm import layer_norm_fn


def main():
    torch.manual_seed(0)
    for fused in (True, False):
        ln_kernels.FUSED_DW = fused
        run(((torch.bfloat16, 300, 4104),) if fused else ())   # several rows per CTA of the fused backward
        run((dt, rows, n) for dt in (torch.bfloat16, torch.float32) for rows, n in ((5, 17), (3, 1024)))
    torch.cuda.synchronize()
    print("ok")


def run(shapes):
    for dtype, rows, n in shapes:
        for rms in (True, False):
            for residual, prenorm, fp32 in ((False, False, False), (True, True, False), (False, True, True)):
                x = torch.randn(rows, n, device="cuda", dtype=dtype, requires_grad=True)
                w = torch.randn(n, device="cuda", dtype=dtype, requires_grad=True)
                b = None if rms else torch.randn(n, device="cuda", dtype=dtype, requires_grad=True)
                r = torch.randn(rows, n, device="cuda", dtype=dtype, requires_grad=True) if residual else None
                out = layer_norm_fn(x, w, b, residual=r, prenorm=prenorm, residual_in_fp32=fp32, is_rms_norm=rms)
                loss = out[0].float().sum() + out[1].float().square().sum() if prenorm else out.float().sum()
                loss.backward()


if __name__ == "__main__":
    main()
