export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/ring6_out}; mkdir -p "$OUT"
git log --oneline -1 2>/dev/null; nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu,power.limit --format=csv
timeout 25 python tests/ring_precompile.py --procs 2 3 4 --seqlens 1048576 524288 262144 2>&1 | tail -2
timeout 40 python -m pytest -q -s -x tests/test_distributed_gpu.py -k every_size 2>&1 | grep -E "FAIL|Error|error|Traceback|grid configs|passed|failed" | head -30
timeout 35 python tests/ring_memory_probe.py --procs 4 --whole --phases --variants low low+dq low+dq+lazy --out "$OUT/ring6_memory.json" > "$OUT/probe.log" 2>&1; grep -v "^  \|^phases" "$OUT/probe.log" | tail -30
timeout 85 python -m cuflash bench --mode ring --ring-procs 4 --ring-seqlens 1048576 --causal no --no-torch-cp --ring-full-max 0 --ring-budget-s 80 --ring-ab fwd_fullgrid1 fwd_fullgrid4 dq_ws --ring-ab-causal no --out "$OUT/ab" 2>&1 | tee "$OUT/ab.log" | grep -v "^  timeline\|^  configs"; grep "timeline\|configs" "$OUT/ab.log" | cut -c1-420
PICK=$(timeout 5 python tests/ring_pick_variant.py "$OUT"/ab/*x4/ring.json --candidates fwd_fullgrid1 fwd_fullgrid4 --min-gain 1.01 2>/dev/null || echo none); PICK=${PICK:-none}; echo "pick: $PICK"
timeout 140 python -m cuflash bench --mode ring --ring-procs 4 --ring-seqlens 1048576 524288 262144 --ring-light-from 262144 --ring-budget-s 122 --ring-set "$PICK" --out "$OUT/final" 2>&1 | tee "$OUT/final_x4.log" | grep -v "^  timeline\|^  configs"
timeout 65 python -m cuflash bench --mode ring --ring-procs 2 --ring-seqlens 262144 524288 --ring-light-from 262144 --ring-full-max 0 --ring-budget-s 55 --out "$OUT/final" 2>&1 | tee "$OUT/final_x2.log" | grep -v "^  timeline\|^  configs"
timeout 5 python -m cuflash.bench.ring --table "$OUT"/final/*x4/ring.json "$OUT"/final/*x2/ring.json
grep -h "timeline\|configs" "$OUT/final_x4.log" | head -24 | cut -c1-330
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv,noheader
