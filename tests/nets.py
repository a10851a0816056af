"""Small deterministic networks and data shared by the tests and the multi-process workers."""

from __future__ import annotations

import torch
import torch.nn as nn


def small_net(seed: int = 0) -> nn.Module:
    """Conv2d (bias) -> ReLU -> Conv2d (no bias, stride 2) -> Linear -> Tanh -> Linear; no BatchNorm."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(3, 4, 2, stride=2, bias=False),
        nn.Flatten(),
        nn.Linear(4 * 3 * 3, 7),
        nn.Tanh(),
        nn.Linear(7, 5, bias=False),
    )


class SmallTransformer(nn.Module):
    """A one-layer ``nn.TransformerEncoder`` over the 6 rows of a 2x6x6 input (6 tokens of 12), mean-pooled, then Linear."""

    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(d_model=12, nhead=2, dim_feedforward=16, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=1, enable_nested_tensor=False)
        self.head = nn.Linear(12, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.permute(0, 2, 1, 3).reshape(x.shape[0], 6, 12)
        return self.head(self.encoder(tokens).mean(dim=1))


def small_transformer(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return SmallTransformer()


def batch(n: int, seed: int = 1):
    """A fixed global batch of ``n`` samples (2x6x6 inputs, 5 classes)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2, 6, 6, generator=g)
    y = torch.randint(0, 5, (n,), generator=g)
    return x, y


def train(
    model: nn.Module,
    opt,
    x: torch.Tensor,
    y: torch.Tensor,
    steps: int,
    scaler=None,
    poisoned=None,
    clip=None,
    accumulate: int = 1,
    skip_bad_loss: bool = False,
):
    """``steps`` optimizer steps; each step uses a different slice-preserving perturbation of the batch.

    With a GradScaler the loop is the mixed-precision one (``scaler.step`` may
    skip); ``poisoned`` maps a step to a boolean row mask of ``x`` whose samples
    get a NaN in that step, which makes every worker's averaged gradient NaN.
    ``clip`` clips the (averaged) gradient norm between backward and step.
    ``accumulate`` splits each batch into that many equal micro-batches, each
    loss divided by their number (torch's gradient-accumulation idiom).
    ``skip_bad_loss`` skips a batch whose loss is not finite on some worker
    right after the forward pass (every worker at once, ``finite_everywhere``).
    """
    for s in range(steps):
        xs = x + 0.1 * s  # different data each step, same on every split of the batch
        if poisoned is not None and s in poisoned:
            xs = xs.clone()
            xs[poisoned[s], 0, 0, 0] = float("nan")
        opt.zero_grad()
        skipped = False
        for xm, ym in zip(xs.chunk(accumulate), y.chunk(accumulate)):
            loss = nn.functional.cross_entropy(model(xm), ym) / accumulate
            if skip_bad_loss and not opt.finite_everywhere(loss):
                skipped = True
                break
            (loss if scaler is None else scaler.scale(loss)).backward()
        if skipped:
            continue
        if scaler is None:
            if clip is not None:
                opt.synchronize()
                nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
    return model


def dho2_net(seed: int = 0) -> nn.Module:
    """A tanh MLP small enough for explicit Hessians (43 parameters): DHO2's tests."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))


def dho2_batch(n: int = 24, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed float64 global batch for :func:`dho2_net` (4 features, 3 classes)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g)
