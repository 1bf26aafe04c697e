#!/usr/bin/env bash
# session 20, the lead's second 4 x H200 call: the ring with the forward's ring per 4 head groups and the
# backward's per 8 (bwd_groups8+fwd_groups4, "g8f4": the simulated probe put its P = 4 peak at 5.5 X, under one
# GPU on the same shard) against the shipped default (4 backward groups, 1 forward group) on real NCCL rings:
# memory probe, then the bench under --ring-set at P = 4 (256k full: peak memory, torch CP, single GPU; 1M light)
# and P = 2 (256k full), each with the default as the A/B alternative.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD CUPY_CACHE_DIR=/tmp/cupy_cache
T0=$(date +%s); el(){ echo "[$(( $(date +%s) - T0 ))s] $*"; }
echo "rev $(cat REV)"; nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu,power.limit --format=csv
timeout 40 python tests/ring_precompile.py --procs 2 4 --seqlens 1048576 262144 --head-groups 4 8 2>&1 | tail -2; el precompile
timeout 45 python tests/ring_memory_probe.py --procs 4 --whole --variants g4 g8f4 --out "$OUT/memory_g8f4.json" > "$OUT/probe.log" 2>&1; grep "^{" "$OUT/probe.log" | cut -c1-230; grep -i "Traceback\|Error" "$OUT/probe.log" | head -3; el probe
AB="bwd_groups4+fwd_groups1"
timeout 150 python -m cuflash bench --mode ring --ring-procs 4 --ring-seqlens 262144 1048576 --ring-light-from 524288 --ring-budget-s 140 --ring-set bwd_groups8+fwd_groups4 --ring-ab $AB --out "$OUT/res" 2>&1 | tee "$OUT/bench_x4.log" | grep -v "^  timeline\|^  configs\|^  breakdown\|[Ww]arn\|stale\|choose_on_device"; el bench_x4
timeout 70 python -m cuflash bench --mode ring --ring-procs 2 --ring-seqlens 262144 --ring-budget-s 65 --ring-set bwd_groups8+fwd_groups4 --ring-ab $AB --out "$OUT/res" 2>&1 | tee "$OUT/bench_x2.log" | grep -v "^  timeline\|^  configs\|^  breakdown\|[Ww]arn\|stale\|choose_on_device"; el bench_x2
timeout 5 python -m cuflash.bench.ring --table "$OUT"/res/*x4/ring.json "$OUT"/res/*x2/ring.json
cd $OUT && tar czf multi2.tgz * ; el done
