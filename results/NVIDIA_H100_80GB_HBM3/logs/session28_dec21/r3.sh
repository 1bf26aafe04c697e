source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
V=(--variant "fct2 regs_claim=2" --variant "fct4 regs_claim=4" --variant "fct8 regs_claim=8")
CELLS=(2x32k 4x32k 2x128k 2x8k 4x8k)
bg pre 25 python3 tests/decode_b1_timing.py --precompile --processes 6 --cells "${CELLS[@]}" "${V[@]}"
bg pre_t 25 python3 tests/decode_precompile.py --only regs_claim_tests --processes 6
wait
step time 24 python3 tests/decode_b1_timing.py --no-precompile --repeat 9 --max-seconds 20 --cells "${CELLS[@]}" "${V[@]}" --out $OUT/time.json
bg t1 34 python3 -m pytest -q -p no:cacheprovider 'tests/test_decode_claim_gpu.py::test_claims_pairs[b8_q2_l900_h16x8_d128_bf16_page0_causal_window_size_softcap_alibi-claim2]' 'tests/test_decode_claim_gpu.py::test_claims_pairs[b8_q2_l900_h16x8_d128_bf16_page0_causal_window_size_softcap_alibi-claim16]' 'tests/test_decode_claim_gpu.py::test_claims_fused[b2_q1_l20000_h32x8_d128_bf16_page256_seqlen_new_rotary_dim]'
bg t2 34 python3 -m pytest -q -p no:cacheprovider 'tests/test_decode_claim_gpu.py::test_claims_pairs[b8_q1_l3001_h32x8_d128_bf16_page16-claim2]' 'tests/test_decode_claim_gpu.py::test_claims_pairs[b8_q1_l3001_h32x8_d128_bf16_page16-claim16]' 'tests/test_decode_claim_gpu.py::test_claims_pairs[b8_q1_l3001_h32x8_d128_bf16_page256-claim2]' 'tests/test_decode_claim_gpu.py::test_claims_pairs[b8_q1_l3001_h32x8_d128_bf16_page256-claim16]' 'tests/test_decode_claim_gpu.py::test_claims_fused[b2_q1_l20000_h32x8_d128_bf16_page16]'
bg t3 34 python3 -m pytest -q -p no:cacheprovider 'tests/test_decode_claim_gpu.py::test_claims_pairs[b8_q1_l3000_h32x8_d128_bf16_page0_seqlen_new_rotary_dim-claim2]' 'tests/test_decode_claim_gpu.py::test_claims_pairs[b8_q1_l3000_h32x8_d128_bf16_page0_seqlen_new_rotary_dim-claim16]' 'tests/test_decode_claim_gpu.py::test_claims_pairs[b8_q1_l3000_h32x8_d128_bf16_page0_batch_idx_leftpad-claim2]' 'tests/test_decode_claim_gpu.py::test_claims_pairs[b8_q1_l3000_h32x8_d128_bf16_page0_batch_idx_leftpad-claim16]'
bg t4 34 python3 -m pytest -q -p no:cacheprovider 'tests/test_decode_claim_gpu.py::test_claims_pairs[b16_q1_l5000_h32x4_d128_bf16_page0-claim16]' 'tests/test_decode_claim_gpu.py::test_claims_pairs[b8_q3_l2000_h8x8_d128_bf16_page0_causal-claim16]' 'tests/test_decode_claim_gpu.py::test_claims_pairs[b8_q2_l9000_h32x8_d128_bf16_page0_causal-claim2]' 'tests/test_decode_claim_gpu.py::test_claims_pairs[b8_q2_l9000_h32x8_d128_bf16_page0_causal-claim16]' 'tests/test_decode_claim_gpu.py::test_claims_pairs[b8_q4_l3000_h32x8_d64_bf16_page0_causal-claim2]' 'tests/test_decode_claim_gpu.py::test_claims_pairs[b8_q4_l3000_h32x8_d64_bf16_page0_causal-claim16]'
bg race16 34 env CLAIM=16 compute-sanitizer --tool racecheck --error-exitcode 3 python3 tests/decode_claim_sanitize.py
wait
echo "total $(el) s"
