"""A small cross-entropy workload for compute-sanitizer (not a test): the forward (whole-row and
split rows with the combine kernel) and the backward (16-byte and one-element stores, in place and
not) for each logits dtype, on odd shapes, synchronized at the end.

    compute-sanitizer --tool memcheck python tests/cross_entropy_sanitize.py
"""
import torch

from cuflash.ops.cross_entropy import cross_entropy_loss


def main():
    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for rows, vocab, strided in ((7, 17, False), (5, 50257, True), (3, 40000, False), (2, 1, False)):
            full = torch.randn(rows, vocab + 3, device="cuda").to(dtype)
            logits = full[:, 1:vocab + 1] if strided else full[:, :vocab].contiguous()
            labels = torch.randint(0, vocab, (rows,), device="cuda")
            labels[0] = -100
            for inplace in (False, True):
                x = logits.detach().clone().requires_grad_(True)
                y = x[:, :] * 1 if inplace else x
                loss, _ = cross_entropy_loss(y, labels, label_smoothing=0.1, lse_square_scale=1e-3,
                                             inplace_backward=inplace)
                loss.mean().backward()
            # the one-element-store backward: dlogits with another 16-byte phase than the logits
            x = full.detach().clone().requires_grad_(True)
            loss, _ = cross_entropy_loss(x[:, 1:vocab + 1], labels)
            loss.sum().backward()
    torch.cuda.synchronize()
    print("ok")


if __name__ == "__main__":
    main()
