#!/usr/bin/env bash
# Launch spdkfac.train with torchrun (torch.distributed: gloo on CPU, NCCL on GPU).
#   one node:      NPROC=4 bash scripts/launch_torchrun.sh --data digits
#   several nodes: NNODES=2 NODE_RANK=0 MASTER_ADDR=node1 NPROC=4 bash scripts/launch_torchrun.sh --data /data/imagenet
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
cd "$ROOT"
set -x
exec "$PY" -m torch.distributed.run --nnodes "${NNODES:-1}" --node_rank "${NODE_RANK:-0}" \
    --nproc_per_node "${NPROC:-2}" --master_addr "${MASTER_ADDR:-127.0.0.1}" --master_port "${MASTER_PORT:-29511}" \
    -m spdkfac.train --backend torch "$@"
