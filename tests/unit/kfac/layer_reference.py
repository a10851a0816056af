"""An independent float64 K-FAC reference for one layer, written from the definitions (explicit loops, no spdkfac code).

For a layer with weight ``W`` and per-group input rows ``a`` (im2col patches,
one-hot tokens) and output-gradient rows ``g`` of a batch-mean loss, with
``n`` samples and ``S`` output positions per sample:

* ``A_g = Σ (a/S)(a/S)^T / n`` (a ones column appended for a bias),
* ``G_g = Σ (n S g)(n S g)^T / (n S)``,
* for an embedding (``T`` tokens per sample, a Linear layer on one-hot rows):
  ``A = Σ a a^T / (n T)`` (diagonal), ``G = n Σ g g^T``,
* running averages after one step from the identity: ``decay I + (1 - decay) F``,
* update: ``((A+γI) ⊗ (G+γI))^-1 vec(grad)`` (inverse) or ``(A ⊗ G + γI)^-1 vec(grad)`` (eigen),
  a dense solve per group.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def _pads(module: nn.Conv1d | nn.Conv2d) -> list[tuple[int, int]]:
    """(before, after) padding per spatial dimension, from the module's definition."""
    out = []
    for i, (k, d) in enumerate(zip(module.kernel_size, module.dilation)):
        if module.padding == "same":
            total = d * (k - 1)
            out.append((total // 2, total - total // 2))
        elif module.padding == "valid":
            out.append((0, 0))
        else:
            p = module.padding[i]
            out.append((p, p))
    return out


def conv_rows(module: nn.Conv1d | nn.Conv2d, x: torch.Tensor) -> list[torch.Tensor]:
    """Per group: the im2col rows ``(n*L, C/groups * prod(k))`` of the padded input, by explicit slicing."""
    pads = _pads(module)
    flat = [p for pair in reversed(pads) for p in pair]  # F.pad order: last dimension first
    mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
    xp = F.pad(x, flat, mode=mode)
    if isinstance(module, nn.Conv1d):
        xp = xp.unsqueeze(2)
        k, s, d = (1, module.kernel_size[0]), (1, module.stride[0]), (1, module.dilation[0])
    else:
        k, s, d = module.kernel_size, module.stride, module.dilation
    n, c, h, w = xp.shape
    cg = c // module.groups
    out_h = (h - d[0] * (k[0] - 1) - 1) // s[0] + 1
    out_w = (w - d[1] * (k[1] - 1) - 1) // s[1] + 1
    groups = []
    for grp in range(module.groups):
        rows = []
        for b in range(n):
            for i in range(out_h):
                for j in range(out_w):
                    top, left = i * s[0], j * s[1]
                    patch = xp[
                        b, grp * cg : (grp + 1) * cg, top : top + d[0] * (k[0] - 1) + 1 : d[0], left : left + d[1] * (k[1] - 1) + 1 : d[1]
                    ]
                    rows.append(patch.reshape(-1))
        groups.append(torch.stack(rows))
    return groups


def conv_grad_rows(module: nn.Conv1d | nn.Conv2d, grad_out: torch.Tensor) -> list[torch.Tensor]:
    """Per group: the output-gradient rows ``(n*L, out/groups)``."""
    rows = grad_out.reshape(grad_out.shape[0], grad_out.shape[1], -1).permute(0, 2, 1).reshape(-1, grad_out.shape[1])
    og = grad_out.shape[1] // module.groups
    return [rows[:, g * og : (g + 1) * og] for g in range(module.groups)]


def one_hot_rows(module: nn.Embedding, tokens: torch.Tensor) -> torch.Tensor:
    return F.one_hot(tokens.reshape(-1), module.num_embeddings).double()


def factors(a_rows: torch.Tensor, g_rows: torch.Tensor, n: int, bias: bool, shared: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch factors ``A`` and ``G`` of one group's rows.

    ``shared``: the rows of a sample are positions sharing one weight (a
    convolution, ``S`` as above); otherwise (an embedding, a Linear layer on
    a sequence) ``A`` is the mean over all rows and ``G = n Σ g g^T``.
    """
    if bias:
        a_rows = torch.cat([a_rows, torch.ones(a_rows.shape[0], 1, dtype=a_rows.dtype)], dim=1)
    if not shared:
        return a_rows.T @ a_rows / a_rows.shape[0], n * g_rows.T @ g_rows
    s = a_rows.shape[0] // n
    a = a_rows / s
    gs = g_rows * (n * s)
    return a.T @ a / n, gs.T @ gs / (n * s)


def update(A: torch.Tensor, G: torch.Tensor, grad: torch.Tensor, damping: float, method: str) -> torch.Tensor:
    """The dense Kronecker solve for a ``g x a`` gradient (column-stacking vec)."""
    ia, ig = torch.eye(A.shape[0], dtype=A.dtype), torch.eye(G.shape[0], dtype=G.dtype)
    if method == "inverse":
        fisher = torch.kron(A + damping * ia, G + damping * ig)
    else:
        fisher = torch.kron(A, G) + damping * torch.eye(A.shape[0] * G.shape[0], dtype=A.dtype)
    sol = torch.linalg.solve(fisher, grad.T.reshape(-1))
    return sol.reshape(grad.shape[1], grad.shape[0]).T


def grouped_step(
    a_rows: list[torch.Tensor],
    g_rows: list[torch.Tensor],
    weight_grads: torch.Tensor,
    bias_grads: torch.Tensor | None,
    n: int,
    method: str,
    damping: float,
    decay: float,
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """One step's running factors (from the identity) and update per group, from the rows.

    ``weight_grads`` is ``(groups, g, a)`` (the autograd gradient as the rows'
    matrix, which ``Σ g ⊗ a`` must reproduce: checked), ``bias_grads``
    ``(groups, g)`` or None. Returns the stacked ``A`` and ``G`` blocks and
    each group's ``g x a`` update (bias as a last column).
    """
    a_blocks, g_blocks, updates = [], [], []
    for grp, (a, g) in enumerate(zip(a_rows, g_rows)):
        torch.testing.assert_close(g.T @ a, weight_grads[grp], rtol=1e-10, atol=1e-10)  # the rows are the layer's
        A, G = factors(a, g, n, bias_grads is not None)
        a_blocks.append(decay * torch.eye(A.shape[0], dtype=A.dtype) + (1 - decay) * A)
        g_blocks.append(decay * torch.eye(G.shape[0], dtype=G.dtype) + (1 - decay) * G)
        grad = weight_grads[grp] if bias_grads is None else torch.cat([weight_grads[grp], bias_grads[grp].unsqueeze(1)], dim=1)
        updates.append(update(a_blocks[-1], g_blocks[-1], grad, damping, method))
    return torch.stack(a_blocks), torch.stack(g_blocks), updates
