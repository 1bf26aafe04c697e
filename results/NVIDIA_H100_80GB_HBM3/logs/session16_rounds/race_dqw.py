"""racecheck target: sm90_bwd's d256 dq_writer kernel (off by default: hazards in session 15),
forced with bwd_config=, run with CUFLASH_LINEINFO=1 so the report names source lines."""
import os, sys
sys.path.insert(0, os.getcwd())
import torch
import cuflash
from cuflash.families.sm90_bwd import Sm90BwdConfig
torch.manual_seed(0)
for causal, sq, sk in ((False, 300, 300), (True, 200, 260)):
    cfg = Sm90BwdConfig(64, 64, 2, 2, 256, "bf16", causal, dq_writer=True)
    q, k, v = (torch.randn(1, s, 2, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for s in (sq, sk, sk))
    o = cuflash.flash_attn_func(q, k, v, causal=causal, bwd_config=cfg)
    o.float().square().sum().backward()
    torch.cuda.synchronize()
    print("ok", cfg.name, flush=True)
