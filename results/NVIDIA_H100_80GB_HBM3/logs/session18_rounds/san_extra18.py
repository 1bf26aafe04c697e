"""compute-sanitizer shapes for the shipped defaults: session 17's (san_extra17.py, which runs session
16's first), then session 18's new paths."""
import os, runpy, sys
sys.path.insert(0, os.getcwd())
import torch
import cuflash
runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "session17_rounds", "san_extra17.py"))
dev, bf = "cuda", torch.bfloat16
torch.manual_seed(2)
# session 18: (shapes of the merged branches' new paths are added here)
print("ok s18", flush=True)
