source results/NVIDIA_H100_80GB_HBM3/scripts/round_env.sh
bg rpre 25 python3 tests/rotary_precompile.py
bg cpre 25 python3 tests/cross_entropy_precompile.py --processes 3
wait
bg t_ce 40 python3 -m pytest -q -p no:cacheprovider -x tests/test_cross_entropy_gpu.py -k "not 256000 and not 128256"
bg t_rot 40 python3 -m pytest -q -p no:cacheprovider -x tests/test_rotary_gpu.py
wait
echo "total $(el) s" >> $L/steps.log
