# (ran at the commit named in logs/session30_dec26/NOTE.md, whose kernel still had kPageAhead / regs_page_ahead; the field is gone since)
# session 30 dec26 round 2 (issue 13, paged 1 x 8k decode on one H200): is the paged gap the table code or the pages'
# physical order? Round 1: regs_page_ahead (ids of the next 32 blocks in one round trip, block 1's loads right after
# block 0's) was 0.1-0.5 us SLOWER than the shipped paged call at both pages. Here the same configs read through a
# table in order ("s" labels, table=sorted: page j of the row at physical page j, the very layout of the contiguous
# cache) against the shuffled table, next to the contiguous call on the paged kernel's order (c_ro0: regs_order 0, no
# kSpec; c_ro1: the interleaved order), and pdl 3 at both pages again (tests/decode_paged_timing.py: CUDA graphs,
# 9 shuffled rounds), twice in two processes.
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
var=(--variant "c_ro0 0 regs_order=0 regs_spec=0" --variant "c_ro1 0 regs_order=1 regs_spec=0")
for pg in 16 256; do
  var+=(--variant "u$pg $pg regs_page_table=0" --variant "u${pg}s $pg regs_page_table=0 table=sorted"
        --variant "a1_$pg $pg regs_page_table=0 regs_page_ahead=1"
        --variant "a1_${pg}s $pg regs_page_table=0 regs_page_ahead=1 table=sorted"
        --variant "o1_${pg}s $pg regs_page_table=0 regs_order=1 table=sorted"
        --variant "pdl3_$pg $pg regs_page_table=0 pdl=3")
done
step pre 20 python3 tests/decode_paged_timing.py --precompile --processes 12 --cells 1x8k "${var[@]}"
step paged 18 python3 tests/decode_paged_timing.py --no-precompile --cells 1x8k --rounds 9 "${var[@]}" --out $OUT/paged1.json
step paged2 18 python3 tests/decode_paged_timing.py --no-precompile --cells 1x8k --rounds 9 "${var[@]}" --out $OUT/paged2.json
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv > $L/smi.txt 2>&1
echo "total $(el) s"
