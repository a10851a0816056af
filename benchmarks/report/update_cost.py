"""What the separate update pass costs against forward + backward (``update_cost.json``, benchmarks/update_cost.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.report.common import command_block, ms, need, renders, table


@renders("update_cost.json", "Update fusion: what the separate update pass costs", order=41, optional=True)
def update_cost(path: Path, d: dict[str, Any]) -> list[str]:
    """The separate update pass against forward + backward: the most update fusion can save."""
    need(d, path, "model", "fwd_bwd_s", "update_s", "update_share", "parameters", "tensors", "update_gb_per_s")
    a = d.get("args", {})
    lines = [
        f"{d['model']} ({d['parameters'] / 1e6:.2f} M parameters in {d['tensors']} tensors), batch {a.get('batch_size', '?')}; "
        f"medians of {a.get('iters', '?')} interleaved repetitions. The unfused momentum-SGD update (weight decay on) is "
        "the pass that fusion folds into forward or backward: its time bounds the saving.",
        "",
    ]
    lines += table(
        ["forward + backward", "update pass", "update share", "update bandwidth"],
        [[f"{ms(d['fwd_bwd_s'])} ms", f"{d['update_s'] * 1e3:.1f} ms", f"{d['update_share']:.1%}", f"{d['update_gb_per_s']:.1f} GB/s"]],
    )
    lines += command_block(d, "benchmarks.update_cost", "python -m benchmarks.update_cost --model mobilenet_v2_32 --batch-size 32")
    return lines
