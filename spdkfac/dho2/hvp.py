"""Hessian-vector products of the training loss by double backward (Pearlmutter), averaged over workers."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..comm import CommBackend

__all__ = ["HessianVectorProduct", "flatten"]


def flatten(tensors: Sequence[torch.Tensor | None], like: Sequence[torch.Tensor]) -> torch.Tensor:
    """One vector of ``tensors`` in order (zeros where an entry is None, shaped as in ``like``)."""
    return torch.cat([(t if t is not None else torch.zeros_like(p)).reshape(-1) for t, p in zip(tensors, like)])


class HessianVectorProduct:
    """``v ↦ H v`` for the Hessian ``H`` of the mean loss over every worker's batch at the current parameters.

    Built from one worker's ``loss`` (the mean over its local batch, with its
    graph): the gradient is taken once with ``create_graph=True``, then each
    product is a second backward pass through it, ``∇(∇f · v)`` (Pearlmutter's
    R-operator, exact to rounding). With equal local batches the average of
    the workers' products, one all-reduce per call, is the product with the
    global batch's Hessian. Parameters the loss does not reach contribute
    zero rows.

    Args:
        loss: the local loss, a scalar with its autograd graph.
        params: the parameters, in the order of the flat vectors.
        backend: the engine that averages the products.
        name: the all-reduce's name (identical on every worker).
    """

    def __init__(self, loss: torch.Tensor, params: Sequence[torch.Tensor], backend: CommBackend, name: str = "spdkfac.dho2.hvp") -> None:
        if loss.dim() != 0:
            raise ValueError(f"the closure must return the scalar loss, got a tensor of shape {tuple(loss.shape)}")
        if not loss.requires_grad:
            raise ValueError("the closure's loss has no autograd graph: compute it with gradients enabled from the model's parameters")
        self.params = list(params)
        self.backend = backend
        self.name = name
        self.calls = 0
        with torch.enable_grad():
            grads = torch.autograd.grad(loss, self.params, create_graph=True, allow_unused=True)
        # Gradients that do not depend on the parameters (None, or constants) have zero second derivatives.
        self._live = [i for i, g in enumerate(grads) if g is not None and g.requires_grad]
        self._grads = [grads[i] for i in self._live]
        self.n = sum(p.numel() for p in self.params)

    def local(self, v: torch.Tensor) -> torch.Tensor:
        """This worker's product ``H_local v`` (no communication)."""
        if v.shape != (self.n,):
            raise ValueError(f"expected a vector of {self.n} entries, got shape {tuple(v.shape)}")
        if not self._grads:
            return torch.zeros_like(v)
        pieces = list(torch.split(v, [p.numel() for p in self.params]))
        outputs = [pieces[i].view_as(self.params[i]) for i in self._live]
        with torch.enable_grad():
            hv = torch.autograd.grad(self._grads, self.params, grad_outputs=outputs, retain_graph=True, allow_unused=True)
        return flatten(hv, self.params).detach()

    def __call__(self, v: torch.Tensor) -> torch.Tensor:
        """The product with the global batch's Hessian: every worker's ``H_local v`` averaged (one all-reduce)."""
        h = self.local(v)
        self.calls += 1
        if self.backend.size > 1:
            self.backend.allreduce_async(h, self.name).wait()
        return h
