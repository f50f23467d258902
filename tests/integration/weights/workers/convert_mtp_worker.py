"""Worker: ``hf-to-mcore --mtp-in-model`` at TP x PP x EP (expert TP 1), or ``mcore-to-hf``
of its checkpoint (one rank).

Usage: python convert_mtp_worker.py save HF_DIR OUT TPxPPxEP | export CKPT OUT
"""

from __future__ import annotations

import sys

import torch.distributed as dist

from vapo_megatron.parallel.cpu_shim import destroy, initialize_megatron_cpu
from vapo_megatron.weights import convert as conv


def main() -> None:
    if sys.argv[1] == "save":
        tp, pp, ep = (int(v) for v in sys.argv[4].split("x"))
        initialize_megatron_cpu(tp=tp, pp=pp, ep=ep, etp=1)
        conv.hf_to_mcore(conv.inspect_hf(sys.argv[2], mtp=True), sys.argv[3])
    else:
        conv.mcore_to_hf(sys.argv[2], sys.argv[3])
    destroy() if dist.is_initialized() else None


if __name__ == "__main__":  # dist_checkpointing's writer spawns processes that import this file
    main()
