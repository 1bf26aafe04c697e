"""A small fused-MLP workload for compute-sanitizer (not a test): dense_act.cu's forward, backward
with and without the bias gradient (in place and not) and the finish, 16-byte (hidden 1032) and
one-element (hidden 37, and a misaligned view) accesses, rows more than one step of a split and
fewer than the splits, bf16 and fp16, every activation; then FusedMLP forward + backward at each
checkpoint_lvl. Synchronized at the end.

    compute-sanitizer --tool memcheck python tests/dense_act_sanitize.py
"""
import torch

from cuflash import dense_act
from cuflash.ops.fused_dense import fused_mlp_func


def main():
    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16):
        for act in dense_act.ACTIVATIONS:
            for rows, n, offset in ((37, 1032, 0), (3, 37, 0), (9, 64, 1)):
                base = torch.randn(rows * n + offset, device="cuda").to(dtype)
                pre = base[offset:].view(rows, n)
                grad = torch.randn(rows * n + offset, device="cuda").to(dtype)[offset:].view(rows, n)
                dense_act.forward(pre, act)
                for bias_grad in (True, False):
                    for inplace in (False, True):
                        dense_act.backward(grad.clone() if not offset else grad, pre, act, bias_grad, inplace)
    for lvl in (0, 1, 2):
        for act in dense_act.ACTIVATIONS:
            x = torch.randn(21, 40, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            w1 = torch.randn(72, 40, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            b1 = torch.randn(72, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            w2 = torch.randn(24, 72, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            out = fused_mlp_func(x, w1, w2, b1, None, activation=act, checkpoint_lvl=lvl)
            out.float().sum().backward()
    torch.cuda.synchronize()
    print("ok")


if __name__ == "__main__":
    main()
