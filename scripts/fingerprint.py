"""Fingerprints of the optimizers' numbers: a SHA-256 of the parameters after 10 steps, per variant and engine.

A refactoring that must not change behaviour (a package re-layout, a rename)
runs this before and after on the same machine and compares: every hash must
be bitwise the same. It uses only what every layout keeps (the public API
``spdkfac.make_optimizer`` / ``spdkfac.VARIANTS``, ``spdkfac.comm.get_backend``
and ``spdkfac.perfmodels.PerfModel``) and its own model, so the same file
runs on the code before and after a move.

    python scripts/fingerprint.py --all OUT.json          # one process, 2 torchrun (gloo) and 2 horovodrun (gloo) workers
    python scripts/fingerprint.py --compare BEFORE.json AFTER.json
    python scripts/fingerprint.py --backend single --out F.json   # one engine (the launchers start this form)

Each worker trains on its contiguous shard of one fixed global batch; every
rank hashes its parameters and the hashes must agree across ranks.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the spdkfac of this checkout, whatever is installed

import spdkfac  # noqa: E402
from spdkfac.comm import get_backend  # noqa: E402
from spdkfac.perfmodels import PerfModel  # noqa: E402

STEPS = 10
GLOBAL_BATCH = 16
VOCAB = 11

#: The optimizer options every K-FAC run shares (the variants and the entries below change some of them).
KFAC = dict(lr=0.05, damping=0.01, factor_decay=0.9, kl_clip=0.01, momentum=0.9, weight_decay=1e-3, profile_steps=2)


def runs() -> dict[str, tuple[str, dict[str, Any]]]:
    """name -> (variant for ``make_optimizer``, keyword arguments): every variant and each option a refactoring could break."""
    out: dict[str, tuple[str, dict[str, Any]]] = {name: (name, dict(KFAC)) for name in sorted(spdkfac.VARIANTS)}
    extra: dict[str, dict[str, Any]] = {
        "eigen": dict(compute_method="eigen"),
        "eigen-warm": dict(compute_method="eigen", eigen_refresh="warm", eigen_full_every=3),
        "ekfac": dict(compute_method="ekfac"),
        "ekfac-warm": dict(compute_method="ekfac", eigen_refresh="warm", eigen_full_every=3),
        "ekfac-adam": dict(compute_method="ekfac", base="adamw", ekfac_update="adam", kl_clip=None, lr=5e-3, momentum=None),
        "grad-workers-0.5": dict(grad_worker_fraction=0.5),
        "eigen-grad-workers-0.5": dict(compute_method="eigen", grad_worker_fraction=0.5),
        "update-fusion-forward": dict(update_fusion="forward"),
        "update-fusion-backward": dict(update_fusion="backward", kl_clip=None),
        "base-adamw": dict(base="adamw", lr=5e-3, momentum=None),
        "base-lamb": dict(base="lamb", lr=5e-3, momentum=None),
        "freq-2-4": dict(factor_update_freq=2, inv_update_freq=4),
        "distribute-preconditioning": dict(distribute_preconditioning=True),
    }
    for name, change in extra.items():
        kwargs = dict(KFAC, **change)
        out[f"spdkfac+{name}"] = ("spdkfac", {k: v for k, v in kwargs.items() if v is not None or k == "kl_clip"})
    out["sgd+update-fusion-forward"] = ("sgd", dict(lr=0.05, momentum=0.9, update_fusion="forward"))
    out["sgd+update-fusion-backward"] = ("sgd", dict(lr=0.05, momentum=0.9, update_fusion="backward", kl_clip=None))
    dho2 = dict(lr=1e-3, k=2, l=1, refresh_every=3, admm_period=4)
    out["dho2"] = ("dho2", dho2)
    out["dho2-wa"] = ("dho2-wa", dho2)
    out["adamw"] = ("adamw", dict(lr=1e-3))
    return out


class Net(nn.Module):
    """Conv2d, a grouped Conv2d, an Embedding (of tokens read off the input) and two Linear layers."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(2, 8, 3, padding=1)
        self.grouped = nn.Conv2d(8, 8, 3, stride=2, groups=2, bias=False)
        self.embed = nn.Embedding(VOCAB, 6)
        self.fc1 = nn.Linear(8 * 2 * 2 + 6, 12)
        self.fc2 = nn.Linear(12, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = (x[:, 0, 0, :4].abs() * 4).long().clamp(max=VOCAB - 1)
        h = self.grouped(F.relu(self.conv(x))).flatten(1)
        h = torch.cat([h, self.embed(tokens).mean(1)], dim=1)
        return self.fc2(torch.tanh(self.fc1(h)))


def perf_model_file(path: Path) -> str:
    """A model that makes inversions and eigendecompositions dear, so that placement owns and broadcasts factors."""
    data = PerfModel.default().to_dict()
    data["inverse"] = {"kind": "cubic", "coeffs": [1e-6, 0.0, 0.0, 1e-3], "floor": 1e-6}
    data["eigen"] = {"kind": "cubic", "coeffs": [1e-6, 0.0, 0.0, 2e-3], "floor": 1e-6}
    data["broadcast"] = {"alpha": 1e-3, "beta": 1e-9}
    path.write_text(json.dumps(data))
    return str(path)


def parameter_hash(model: nn.Module) -> str:
    digest = hashlib.sha256()
    for name, p in model.named_parameters():
        digest.update(name.encode())
        digest.update(p.detach().contiguous().cpu().numpy().tobytes())
    return digest.hexdigest()


def train_one(variant: str, kwargs: dict[str, Any], backend: Any, perf_model: str, x: torch.Tensor, y: torch.Tensor) -> str:
    model = Net()
    kfac = variant in spdkfac.VARIANTS
    if kfac:
        kwargs = dict(kwargs, perf_model=perf_model)
    opt = spdkfac.make_optimizer(variant, model, backend=backend, **kwargs)
    for step in range(STEPS):
        xs = x + 0.01 * step  # a different batch each step, the same on every layout
        opt.zero_grad()
        loss = F.cross_entropy(model(xs), y)
        loss.backward()
        if variant.startswith("dho2"):
            opt.step(lambda xs=xs: F.cross_entropy(model(xs), y))
        else:
            opt.step()
    if kfac:
        opt.flush()  # update_fusion='forward' holds the last update until the next forward
        opt.remove_hooks()
    return parameter_hash(model)


def worker(engine: str, out: Path) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    backend = get_backend(engine)
    rank, size = backend.rank, backend.size
    g = torch.Generator().manual_seed(1)
    x = torch.randn(GLOBAL_BATCH, 2, 6, 6, generator=g)
    y = torch.randint(0, 5, (GLOBAL_BATCH,), generator=g)
    local = GLOBAL_BATCH // size
    x, y = x[rank * local : (rank + 1) * local], y[rank * local : (rank + 1) * local]
    with tempfile.TemporaryDirectory() as tmp:
        pm = perf_model_file(Path(tmp) / f"perf-{rank}.json")
        results: dict[str, str] = {}
        for name, (variant, kwargs) in runs().items():
            if size == 1 and "grad_worker_fraction" in kwargs:
                continue  # a fraction of one worker is not a choice
            results[name] = train_one(variant, kwargs, backend, pm, x, y)
    if size > 1:  # every replica must hold the same parameters (the first 48 bits of each hash, exact as float64)
        gathered = backend.gather_values([float(int(h[:12], 16)) for h in results.values()], "fingerprint")
        if any(r != gathered[0] for r in gathered):
            raise SystemExit(f"rank {rank}: the replicas' parameters differ: {gathered}")
    if rank == 0:
        out.write_text(
            json.dumps(
                {"engine": engine, "workers": size, "torch": torch.__version__, "spdkfac_file": spdkfac.__file__, "hashes": results},
                indent=1,
            )
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def launch_all(out: Path) -> None:
    """Run the one-process and the two 2-worker fingerprints and write them into ``out``."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    script = str(Path(__file__).resolve())
    hvdrun = shutil.which("horovodrun", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    combined: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        commands = {
            "single": [sys.executable, script, "--backend", "single"],
            "torch-2": [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc_per_node",
                "2",
                "--master_addr",
                "127.0.0.1",
                "--master_port",
                str(_free_port()),
                script,
                "--backend",
                "torch",
            ],
            "horovod-2": [str(hvdrun), "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, script, "--backend", "horovod"],
        }
        for name, cmd in commands.items():
            part = Path(tmp) / f"{name}.json"
            print(f"[fingerprint] {name}: {' '.join(cmd)}", flush=True)
            proc = subprocess.run([*cmd, "--out", str(part)], env=env, cwd=ROOT, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                raise SystemExit(f"{name} failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-6000:]}")
            combined[name] = json.loads(part.read_text())
    out.write_text(json.dumps(combined, indent=1) + "\n")
    print(f"[fingerprint] {sum(len(v['hashes']) for v in combined.values())} hashes -> {out}")


def compare(before: Path, after: Path) -> int:
    a, b = json.loads(before.read_text()), json.loads(after.read_text())
    bad = 0
    for engine in sorted(set(a) | set(b)):
        ha, hb = a.get(engine, {}).get("hashes", {}), b.get(engine, {}).get("hashes", {})
        for name in sorted(set(ha) | set(hb)):
            same = ha.get(name) == hb.get(name) and name in ha
            bad += not same
            print(f"{'same' if same else 'DIFF'}  {engine:10s} {name}")
    print(f"{'bitwise identical' if not bad else f'{bad} differ'}: {sum(len(v['hashes']) for v in a.values())} hashes")
    return 1 if bad else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--all", type=Path, metavar="OUT", help="run every engine and write the combined fingerprints")
    ap.add_argument("--compare", type=Path, nargs=2, metavar=("BEFORE", "AFTER"))
    ap.add_argument("--backend", default="single", help="one engine's run (started by --all)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.compare:
        raise SystemExit(compare(*args.compare))
    if args.all:
        launch_all(args.all)
        return
    if args.out is None:
        ap.error("--out is required with --backend")
    worker(args.backend, args.out)


if __name__ == "__main__":
    main()
