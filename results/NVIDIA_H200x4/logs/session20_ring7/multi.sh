export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/ring7_out}; mkdir -p "$OUT"; T0=$(date +%s); el(){ echo "[$(( $(date +%s) - T0 ))s] $*"; }
git log --oneline -1 2>/dev/null; python -c "import cuflash.distributed as d; print('BWD_HEAD_GROUPS', d.BWD_HEAD_GROUPS)"; nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu,power.limit --format=csv
timeout 35 python tests/ring_precompile.py --procs 2 4 --seqlens 1048576 524288 262144 --head-groups 2 4 8 2>&1 | tail -2; el precompile
timeout 50 python -m pytest -q -s -x -p no:cacheprovider tests/test_distributed_gpu.py -k every_size 2>&1 | grep -E "FAIL|Error|error|Traceback|grid configs|passed|failed" | head -30; el test
timeout 45 python tests/ring_memory_probe.py --procs 4 --whole --phases --variants low+dq+lazy g4 g8 --out "$OUT/ring7_memory.json" > "$OUT/probe.log" 2>&1; grep "^{" "$OUT/probe.log" | cut -c1-220; grep -i "Traceback\|Error" "$OUT/probe.log" | head -3; el probe
timeout 200 python -m cuflash bench --mode ring --ring-procs 4 --ring-seqlens 1048576 524288 262144 --ring-light-from 262144 --ring-budget-s 180 --ring-ab bwd_groups1 bwd_groups2 --ring-ab-seqlens 1048576 262144 --ring-ab-causal no --out "$OUT/results" 2>&1 | tee "$OUT/bench_x4.log" | grep -v "^  timeline\|^  configs\|^  breakdown\|[Ww]arn\|stale\|choose_on_device"; el bench_x4
timeout 120 python -m cuflash bench --mode ring --ring-procs 2 --ring-seqlens 262144 524288 1048576 --ring-light-from 262144 --ring-budget-s 108 --out "$OUT/results" 2>&1 | tee "$OUT/bench_x2.log" | grep -v "^  timeline\|^  configs\|^  breakdown\|[Ww]arn\|stale\|choose_on_device"; el bench_x2
timeout 5 python -m cuflash.bench.ring --table "$OUT"/results/*x4/ring.json "$OUT"/results/*x2/ring.json
grep -h "breakdown" "$OUT/bench_x4.log" | cut -c1-700
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv,noheader; el done
