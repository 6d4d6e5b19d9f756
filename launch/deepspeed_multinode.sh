#!/usr/bin/env bash
# Multi-node training with the DeepSpeed launcher and a hostfile (passwordless ssh between nodes).
# Run once, on the first node, from the repository root (same path on every node: shared FS):
#
#   HOSTFILE=launch/hostfile.example NUM_NODES=2 GPUS_PER_NODE=8 \
#     launch/deepspeed_multinode.sh --config configs/cluster/mod.yaml [dotted.key=value ...]
#
# Without ssh between nodes (or under a scheduler), run it on every node with NODE_RANK set:
#   NO_SSH=1 NODE_RANK=0 MASTER_ADDR=node0 HOSTFILE=... launch/deepspeed_multinode.sh --config ...
#
# The config is validated before any worker starts (bad config: one `config error:` line, exit 2).
# Environment for every rank: `--env KEY=VALUE` (before --config), plus OMP_*/NCCL_*/GLOO_*/MODE_*/
# HF_* variables already set here; they reach the other nodes through DeepSpeed's .deepspeed_env.
#
# Variables: HOSTFILE (required for >1 node), NUM_NODES (default: all hosts), GPUS_PER_NODE (default:
# hostfile slots), MASTER_ADDR (default: first host), MASTER_PORT (default 29500), NO_SSH, NODE_RANK,
# PYTHON (default: python3 on PATH; activate the venv first).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
args=(--launcher deepspeed)
[[ -n "${HOSTFILE:-}" ]] && args+=(--hostfile "$HOSTFILE")
[[ -n "${NUM_NODES:-}" ]] && args+=(--num_nodes "$NUM_NODES")
[[ -n "${GPUS_PER_NODE:-}" ]] && args+=(--num_gpus "$GPUS_PER_NODE")
[[ -n "${MASTER_ADDR:-}" ]] && args+=(--master_addr "$MASTER_ADDR")
[[ -n "${MASTER_PORT:-}" ]] && args+=(--master_port "$MASTER_PORT")
[[ -n "${NO_SSH:-}" ]] && args+=(--no_ssh --node_rank "${NODE_RANK:?NODE_RANK is required with NO_SSH}")
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" -m launch.run "${args[@]}" "$@"
