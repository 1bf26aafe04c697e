# session 31 lead: the paged decode sanitize scripts after sharing their call loop (run_calls), under memcheck.
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
step pre 40 python3 tests/decode_precompile.py --only page_shift_tests,page_table2_tests --processes 12
bg m_shift 40 compute-sanitizer --tool memcheck --error-exitcode 9 python3 tests/decode_page_shift_sanitize.py --quick
bg m_pt2 40 compute-sanitizer --tool memcheck --error-exitcode 9 python3 tests/decode_page_table2_sanitize.py
wait
echo "all done $(el)s" >> "$L/steps.log"
