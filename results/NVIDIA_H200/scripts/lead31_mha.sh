# session 31 lead: MHA GPU tests on main (session 30's mend: the per-step key count only with alibi_train_seqlen).
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
step t_mha 58 python -m pytest -q -p no:cacheprovider tests/test_mha_gpu.py
echo "all done $(el)s" >> "$L/steps.log"
