"""An embedding tied to its output layer: one weight, two Kronecker terms, one Kronecker factor pair to precondition with.

A language model whose output layer reuses the token embedding's weight
(``lm_head.weight = wte.weight``: GPT-2, nanoGPT, T5, the small Llama 3.2 and
Gemma models) has one ``V x D`` weight used in two roles. Laid out as the
output layer's weight (a row per token), the embedding's Fisher is
``C ⊗ G_e`` (token counts; the Gram of its output gradients) and the output
layer's ``G_h ⊗ A_h`` (the Gram of the logits' gradients; the hidden
states' Gram). Their sum is not a Kronecker product, and the two uses put
an input statistic on the side where the other puts a gradient statistic,
so the rule for a module used twice (sum each side's statistics) would add
cross terms ``C ⊗ A_h`` and ``G_h ⊗ G_e`` as large as the terms themselves.

The weight is preconditioned with the nearest Kronecker product of the sum
instead (Van Loan & Pitsianis, 1993): ``X ⊗ Y`` minimising
``‖C⊗G_e + G_h⊗A_h − X⊗Y‖_F``. It is the best rank-one approximation of
the rearranged sum ``c ge^T + h ah^T`` (each factor flattened), so ``X``
lies in the span of ``C`` and ``G_h`` and ``Y`` in that of ``G_e`` and
``A_h``: with ``M_X``, ``M_Y`` the 2 x 2 Gram matrices of Frobenius inner
products of each side, ``X = P x`` with ``x`` the Perron vector of
``M_Y M_X``, and ``Y = Q M_X x / (x^T M_X x)``. Nothing larger than the
factors themselves is formed.

A Kronecker product leaves the split of scale between its factors free;
the inverse method's damping, added to each factor, does not. The split is
the geometric mean of the two terms' own splits ``‖X_k‖/‖Y_k‖``, weighted by
the terms' norms: exact at both ends (``X ⊗ Y = G_h ⊗ A_h`` to rounding as
the embedding's term vanishes, ``C ⊗ G_e`` as the output layer's does).
"""

from __future__ import annotations

import math

import torch

__all__ = ["nearest_kronecker_weights", "tied_factors"]


def _inner(x: torch.Tensor, y: torch.Tensor) -> float:
    """The Frobenius inner product of two factors in full form (a 1-D factor is a diagonal), over their common leading
    ``d x d`` block (the embedding's ``G`` is one narrower than an output layer's ``A`` with a bias column)."""
    d = min(x.shape[0], y.shape[0])
    x, y = x[:d, :d] if x.dim() == 2 else x[:d], y[:d, :d] if y.dim() == 2 else y[:d]
    if x.dim() == 1 and y.dim() == 1:
        return float(torch.dot(x.double(), y.double()))
    if x.dim() == 1 or y.dim() == 1:
        diagonal, matrix = (x, y) if x.dim() == 1 else (y, x)
        return float(torch.dot(diagonal.double(), matrix.diagonal().double()))
    return float((x.double() * y.double()).sum())


def _perron(m: tuple[tuple[float, float], tuple[float, float]]) -> tuple[float, float]:
    """The eigenvector of a non-negative 2 x 2 matrix for its largest eigenvalue, non-negative, summing to 1."""
    (a, b), (c, d) = m
    top = 0.5 * (a + d) + math.sqrt(0.25 * (a - d) ** 2 + b * c)
    candidates = [(b, top - a), (top - d, c)]  # (both solve it; the larger is the better conditioned)
    x1, x2 = max(candidates, key=lambda v: v[0] ** 2 + v[1] ** 2)
    total = x1 + x2
    if not total > 0.0:  # a multiple of the identity: every vector is one
        return 0.5, 0.5
    return max(x1, 0.0) / total, max(x2, 0.0) / total


