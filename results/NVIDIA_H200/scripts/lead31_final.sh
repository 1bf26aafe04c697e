# session 31 lead, merged main on an nvidia-h200-x2 host. GPU 0: bench --mode decode (README's H200 decode table),
# bench --mode features (README's features rows), ViT-B/16 step and the short-sequence timing (peers in one process).
# GPU 1: precompiles, then the merged helpers' GPU tests (dec28 page table 2 + rule, win5 dq_tail, sb2 short calls,
# mdl5 map pooling).
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
(
  export CUDA_VISIBLE_DEVICES=0
  step pre_dec0 30 python3 tests/decode_precompile.py --only shipped_b1 --processes 8
  step bench_dec 80 python -m cuflash bench --mode decode --out "$OUT/decode"
  step warm_feat 40 python -m cuflash warmup --op fwd,bwd --dtype bf16 --hdim 128 --causal both --features all --varlen --processes 8
  step bench_feat 150 python -m cuflash bench --mode features --out "$OUT/features"
  step vit 40 python tests/models_vit_timing.py --batch 64 --iters 8 --out "$L/vit.json"
  step short 40 python tests/short_seq_timing.py --shapes 256x197x12 64x197x12 32x1024x12 --sdpa cudnn --no-fa2 --reps 6 --b2b 10 --profile 0 --out "$L/short.json"
) &
(
  export CUDA_VISIBLE_DEVICES=1
  bg pre_pt 40 python3 tests/decode_precompile.py --only page_table2_tests --processes 6
  bg pre_ss 40 python tests/test_short_seq_gpu.py --precompile
  bg pre_dq 40 python3 tests/dq_tail_precompile.py --tests --defaults
  bg pre_w 40 python -m cuflash warmup --op fwd,bwd --dtype bf16 --hdim 64 --causal both --features alibi --varlen --helpers rotary,layer_norm --processes 4
  wait
  bg t_pt 60 python3 -m pytest -q -rf -p no:cacheprovider tests/test_decode_page_table2_gpu.py -k "cuda_graph or ((rotary or alibi or page40) and ((splits0 and ro0 and rps1) or (splits3 and ro1 and rps0)))"
  bg t_rule 60 python3 -m pytest -q -rf -p no:cacheprovider tests/test_decode_staged_gpu.py tests/test_decode_batch_rules_gpu.py -k "batch1_paged_rule or batch_rule"
  wait
  bg t_ss 70 python -m pytest -q -p no:cacheprovider tests/test_short_seq_gpu.py tests/test_packed_grad_gpu.py
  bg t_dq 70 python -m pytest -q -p no:cacheprovider tests/test_bwd_dq_tail_gpu.py -k "cuda_graph or window"
  bg t_win 70 python -m pytest -q -p no:cacheprovider tests/test_window_gpu.py tests/test_window_overlap_gpu.py tests/test_sm90_bwd_features_gpu.py::test_window tests/test_feature_defaults_gpu.py
  bg t_vit 70 python -m pytest -q -p no:cacheprovider tests/test_models_vit_baichuan_btlm_gpu.py -k "vit or pool or map"
  wait
) &
wait
echo "all done $(el)s" >> "$L/steps.log"
