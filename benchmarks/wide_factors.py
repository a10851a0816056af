"""A language model's vocabulary-wide factors kept dense or diagonal (``max_factor_dim``): memory and step times.

    python -m benchmarks.wide_factors

A language model's output layer has a ``G`` factor as wide as its vocabulary
(and its embedding a diagonal ``A`` as wide). Dense, that factor and its
inverse take ``V^2`` memory and a ``V^3`` decomposition. This builds one
Llama-style model per vocabulary size twice, one optimizer keeping every
factor dense and one with ``max_factor_dim`` below the vocabulary (only the
vocabulary-wide factors become diagonal), and steps the two copies in
alternation on the same batches: plain steps (the kept decompositions),
factor steps, and steps that also decompose. It records each arm's K-FAC
memory (``memory_usage()``), the median seconds of each kind of step, the
ratios, and the amortised mean at factors every 10 and decompositions every
100 steps that those medians give.
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import torch
import torch.nn.functional as F

from spdkfac import SPDKFACOptimizer
from spdkfac.models.llama import CharLlama

from .common import one_process_parser, save_result, stats

#: vocabulary sizes; the model: width 256, 2 blocks of 4 heads, MLP 688, 64 tokens, batch 16
VOCABULARIES = (1024, 4096)
WIDTH, HEADS, MLP, CONTEXT, BATCH = 256, 4, 688, 64, 16
#: below every vocabulary and above every other factor (the MLP's 688)
LIMIT = 1000
#: (name, factor_update_freq, inv_update_freq) of the steps timed: what each kind of step does
KINDS = (("plain", 10**6, 10**6), ("factors", 1, 10**6), ("decompositions", 1, 1))


def _arm(limit: int | None, dims: tuple[int, int, int, int, int, int]) -> dict[str, Any]:
    """One copy of the model (``dims``: vocabulary, width, heads, MLP, context, batch) and its optimizer."""
    torch.manual_seed(0)
    vocabulary, width, heads, mlp, context, _ = dims
    model = CharLlama(vocabulary, context, width, 2, heads, mlp)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (no perf_model: the default's, alike in both arms)
        opt = SPDKFACOptimizer(model, lr=0.01, backend="single", max_factor_dim=limit)
    return {"model": model, "opt": opt, "seconds": {kind: [] for kind, _, _ in KINDS}}


def _step(arm: dict[str, Any], ids: torch.Tensor, factor_freq: int, inv_freq: int) -> float:
    opt: SPDKFACOptimizer = arm["opt"]
    opt.factor_update_freq, opt.inv_update_freq = factor_freq, inv_freq
    start = time.perf_counter()
    opt.zero_grad()
    F.cross_entropy(arm["model"](ids[:, :-1]), ids[:, 1:]).backward()  # ((N, V, T) logits: per position)
    opt.step()
    return time.perf_counter() - start


def measure(rounds: int, quick: bool = False) -> dict[str, dict[str, Any]]:
    """Per vocabulary: each arm's K-FAC bytes and its seconds per kind of step (interleaved), and the ratios."""
    rows: dict[str, dict[str, Any]] = {}
    for vocabulary in (48,) if quick else VOCABULARIES:
        dims = (vocabulary, 16, 2, 24, 8, 2) if quick else (vocabulary, WIDTH, HEADS, MLP, CONTEXT, BATCH)
        limit = 40 if quick else LIMIT
        arms = {"dense": _arm(None, dims), "diagonal": _arm(limit, dims)}
        data = torch.Generator().manual_seed(1)
        context, batch = dims[4], dims[5]
        first = torch.randint(0, vocabulary, (batch, context + 1), generator=data)
        for arm in arms.values():  # (the first step decomposes: every arm starts with decompositions)
            _step(arm, first, 1, 1)
        for kind, factor_freq, inv_freq in KINDS:
            for _ in range(rounds if kind == "plain" else max(2, rounds // 3)):
                ids = torch.randint(0, vocabulary, (batch, context + 1), generator=data)
                for arm in arms.values():
                    arm["seconds"][kind].append(_step(arm, ids, factor_freq, inv_freq))
        row: dict[str, Any] = {"vocabulary": vocabulary, "max_factor_dim": limit}
        for name, arm in arms.items():
            medians = {kind: stats(seconds)["median"] for kind, seconds in arm["seconds"].items()}
            amortised = (89 * medians["plain"] + 9 * medians["factors"] + medians["decompositions"]) / 100
            row[name] = {
                "kfac_bytes": sum(arm["opt"].memory_usage().values()),
                "seconds": {kind: stats(seconds) for kind, seconds in arm["seconds"].items()},
                "amortised_10_100": amortised,
                "summary": arm["opt"].kfac_summary().splitlines()[1:],
            }
        dense, diagonal = row["dense"], row["diagonal"]
        row["memory_ratio"] = dense["kfac_bytes"] / diagonal["kfac_bytes"]
        row["speedup"] = {kind: dense["seconds"][kind]["median"] / diagonal["seconds"][kind]["median"] for kind, _, _ in KINDS}
        row["speedup"]["amortised_10_100"] = dense["amortised_10_100"] / diagonal["amortised_10_100"]
        rows[f"vocabulary {vocabulary}"] = row
        print(
            f"vocabulary {vocabulary}: K-FAC memory {dense['kfac_bytes'] / 2**20:.1f} -> {diagonal['kfac_bytes'] / 2**20:.1f} MiB "
            f"({row['memory_ratio']:.1f}x less); dense over diagonal: "
            + ", ".join(f"{kind} {ratio:.2f}x" for kind, ratio in row["speedup"].items()),
            flush=True,
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = one_process_parser(
        __doc__,
        "wide_factors.json",
        ("--rounds", 12, "timed plain steps per arm (a third as many factor and decomposition steps, at least 2)"),
        "a tiny model (to test the benchmark)",
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    save_result(args, "vocabularies", measure(args.rounds, args.quick))


if __name__ == "__main__":
    main()
