"""Launch wrappers: validate a training config, then start the DeepSpeed launcher or torchrun.

`python -m launch.run --help`; the shell front-ends (deepspeed_multinode.sh, torchrun.sh,
slurm.sbatch) all go through `launch/run.py`.
"""
