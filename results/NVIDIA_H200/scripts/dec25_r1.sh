# session 29 dec25 round 1 (issue 13, paged 1 x 8k decode on one H200): the existing DecodeConfig knobs of the paged
# batch-1 call (REGS_BATCH1_PAGED_RULES: 8 warps x 16 keys, x16 splits, plain loads, regs_order 0, pdl 1, early_merge,
# separate combine; page 16 with the staged table) against the shipped rule at pages 16 and 256, the contiguous call
# and SDPA flash / cuDNN in the same process (tests/decode_paged_timing.py: CUDA graphs, 9 shuffled rounds), twice in
# two processes. "u16": page 16 without the staged table (as the H200 table's paged rule runs it); "rule16"/"rule256":
# the heuristic's config with no device rule (the base of the other variants).
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
var=()
for pg in 16 256; do
  var+=(--variant "x8_$pg $pg splits=8" --variant "x24_$pg $pg splits=24" --variant "x32_$pg $pg splits=32"
        --variant "w4_$pg $pg warps=4" --variant "w16_$pg $pg warps=16"
        --variant "h5_$pg $pg regs=5" --variant "pdl3_$pg $pg pdl=3"
        --variant "fc_$pg $pg fused_combine=1 light_fence=1 early_merge=0" --variant "ro1_$pg $pg regs_order=1")
done
var+=(--variant "u16 16 regs_page_table=0" --variant "h2_16 16 regs=2" --variant "pdl0_16 16 pdl=0"
      --variant "rpf3_16 16 regs_prefetch=1 regs_prefetch_blocks=3"
      --variant "rpf3_256 256 regs_page_table=1 regs_prefetch=1 regs_prefetch_blocks=3"
      --variant "u16x24 16 regs_page_table=0 splits=24"
      --variant "rule16 16" --variant "rule256 256")   # the heuristic's config without device rules (page16 / page256
      # rows are flash_attn_with_kvcache, which applies the H200 table's paged rule: no staged table)
step pre 25 python3 tests/decode_paged_timing.py --precompile --cells 1x8k "${var[@]}"
step paged 20 python3 tests/decode_paged_timing.py --no-precompile --cells 1x8k --rounds 9 "${var[@]}" --out $OUT/paged1.json
step paged2 20 python3 tests/decode_paged_timing.py --no-precompile --cells 1x8k --rounds 9 "${var[@]}" --out $OUT/paged2.json
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv > $L/smi.txt 2>&1
echo "total $(el) s"
