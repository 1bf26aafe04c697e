# session 30 lead, merged main on an nvidia-h200-x2 host. GPU 1: precompiles and the merged helpers' GPU tests;
# GPU 0 (after GPU 1's precompiles): bench --mode decode (the README's H200 table; CUDA-graph replays), then ViT-B/16's
# training step and the short-sequence timing against SDPA (peers in one process).
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
export CUDA_VISIBLE_DEVICES=1
bg pre_dec 40 python3 tests/decode_precompile.py --only page_shift_tests,shipped_b1 --processes 6
bg pre_w 40 python -m cuflash warmup --op fwd,bwd --dtype bf16,fp16 --hdim 64 --causal both --processes 4
bg pre_ss 40 python tests/test_short_seq_gpu.py --precompile
bg pre_ln 40 python tests/layer_norm_precompile.py
wait
(
  export CUDA_VISIBLE_DEVICES=0
  step bench_dec 75 python -m cuflash bench --mode decode --out "$OUT/decode"
  step vit 40 python tests/models_vit_timing.py --batch 64 --iters 8 --out "$L/vit.json"
  step short 40 python tests/short_seq_timing.py --shapes 256x197x12 64x197x12 8x2048x32 --variants --long-variants --sdpa cudnn --no-fa2 --reps 6 --b2b 10 --profile 0 --out "$L/short.json"
) &
bg t_ss 60 python -m pytest -q -p no:cacheprovider tests/test_short_seq_gpu.py tests/test_packed_grad_gpu.py
bg t_dec 90 python -m pytest -q -p no:cacheprovider tests/test_decode_page_shift_gpu.py tests/test_decode_batch_rules_gpu.py
wait
bg t_ln 40 python -m pytest -q -p no:cacheprovider tests/test_layer_norm_gpu.py -k "fast_path or cuda_graph"
bg t_mdl 60 python -m pytest -q -p no:cacheprovider tests/test_models_vit_baichuan_btlm_gpu.py tests/test_mha_gpu.py
bg t_grid 70 python -m pytest -q -x -p no:cacheprovider tests/test_flash_fwd_gpu.py tests/test_flash_bwd_gpu.py -k "heuristic_on_the_grid and d64 and full"
wait
echo "all done $(el)s" >> "$L/steps.log"
