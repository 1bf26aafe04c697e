# session 31 sb2 round 3 (issue 12): correctness of the short-call defaults (as the heuristic gives them at this
# commit): compute-sanitizer racecheck / synccheck (quick set) and memcheck (every short-key width, both dtypes,
# causal with more tiles than SMs, the causal wide_epi backward) of tests/short_seq_sanitize.py --s31, and the GPU
# tests of the default route (tests/test_short_seq_gpu.py -k "default or wide_epi").
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
step comp 42 python -c "import sys; sys.path[:0] = ['tests', '.']
import test_short_seq_gpu as t, short_seq_sanitize as s
from cuflash.compile import precompile
todo = list(dict.fromkeys(t.configs(False) + s.s31_configs()))
print(len(todo), 'kernels', [(c.name, e) for c, _, e in precompile(todo) if e][:3])"
bg race 40 compute-sanitizer --tool racecheck --print-limit 20 python tests/short_seq_sanitize.py --s31 --quick
bg sync 40 compute-sanitizer --tool synccheck --print-limit 20 python tests/short_seq_sanitize.py --s31 --quick
bg mem 40 compute-sanitizer --tool memcheck --print-limit 20 python tests/short_seq_sanitize.py --s31
bg gputest 45 python -m pytest -q -p no:cacheprovider tests/test_short_seq_gpu.py -k "default or wide_epi"
wait
echo "total $(el) s" >> "$L/steps.log"
