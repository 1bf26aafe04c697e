# (ran at the commit named in logs/session30_dec26/NOTE.md, whose kernel still had kPageAhead / regs_page_ahead; the field is gone since)
# session 30 dec26 round 3 (issue 13, one H200): why the paged split kernel is ~0.75 us slower than the contiguous one
# when it reads the very same addresses in the same order (round 2: page 256 through a table in order, u256s, 12.54 /
# 12.44 us against the contiguous call on the same kernel and order, c_ro0, 11.80 / 11.71; the shuffled table the same
# as the sorted one; the page-id window, a1, slower still). ncu on one eager call each (3 warm calls first, L2 warm:
# --cache-control none) of c_ro0, u256s, a1_256s and u16 (page 16, shuffled): SOL, warp states, per-instruction stall
# samples (SourceCounters) exported as csv (the SASS with samples), reports deleted.
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
vars=("c_ro0 0 regs_order=0 regs_spec=0" "u256s 256 regs_page_table=0 table=sorted"
      "a1_256s 256 regs_page_table=0 regs_page_ahead=1 table=sorted" "u16 16 regs_page_table=0")
pv=(); for v in "${vars[@]}"; do pv+=(--variant "$v"); done
step pre 20 python3 tests/decode_paged_timing.py --precompile --processes 12 --cells 1x8k --pages 16 256 "${pv[@]}"
mkdir -p $OUT/ncu
ncu --version > $L/ncu_version.txt 2>&1
for v in "${vars[@]}"; do
  lab=${v%% *}
  step ncu_$lab 17 ncu --profile-from-start off --cache-control none -k regex:decode_splitkv_regs \
    --section SpeedOfLight --section WarpStateStats --section SourceCounters --section LaunchStats \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum,lts__t_sector_hit_rate.pct,dram__throughput.avg.pct_of_peak_sustained_elapsed \
    --warp-sampling-interval 0 -f -o /tmp/rep_$lab python3 tests/decode_paged_ncu_calls.py "$v"
  ncu -i /tmp/rep_$lab.ncu-rep --page details --csv > $OUT/ncu/${lab}_details.csv 2>&1
  ncu -i /tmp/rep_$lab.ncu-rep --page source --csv --print-source sass > $OUT/ncu/${lab}_sass.csv 2>&1
  rm -f /tmp/rep_$lab.ncu-rep
done
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv > $L/smi.txt 2>&1
echo "total $(el) s"