def nearest_kronecker_weights(
    gram_x: tuple[tuple[float, float], tuple[float, float]], gram_y: tuple[tuple[float, float], tuple[float, float]]
) -> tuple[tuple[float, float], tuple[float, float]]:
    """``(α, β)``: ``X = α_1 X_1 + α_2 X_2``, ``Y = β_1 Y_1 + β_2 Y_2`` is the nearest Kronecker product to
    ``X_1 ⊗ Y_1 + X_2 ⊗ Y_2``, with the split of scale described in the module's docstring.

    ``gram_x[i][j] = <X_i, X_j>`` and ``gram_y[i][j] = <Y_i, Y_j>`` (Frobenius).
    """
    (p11, p12), (_, p22) = gram_x
    (q11, q12), (_, q22) = gram_y
    product = ((q11 * p11 + q12 * p12, q11 * p12 + q12 * p22), (q12 * p11 + q22 * p12, q12 * p12 + q22 * p22))
    x1, x2 = _perron(product)
    mx = (p11 * x1 + p12 * x2, p12 * x1 + p22 * x2)  # M_X x
    norm_x2 = x1 * mx[0] + x2 * mx[1]  # ‖X‖² for X = P x
    if not norm_x2 > 0.0:
        raise ValueError("tied factors: the vocabulary side (the token counts and the output layer's G) is zero or not finite")
    b1, b2 = mx[0] / norm_x2, mx[1] / norm_x2
    norm_y2 = b1 * b1 * q11 + 2 * b1 * b2 * q12 + b2 * b2 * q22
    # The split: ‖X‖/‖Y‖ the terms' own ratios' geometric mean, weighted by the terms' norms ‖X_k‖‖Y_k‖.
    terms = [(math.sqrt(p11 * q11), 0.5 * math.log(p11 / q11) if p11 > 0 and q11 > 0 else 0.0)]
    terms.append((math.sqrt(p22 * q22), 0.5 * math.log(p22 / q22) if p22 > 0 and q22 > 0 else 0.0))
    weight = sum(w for w, _ in terms)
    log_ratio = sum(w * r for w, r in terms) / weight if weight > 0 else 0.0
    # t scales X and 1/t scales Y: ‖tX‖/‖Y/t‖ = t² ‖X‖/‖Y‖ = exp(log_ratio).
    t = math.sqrt(math.exp(log_ratio) * math.sqrt(norm_y2 / norm_x2)) if norm_y2 > 0 else 1.0
    return (t * x1, t * x2), (b1 / t, b2 / t)


def _as_form(factor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``factor`` in the form of ``like``: diagonal (1-D) or dense, zero-padded or cut to its size."""
    dim = like.shape[0]
    if like.dim() == 1:
        out = factor.diagonal() if factor.dim() == 2 else factor
        return out[:dim] if out.shape[0] >= dim else torch.cat([out, out.new_zeros(dim - out.shape[0])])
    out = torch.diag(factor) if factor.dim() == 1 else factor
    if out.shape[0] >= dim:
        return out[:dim, :dim]
    padded = out.new_zeros(dim, dim)
    padded[: out.shape[0], : out.shape[0]] = out
    return padded


def tied_factors(
    counts: torch.Tensor, embedding_g: torch.Tensor, output_g: torch.Tensor, output_a: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(X, Y)``: the output layer's ``G`` and ``A`` to precondition the tied weight with (the nearest Kronecker
    product to ``C ⊗ G_e + G_h ⊗ A_h``), in the forms of ``output_g`` and ``output_a``.

    All four in full form (a 1-D tensor is a diagonal): ``counts`` the embedding's ``A`` (``V``), ``embedding_g`` its
    ``G`` (``D``), ``output_g`` the output layer's ``G`` (``V``), ``output_a`` its ``A`` (``D``, or ``D + 1`` with a bias
    column, where the embedding contributes nothing).
    """
    gram_x = ((_inner(counts, counts), _inner(counts, output_g)), (_inner(counts, output_g), _inner(output_g, output_g)))
    cross_y = _inner(embedding_g, output_a)
    gram_y = ((_inner(embedding_g, embedding_g), cross_y), (cross_y, _inner(output_a, output_a)))
    (a1, a2), (b1, b2) = nearest_kronecker_weights(gram_x, gram_y)
    x = _as_form(counts, output_g).mul(a1).add_(output_g, alpha=a2)
    y = _as_form(embedding_g, output_a).mul(b1).add_(output_a, alpha=b2)
    return x, y
