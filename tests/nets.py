"""Small deterministic networks and data shared by the tests and the multi-process workers."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential


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
    """A one-layer ``nn.TransformerEncoder`` over the 6 rows of a 2x6x6 input (6 tokens of 12), mean-pooled, then Linear.

    ``sequence_first``: the encoder runs on ``(L, N, E)`` (torch's default layout), with the feed-forward's first
    bias frozen (a constant of its layer).
    """

    def __init__(self, sequence_first: bool = False) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(d_model=12, nhead=2, dim_feedforward=16, dropout=0.0, batch_first=not sequence_first)
        self.encoder = nn.TransformerEncoder(layer, num_layers=1, enable_nested_tensor=False)
        self.head = nn.Linear(12, 5)
        self.sequence_first = sequence_first
        if sequence_first:
            self.encoder.layers[0].linear1.bias.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.permute(0, 2, 1, 3).reshape(x.shape[0], 6, 12)
        if self.sequence_first:
            return self.head(self.encoder(tokens.transpose(0, 1)).mean(dim=0))
        return self.head(self.encoder(tokens).mean(dim=1))


def small_transformer(seed: int = 0, sequence_first: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    return SmallTransformer(sequence_first)


class MixedNet(nn.Module):
    """Every supported layer type on the 2x6x6 test input (5 classes).

    Embedding (tokens derived from the input), Conv2d with reflect padding,
    grouped Conv2d (no bias), depthwise Conv2d with channel multiplier 2,
    Conv1d with circular padding, a grouped ConvTranspose2d (stride 2), a
    Conv3d (strided, on the channels as depth) and a ConvTranspose1d (output
    padding, no bias) on side branches, and a Linear
    head; a GroupNorm and a LayerNorm stay on plain SGD (per-sample
    normalisations, so N workers equal one).
    """

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 3, padding_idx=0)
        self.conv = nn.Conv2d(2, 4, 3, padding=1, padding_mode="reflect")
        self.norm = nn.GroupNorm(2, 4)
        self.grouped = nn.Conv2d(4, 6, 3, padding=1, groups=2, bias=False)
        self.depthwise = nn.Conv2d(6, 12, 3, stride=2, padding=1, groups=6)
        self.conv1d = nn.Conv1d(12, 4, 3, padding=1, padding_mode="circular")
        self.up = nn.ConvTranspose2d(12, 4, 3, stride=2, padding=1, output_padding=1, groups=2)
        self.volume = nn.Conv3d(1, 4, (3, 2, 2), stride=(2, 1, 1), padding=(1, 0, 0))
        self.up1d = nn.ConvTranspose1d(4, 2, 3, stride=2, padding=1, output_padding=1, bias=False)
        self.ln = nn.LayerNorm(4 * 9)
        self.head = nn.Linear(4 * 9 + 3 + 4 + 2, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = (x[:, 0, 0, :].detach().abs() * 3).long().clamp(max=9)  # (n, 6) indices, some 0 (padding)
        e = self.embed(tokens).mean(dim=1)
        h = torch.tanh(self.norm(self.conv(x)))
        h = torch.tanh(self.grouped(h))
        h = torch.tanh(self.depthwise(h))  # (n, 12, 3, 3)
        u = torch.tanh(self.up(h)).mean(dim=(2, 3))  # (n, 4, 6, 6) -> (n, 4)
        u = u + torch.tanh(self.volume(h.unsqueeze(1))).mean(dim=(2, 3, 4))  # (n, 1, 12, 3, 3) -> (n, 4, 6, 2, 2) -> (n, 4)
        h = torch.tanh(self.conv1d(h.flatten(2)))  # (n, 4, 9)
        v = torch.tanh(self.up1d(h)).mean(dim=2)  # (n, 2, 18) -> (n, 2)
        return self.head(torch.cat([self.ln(h.flatten(1)), e, u, v], dim=1))


def mixed_net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return MixedNet()


#: How :class:`SharedNet` checkpoints its trunk: not at all, ``checkpoint`` or ``checkpoint_sequential``, each reentrant or not.
CHECKPOINTS = (None, "reentrant", "non-reentrant", "sequential-reentrant", "sequential")


class Recurrent(nn.Module):
    """``h <- tanh(cell(h))``, ``steps`` times: one Linear cell used at every step."""

    def __init__(self, cell: nn.Module, steps: int) -> None:
        super().__init__()
        self.cell, self.steps = cell, steps

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for _ in range(self.steps):
            h = torch.tanh(self.cell(h))
        return h


class SharedNet(nn.Module):
    """Layers used several times per step, an optional checkpointed trunk and a head that runs on some steps only.

    Two views of the 2x6x6 input (the image and its mirror) go through one
    convolutional encoder (a siamese pair); their sum through a trunk that
    applies one Linear cell three times (a recurrent cell) and then two
    ``nn.Linear`` modules tied to one weight and bias; a Linear head gives 5
    classes. With ``aux=True`` an auxiliary head on the first view's features
    joins (a layer that does not run in the other steps).
    """

    def __init__(self, checkpoint_mode: str | None = None) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.proj = nn.Linear(3 * 3 * 3, 6)
        up, tied = nn.Linear(6, 6), nn.Linear(6, 6)
        tied.weight, tied.bias = up.weight, up.bias
        # (each module once: checkpoint_sequential runs a Sequential's children(), which lists a repeated module once)
        self.trunk = nn.Sequential(Recurrent(nn.Linear(6, 6), 3), up, nn.Tanh(), tied, nn.Tanh())
        self.head = nn.Linear(6, 5)
        self.aux = nn.Linear(6, 5)
        self.checkpoint_mode = checkpoint_mode

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(nn.functional.avg_pool2d(torch.tanh(self.conv(x)), 2).flatten(1))

    def forward(self, x: torch.Tensor, aux: bool = False) -> torch.Tensor:
        f1, f2 = self.encode(x), self.encode(x.flip(-1))
        h, mode = f1 + f2, self.checkpoint_mode
        if mode is None:
            h = self.trunk(h)
        elif mode.startswith("sequential"):
            h = checkpoint_sequential(self.trunk, 2, h, use_reentrant=mode.endswith("-reentrant"))
        else:
            h = checkpoint(self.trunk, h, use_reentrant=mode == "reentrant")
        out = self.head(h)
        return out + self.aux(f1) if aux else out


def shared_net(seed: int = 0, checkpoint_mode: str | None = None) -> SharedNet:
    torch.manual_seed(seed)
    return SharedNet(checkpoint_mode)


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
    clip_synchronized: bool = True,
    attack_steps: int = 0,
    fast_fgsm: bool = False,
):
    """``steps`` optimizer steps; each step uses a different slice-preserving perturbation of the batch.

    With a GradScaler the loop is the mixed-precision one (``scaler.step`` may
    skip); ``poisoned`` maps a step to a boolean row mask of ``x`` whose samples
    get a NaN in that step, which makes every worker's averaged gradient NaN.
    ``clip`` clips the (averaged) gradient norm between backward and step, after ``opt.synchronize()`` unless
    ``clip_synchronized`` is False (the loop as written for torch.optim).
    ``accumulate`` splits each batch into that many equal micro-batches, each
    loss divided by their number (torch's gradient-accumulation idiom).
    ``skip_bad_loss`` skips a batch whose loss is not finite on some worker
    right after the forward pass (every worker at once, ``finite_everywhere``).
    ``attack_steps`` trains on a PGD attack of that many steps, crafted on the model in train mode
    (``torch.autograd.grad`` with respect to the input; the sign of each sample's own gradient).
    ``fast_fgsm`` trains on fast FGSM's attack as Wong et al.'s loop crafts it: ``backward()`` on the attack (the
    weights' gradients too), and the gradients cleared between the training pass's forward and its backward.
    """
    for s in range(steps):
        xs = x + 0.1 * s  # different data each step, same on every split of the batch
        for _ in range(attack_steps):
            xs.requires_grad_(True)
            (grad,) = torch.autograd.grad(nn.functional.cross_entropy(model(xs), y), xs)
            xs = (xs + 0.05 * grad.sign()).detach()
        if fast_fgsm:
            delta = torch.zeros_like(xs, requires_grad=True)
            nn.functional.cross_entropy(model(xs + delta), y).backward()
            assert delta.grad is not None
            xs = (xs + 0.05 * delta.grad.sign()).detach()
        if poisoned is not None and s in poisoned:
            xs = xs.clone()
            xs[poisoned[s], 0, 0, 0] = float("nan")
        if not fast_fgsm:
            opt.zero_grad()
        skipped = False
        for xm, ym in zip(xs.chunk(accumulate), y.chunk(accumulate)):
            out = model(xm)
            if fast_fgsm:
                opt.zero_grad()  # (after the forward pass, as in Wong et al.'s loop)
            loss = nn.functional.cross_entropy(out, ym) / accumulate
            if skip_bad_loss and not opt.finite_everywhere(loss):
                skipped = True
                break
            (loss if scaler is None else scaler.scale(loss)).backward()
        if skipped:
            continue
        if scaler is None:
            if clip is not None:
                if clip_synchronized:
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


def fully_sharded(model: nn.Module, hybrid: bool = False, offload: bool = False) -> nn.Module:
    """``fully_shard`` every child with parameters of its own, then the root (FSDP2's usage: tied parameters, in
    children of their own, go with the root). ``hybrid``: HSDP, on a mesh of replica groups of 2 workers;
    ``offload``: FSDP's CPU offloading (``CPUOffloadPolicy``, unpinned: no CUDA here)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    mesh = None
    if hybrid:
        world = torch.distributed.get_world_size()
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))

    policy = {"offload_policy": CPUOffloadPolicy(pin_memory=False)} if offload else {}
    seen: dict[int, int] = {}
    for child in model.children():
        for p in child.parameters():
            seen[id(p)] = seen.get(id(p), 0) + 1
    for child in model.children():
        params = list(child.parameters())
        if params and all(seen[id(p)] == 1 for p in params):
            fully_shard(child, mesh=mesh, **policy)
    fully_shard(model, mesh=mesh, **policy)
    return model


def assert_bitwise_equal(a, b, where: str) -> None:
    """Tensors (nested in dicts and lists) bitwise equal, with the path of the first difference."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{where} differs between ranks"
        assert a.dtype == b.dtype, f"{where} differs between ranks"
        assert torch.equal(a, b), f"{where} differs between ranks"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_bitwise_equal(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bitwise_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"
