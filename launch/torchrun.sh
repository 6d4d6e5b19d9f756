#!/usr/bin/env bash
# The torchrun equivalent of deepspeed_multinode.sh: run once per node, from the repository root.
#
#   # node 0                                        # node 1
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 \        NNODES=2 NODE_RANK=1 MASTER_ADDR=node0 \
#   GPUS_PER_NODE=8 launch/torchrun.sh \            GPUS_PER_NODE=8 launch/torchrun.sh \
#     --config configs/cluster/mod.yaml               --config configs/cluster/mod.yaml
#
# One node: GPUS_PER_NODE=8 launch/torchrun.sh --config ... (NNODES defaults to 1).
# The config is validated first (bad config: one `config error:` line, exit 2, nothing started).
# Variables: NNODES (1), NODE_RANK (this node's rank: required with NNODES > 1, 0 on one node),
# GPUS_PER_NODE (visible GPUs), MASTER_ADDR (node 0's address; required with NNODES > 1, 127.0.0.1 on one node),
# MASTER_PORT (29500), PYTHON (see below). Every rank inherits this shell's environment.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
args=(--launcher torchrun --num_nodes "${NNODES:-1}" --master_addr "${MASTER_ADDR:-}"
      --master_port "${MASTER_PORT:-29500}")
# no default rank: with NNODES > 1 a missing NODE_RANK is refused, not rank 0 on every node
if [[ -n "${NODE_RANK:-}" ]]; then args+=(--node_rank "$NODE_RANK"); fi
[[ -n "${GPUS_PER_NODE:-}" ]] && args+=(--num_gpus "$GPUS_PER_NODE")
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
# PYTHON, else an activated virtualenv's python3, else the checkout's .venv (make install), else python3.
[[ -z "${PYTHON:-}" && -z "${VIRTUAL_ENV:-}" && -x "$ROOT/.venv/bin/python" ]] && PYTHON="$ROOT/.venv/bin/python"
exec "${PYTHON:-python3}" -m launch.run "${args[@]}" "$@"
