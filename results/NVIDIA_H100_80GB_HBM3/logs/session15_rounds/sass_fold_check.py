"""SASS of sm90_fwd instantiations that use softmax_fold.cuh's softmax_step_max / _shift."""
import json, sys, os, concurrent.futures as cf
sys.path.insert(0, "/work/main/results/NVIDIA_H100_80GB_HBM3/scripts")
sys.path.insert(0, os.getcwd())
from restamp_check import compile_config
from cuflash.families.sm90_fwd import Sm90FwdConfig
base = Sm90FwdConfig(128, 128, 2, 2, True, True, 128, "bf16", True, dynamic=True, tma_store=True)
cfgs = {
 "cap_fold4_lazy": base.replace(softcap=True, fold_cap=4, lazy_rescale=True),
 "cap_fold3_lazy_full": base.replace(causal=False, BN=144, softcap=True, fold_cap=3, lazy_rescale=True),
 "cap_fold1": base.replace(softcap=True, fold_cap=1),
 "win_lazy": base.replace(window=True, lazy_rescale=True),
 "alibi_alin": base.replace(BN=176, tma_store=False, alibi=True, alibi_lin=True),
 "alibi_alin_lazy_full": base.replace(BN=176, tma_store=False, causal=False, alibi=True, alibi_lin=True, lazy_rescale=True),
 "plain": base.replace(BN=160),
}
from cuflash import registry
fam = registry.get("sm90_fwd")
def one(item):
    k, c = item
    from cuflash.problem import Problem
    import restamp_check as rc
    # compile the config as given (no for_problem)
    import tempfile, subprocess
    from pathlib import Path
    from cuflash.compile import kernel_param_decl, render_source
    expr = fam.kernel_names(c)["main"]
    src = render_source("sm90_fwd") + '\n#line 1 "inst"\n' + f"template __global__ void {expr}({kernel_param_decl(fam, 'main')});\n"
    with tempfile.TemporaryDirectory() as t:
        (Path(t)/"k.cu").write_text(src)
        p = subprocess.run(["nvcc","-cubin","-arch=sm_90a","-std=c++17","-Xptxas","-v","-o",f"{t}/k.cubin",f"{t}/k.cu"],capture_output=True,text=True)
        if p.returncode: return k, {"error": p.stderr[-1500:]}
        f = rc.sass_by_function(Path(t)/"k.cubin")
        return k, {"sass": next(iter(f.values())), "log": [l for l in p.stderr.splitlines() if "Used" in l or "spill" in l]}
for k, c in cfgs.items():
    assert not c.problems(), (k, c.problems())
with cf.ProcessPoolExecutor(2) as ex:
    out = dict(ex.map(one, cfgs.items()))
json.dump(out, open(sys.argv[1], "w"))
print({k: (len(v["sass"]) if "sass" in v else v["error"][:200]) for k, v in out.items()})
