"""ConvNeXt-T and ViT-S/16, written with ``torch.nn`` only (LayerNorm, ``nn.MultiheadAttention``, Linear on tokens).

* :func:`convnext_t` -- ConvNeXt-T (Liu et al. 2022): a 4x4 patchify stem,
  stages of depth (3, 3, 9, 3) and width (96, 192, 384, 768), each block a
  depthwise 7x7 convolution, LayerNorm, an inverted MLP (Linear 4x, GELU,
  Linear) on channels-last tokens and a learned per-channel layer scale;
  28,589,128 parameters for 1000 classes (no stochastic depth).
* :func:`vit_s16` -- ViT-S/16 (Dosovitskiy et al. 2021; the DeiT-S shape):
  16x16 patches, a class token and learned position embeddings, 12 pre-norm
  blocks of width 384 with 6-head ``nn.MultiheadAttention`` and an MLP of
  1536; 22,050,664 parameters for 1000 classes (no dropout).

:func:`mnist_vit` is a two-block ViT for 28x28 MNIST (the attention benchmark's); :func:`char_gpt` a
causal character-level language model of the same blocks (``--data pycode``).
``small_input=True`` gives the 32x32 versions: ConvNeXt with a 3x3 stride-1
stem (its stages see 32, 16, 8 and 4), ViT with 4x4 patches (64 tokens and
the class token). K-FAC preconditions every convolution, every Linear and
every attention module (q, k, v and ``out_proj``); the norms, the layer
scales, the class token and the position embeddings get the base update
(``SPDKFACOptimizer.kfac_summary()`` lists them): under 0.5% of the parameters.
"""

from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["CharGPT", "ConvNeXt", "VisionTransformer", "char_gpt", "convnext_t", "mnist_vit", "vit_s16"]


def _init_transformer(model: nn.Module) -> nn.Module:
    """Truncated-normal (std 0.02) convolutions and Linear layers with zero biases; unit/zero LayerNorms."""
    for m in model.modules():
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            nn.init.trunc_normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
    return model


