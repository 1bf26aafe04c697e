# session 31 lead: the window GPU tests on merged main (dq_tail 2 the window backward's default), completed.
source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
step pre_dq 40 python3 tests/dq_tail_precompile.py --tests --defaults
step t_win 150 python -m pytest -q -p no:cacheprovider tests/test_window_gpu.py tests/test_window_overlap_gpu.py tests/test_sm90_bwd_features_gpu.py::test_window tests/test_feature_defaults_gpu.py
echo "all done $(el)s" >> "$L/steps.log"
