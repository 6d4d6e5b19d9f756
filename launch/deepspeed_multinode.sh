#!/usr/bin/env bash
# Multi-node training with the DeepSpeed launcher and a hostfile, over pdsh + ssh.
# Prerequisites: pdsh on node 0; passwordless ssh (key, no prompt) from node 0 to every node in the
# hostfile, node 0 itself included; the same repository path, Python environment and run.dir on
# every node (shared filesystem). Run once, on node 0, from the repository root:
#
#   HOSTFILE=launch/hostfile.example NUM_NODES=2 GPUS_PER_NODE=8 \
#     launch/deepspeed_multinode.sh --config configs/cluster/mod.yaml [dotted.key=value ...]
#   # runner options pass through: --ssh_port 2222, --master_addr 10.0.0.1, --launcher openmpi, --env K=V
#   launch/deepspeed_multinode.sh --hostfile H --ssh_port 2222 --env NCCL_DEBUG=WARN --config ...
#
# Without ssh between nodes (or under a scheduler), run it on every node with NODE_RANK set:
#   NO_SSH=1 NODE_RANK=0 MASTER_ADDR=node0 HOSTFILE=... launch/deepspeed_multinode.sh --config ...
#
# Before anything starts: the config is validated (bad config: one `config error:` line, exit 2) and
# every host must answer ssh (else one line naming it, exit 2). Every rank gets `--env KEY=VALUE`
# (values arrive unchanged) and the OMP_*, NCCL_*, GLOO_*, TORCH_*, PYTORCH_*, HF_*, WANDB_*, MODE_*,
# DS_ACCELERATOR, DEEPSPEED_TIMEOUT variables set here, through DeepSpeed's env file (a temporary
# DS_ENV_FILE; ~/.deepspeed_env and ./.deepspeed_env lines are kept). Ctrl-C stops this job's
# launcher on every node (found by master address and port), not DeepSpeed's `pkill -f "<python> -u
# -m deepspeed.launcher.launch"` of every node's launchers.
#
# Variables: HOSTFILE (required for >1 node), NUM_NODES (default: all hosts), GPUS_PER_NODE (default:
# hostfile slots), MASTER_ADDR (default: the first host, as every node resolves it), MASTER_PORT
# (default 29500), SSH_PORT, NO_SSH, NODE_RANK, PYTHON (see below).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
args=(--launcher deepspeed)
if [[ -n "${HOSTFILE:-}" ]]; then args+=(--hostfile "$HOSTFILE"); fi
if [[ -n "${NUM_NODES:-}" ]]; then args+=(--num_nodes "$NUM_NODES"); fi
if [[ -n "${GPUS_PER_NODE:-}" ]]; then args+=(--num_gpus "$GPUS_PER_NODE"); fi
if [[ -n "${MASTER_ADDR:-}" ]]; then args+=(--master_addr "$MASTER_ADDR"); fi
if [[ -n "${MASTER_PORT:-}" ]]; then args+=(--master_port "$MASTER_PORT"); fi
if [[ -n "${SSH_PORT:-}" ]]; then args+=(--ssh_port "$SSH_PORT"); fi
if [[ -n "${NO_SSH:-}" ]]; then  # launch.run refuses a missing NODE_RANK in one `config error:` line
  args+=(--no_ssh); if [[ -n "${NODE_RANK:-}" ]]; then args+=(--node_rank "$NODE_RANK"); fi
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
# PYTHON, else an activated virtualenv's python3, else the checkout's .venv (make install), else python3.
[[ -z "${PYTHON:-}" && -z "${VIRTUAL_ENV:-}" && -x "$ROOT/.venv/bin/python" ]] && PYTHON="$ROOT/.venv/bin/python"
exec "${PYTHON:-python3}" -m launch.run "${args[@]}" "$@"
