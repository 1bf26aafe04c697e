# session 31 lead, main@HEAD on one H200 of an x2 host: the GPU check of session 30's review mends (CPU-checked only
# then): the varlen torch.compile + CUDA-graph test (api._values_unreadable's compile check first), the packed-gradient
# route (FlashAttnPackedFn anchors q), the short-call choice cache keyed on seqlen_k, MHA decoding's key count.
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
bg pre_ss 35 python tests/test_short_seq_gpu.py --precompile
bg pre_w 35 python -m cuflash warmup --op fwd,bwd --dtype bf16 --hdim 64,128 --causal both --varlen --processes 8
wait
bg t_vl 60 python -m pytest -q -p no:cacheprovider tests/test_varlen_gpu.py
bg t_pk 60 python -m pytest -q -p no:cacheprovider tests/test_packed_grad_gpu.py tests/test_short_seq_gpu.py
wait
step t_mha 30 python -m pytest -q -x -p no:cacheprovider tests/test_mha_gpu.py
echo "all done $(el)s" >> "$L/steps.log"
