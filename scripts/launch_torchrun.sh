#!/usr/bin/env bash
# Launch spdkfac.train with torchrun (torch.distributed: gloo on CPU, NCCL on GPU).
#   one node:      NPROC=4 bash scripts/launch_torchrun.sh --data digits
#   several nodes: NNODES=2 NODE_RANK=0 MASTER_ADDR=node1 NPROC=4 bash scripts/launch_torchrun.sh --data /data/imagenet
#   elastic:       MAX_RESTARTS=3 NPROC=4 bash scripts/launch_torchrun.sh --data digits --resume auto --checkpoint-every 100
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
cd "$ROOT"
set -x
if [[ -n "${MAX_RESTARTS:-}" ]]; then
    # Elastic: restart lost workers up to MAX_RESTARTS times (c10d rendezvous); pass --resume auto --checkpoint-every K
    # so that each restart continues from the newest checkpoint.
    exec "$PY" -m torch.distributed.run --nnodes "${NNODES:-1}" --nproc_per_node "${NPROC:-2}" \
        --max-restarts "$MAX_RESTARTS" --rdzv-backend c10d --rdzv-endpoint "${MASTER_ADDR:-127.0.0.1}:${MASTER_PORT:-29511}" \
        -m spdkfac.train --backend torch "$@"
fi
exec "$PY" -m torch.distributed.run --nnodes "${NNODES:-1}" --node_rank "${NODE_RANK:-0}" \
    --nproc_per_node "${NPROC:-2}" --master_addr "${MASTER_ADDR:-127.0.0.1}" --master_port "${MASTER_PORT:-29511}" \
    -m spdkfac.train --backend torch "$@"
