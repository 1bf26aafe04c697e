#!/usr/bin/env bash
# session 26 final call, at the merged main (api9, api10, api11, dec17), on a 2 x H100 machine: the merged
# branches' GPU tests (PDL decode, rotary ops and torch.compile, MHA, flash-attn building blocks, the decode core
# as a regression check) on one GPU each, then ParallelMHA over NCCL on both GPUs (checks and timing).
set -u
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
nvidia-smi -L > $L/gpus.txt
PT="python3 -m pytest -q -p no:cacheprovider"
bg pre_dec 40 python3 tests/decode_precompile.py --only pdl_tests,core_tests --processes 12
bg pre_rot 30 python3 tests/rotary_precompile.py --processes 4
wait; echo "phase1 done $(el)s" >> $L/steps.log
# GPU 1: the PDL decode tests, one process after another (dec17: the reference checks are CPU-heavy)
( export CUDA_VISIBLE_DEVICES=1
  step t_pdl_chain 90 $PT "tests/test_decode_pdl_gpu.py::test_pdl_chain_graph"
  step t_pdl_rest 80 $PT tests/test_decode_pdl_gpu.py -k "not chain" ) &
# GPU 0: the rest
export CUDA_VISIBLE_DEVICES=0
bg t_dec_core 120 $PT tests/test_decode_gpu.py -k "grid or paged or features or graph or empty"
bg t_rot 60 $PT tests/test_rotary_gpu.py
bg t_rotc 100 $PT tests/test_rotary_compile_gpu.py
bg t_mha 80 $PT tests/test_mha_gpu.py tests/test_parallel_mha_gpu.py -rs
bg t_ops 100 $PT -m gpu tests/test_flash_ops_gpu.py
wait; echo "phase2 done $(el)s" >> $L/steps.log
unset CUDA_VISIBLE_DEVICES
step pmha_check 90 python3 tests/parallel_mha_gpu_check.py --world 2 --json $OUT/parallel_mha_w2.json
step pmha_timing 60 python3 tests/parallel_mha_timing.py --world 2 --json $OUT/parallel_mha_timing_w2.json
step t_pmha 90 $PT -rs tests/test_parallel_mha_gpu.py
echo "all done $(el)s" >> $L/steps.log
cd $OUT && tar czf callA.tgz logs *.json 2>/dev/null; rm -rf logs
