#!/bin/bash
# SLURM batch script for the 64-GPU recipe: 8 nodes x 8 GPUs, one task per GPU.
# Lightning reads the SLURM environment (ranks, master address); --ntasks-per-node must equal
# trainer.devices and --nodes must equal trainer.num_nodes in the config.
#
#   sbatch examples/slurm_hdet.sh                              # a fresh run
#   sbatch examples/slurm_hdet.sh --ckpt_path=last             # resume from the last checkpoint
#SBATCH --job-name=hdet-64gpu
#SBATCH --nodes=8
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=8
#SBATCH --time=24:00:00
#SBATCH --output=%x-%j.out

set -euo pipefail
export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1}
# export WANDB_MODE=offline          # compute nodes without internet: `wandb sync` the runs afterwards

srun python examples/cli.py fit --config examples/configs/recipe_64gpu.yaml "$@"
