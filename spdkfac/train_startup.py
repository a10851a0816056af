"""Start-up checks that one rank makes and every rank acts on.

A check that fails on one rank only (rank 0 probing ``--out-dir``) must not
leave the others waiting in the next collective: they would stall until the
collective timeout (under torchrun, also on every restart). So the outcome
is all-reduced and every rank leaves with the same error at the same point.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .comm import CommBackend

__all__ = ["probe_out_dir"]


def probe_out_dir(out_dir: Path, is_root: bool, backend: CommBackend, device: torch.device) -> None:
    """Rank 0 creates ``out_dir`` and writes a file there; if that fails, every rank raises SystemExit saying so."""
    problem = ""
    if is_root:
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            probe = out_dir / ".write-test"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            problem = str(exc) or type(exc).__name__
    failed = torch.tensor([1.0 if problem else 0.0], device=device)  # NCCL reduces device tensors only
    backend.allreduce_async(failed, "train.out_dir_probe").wait()
    if float(failed) > 0:
        reason = problem if is_root else "rank 0 failed to create or write to it (its error says why)"
        raise SystemExit(f"error: cannot write to --out-dir {out_dir}: {reason}")