# --------------------------------------------------------------------------- ConvNeXt
class ChannelsFirstLayerNorm(nn.LayerNorm):
    """LayerNorm over the channels of an ``(N, C, H, W)`` map (ConvNeXt's stem and downsampling layers)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        return out


class ConvNeXtBlock(nn.Module):
    """Depthwise 7x7, LayerNorm, Linear(C, 4C), GELU, Linear(4C, C) on channels-last tokens, layer scale, residual."""

    def __init__(self, dim: int, layer_scale: float = 1e-6) -> None:
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), layer_scale))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h: torch.Tensor = self.dwconv(x).permute(0, 2, 3, 1)  # (N, H, W, C): the Linear layers see H*W tokens per sample
        h = self.pwconv2(self.act(self.pwconv1(self.norm(h))))
        return x + (self.gamma * h).permute(0, 3, 1, 2)


class ConvNeXt(nn.Module):
    """ConvNeXt: a stem, four stages separated by LayerNorm + 2x2 stride-2 convolutions, pooled LayerNorm, Linear head."""

    def __init__(
        self,
        depths: tuple[int, ...] = (3, 3, 9, 3),
        dims: tuple[int, ...] = (96, 192, 384, 768),
        num_classes: int = 1000,
        small_input: bool = False,
    ) -> None:
        super().__init__()
        stem = nn.Conv2d(3, dims[0], 3, padding=1) if small_input else nn.Conv2d(3, dims[0], 4, stride=4)
        self.downsample = nn.ModuleList([nn.Sequential(stem, ChannelsFirstLayerNorm(dims[0], eps=1e-6))])
        for i in range(1, len(dims)):
            self.downsample.append(
                nn.Sequential(ChannelsFirstLayerNorm(dims[i - 1], eps=1e-6), nn.Conv2d(dims[i - 1], dims[i], 2, stride=2))
            )
        self.stages = nn.ModuleList(nn.Sequential(*(ConvNeXtBlock(dim) for _ in range(depth))) for depth, dim in zip(depths, dims))
        self.norm = nn.LayerNorm(dims[-1], eps=1e-6)
        self.head = nn.Linear(dims[-1], num_classes)
        _init_transformer(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for down, stage in zip(self.downsample, self.stages):
            x = stage(down(x))
        out: torch.Tensor = self.head(self.norm(x.mean(dim=(2, 3))))
        return out


def convnext_t(num_classes: int = 1000, small_input: bool = False) -> nn.Module:
    """ConvNeXt-T (28.6M parameters for 1000 classes)."""
    return ConvNeXt((3, 3, 9, 3), (96, 192, 384, 768), num_classes, small_input)


# --------------------------------------------------------------------------- ViT
class EncoderBlock(nn.Module):
    """Pre-norm transformer block: x + MHA(LN(x)), then x + MLP(LN(x)) with GELU."""

    def __init__(self, dim: int, heads: int, mlp_dim: int, causal: bool = False) -> None:
        super().__init__()
        self.causal = causal  # each token attends to itself and those before it (a language model's)
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(dim, mlp_dim), nn.GELU(), nn.Linear(mlp_dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        if self.causal:
            mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device).triu(1)  # True: not attended
            x = x + self.attn(h, h, h, need_weights=False, attn_mask=mask, is_causal=True)[0]
        else:
            x = x + self.attn(h, h, h, need_weights=False)[0]
        out: torch.Tensor = x + self.mlp(self.norm2(x))
        return out


class VisionTransformer(nn.Module):
    """ViT: patches by a strided convolution, a class token, learned position embeddings, encoder blocks, LN, Linear head."""

    def __init__(
        self,
        image_size: int = 224,
        patch: int = 16,
        dim: int = 384,
        depth: int = 12,
        heads: int = 6,
        mlp_dim: int = 1536,
        num_classes: int = 1000,
        in_channels: int = 3,
    ) -> None:
        super().__init__()
        if image_size % patch:
            raise ValueError(f"image size {image_size} is not a multiple of the patch size {patch}")
        tokens = (image_size // patch) ** 2
        self.image_size = image_size
        self.patch_embed = nn.Conv2d(in_channels, dim, patch, stride=patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, tokens + 1, dim))
        self.blocks = nn.Sequential(*(EncoderBlock(dim, heads, mlp_dim) for _ in range(depth)))
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, num_classes)
        _init_transformer(self)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.trunc_normal_(self.cls_token, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-2:] != (self.image_size, self.image_size):
            raise ValueError(f"this ViT takes {self.image_size}x{self.image_size} images (position embeddings), got {tuple(x.shape[-2:])}")
        tokens = self.patch_embed(x).flatten(2).transpose(1, 2)  # (N, patches, dim)
        tokens = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), tokens], dim=1) + self.pos_embed
        out: torch.Tensor = self.head(self.norm(self.blocks(tokens))[:, 0])
        return out


def vit_s16(num_classes: int = 1000, small_input: bool = False) -> nn.Module:
    """ViT-S/16 (22.1M parameters for 1000 classes); ``small_input``: 32x32 images in 4x4 patches."""
    if small_input:
        return VisionTransformer(image_size=32, patch=4, num_classes=num_classes)
    return VisionTransformer(num_classes=num_classes)


def mnist_vit(num_classes: int = 10) -> nn.Module:
    """A small ViT for 1x28x28 MNIST: 7x7 patches (16 tokens and the class token), width 64, 2 blocks of 4 heads, MLP 128."""
    return VisionTransformer(image_size=28, patch=7, dim=64, depth=2, heads=4, mlp_dim=128, num_classes=num_classes, in_channels=1)


# --------------------------------------------------------------------------- a character-level language model
class CharGPT(nn.Module):
    """A GPT of the ViT's blocks made causal: token and position embeddings (``nn.Embedding``), pre-norm blocks, LN and
    an untied Linear head. Takes ``(N, T)`` ids and returns ``(N, vocab, T)`` logits, the layout ``cross_entropy``
    and ``argmax(1)`` read per position."""

    def __init__(self, vocab: int, context: int = 64, dim: int = 128, depth: int = 2, heads: int = 4, mlp_dim: int = 512) -> None:
        super().__init__()
        self.context = context
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Embedding(context, dim)
        self.blocks = nn.Sequential(*(EncoderBlock(dim, heads, mlp_dim, causal=True) for _ in range(depth)))
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, vocab)
        _init_transformer(self)
        nn.init.normal_(self.tokens.weight, std=0.02)
        nn.init.normal_(self.positions.weight, std=0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.shape[1] > self.context:
            raise ValueError(f"this model takes up to {self.context} tokens (position embeddings), got {ids.shape[1]}")
        # Positions looked up per sample (N, T), not once as (T,) and broadcast over the batch: K-FAC then sees each
        # sample's gradient (a broadcast sum is one sample's, and differs with the workers' split of the batch).
        positions = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
        h = self.tokens(ids) + self.positions(positions)
        out: torch.Tensor = self.head(self.norm(self.blocks(h))).transpose(1, 2)
        return out


def char_gpt(num_classes: int = 97) -> nn.Module:
    """A small causal character-level GPT (``--data pycode``: 97 characters, 64 of context): width 128, 2 blocks of 4
    heads, MLP 512."""
    return CharGPT(num_classes)
