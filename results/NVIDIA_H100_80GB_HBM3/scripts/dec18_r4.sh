#!/usr/bin/env bash
# session 27 dec18 round 4 (the merged main): what ships, the batch-1 rule up to 8k keys (separate combine with its
# early partial-O loads, pdl 1): memcheck, racecheck and synccheck of its calls, then a subset of its GPU tests.
set -u
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
step pre 10 python3 tests/decode_precompile.py --only shipped_b1 --processes 4
step memcheck 9 compute-sanitizer --tool memcheck --error-exitcode 9 python3 tests/decode_staged_sanitize.py --shipped
step racecheck 12 compute-sanitizer --tool racecheck --error-exitcode 9 python3 tests/decode_staged_sanitize.py --shipped
step synccheck 9 compute-sanitizer --tool synccheck --error-exitcode 9 python3 tests/decode_staged_sanitize.py --shipped
step tests 12 python3 -m pytest -q -p no:cacheprovider tests/test_decode_staged_gpu.py -k "batch1_rule and (splits0 or graph)"
echo "all done $(el)s" >> $L/steps.log
