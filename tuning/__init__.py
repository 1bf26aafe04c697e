"""The cuflash autotuner (optuna search over kernel configs). Arrives with the tuner issue."""
