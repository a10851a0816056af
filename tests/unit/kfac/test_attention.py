"""``nn.MultiheadAttention`` preconditioned: q, k, v and ``out_proj`` as four Linear layers (float64).

Three checks, each independent of the others:

* the explicit forward the attention module runs under K-FAC equals torch's
  own (outputs, attention weights, every gradient) for every option;
* a K-FAC step on a model with ``nn.MultiheadAttention`` gives the parameters
  and factors of the same model written with four ``nn.Linear`` projections;
* the factors and the update equal a reference written from the definitions
  (input rows and autograd's output gradients of each projection, a dense
  Kronecker solve), and N in-process workers equal one with bitwise replicas.
"""

from __future__ import annotations

import copy
import math
import pickle

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from layer_reference import factors, update
from nets import batch, small_transformer
from torch.utils._python_dispatch import TorchDispatchMode

from spdkfac import SPDKFACOptimizer
from spdkfac.comm.inprocess import run_ranks
from spdkfac.kfac.layer_types.attention import ExplicitAttention, explicit_attention, project, projection_rows
from spdkfac.kfac.layer_types.linear import LinearHelper
from spdkfac.kfac.layer_types.shared_input import SharedInputGram

pytestmark = pytest.mark.filterwarnings("ignore:no perf_model given")

E, H, L, S, N = 8, 2, 5, 4, 3
KDIM, VDIM = 6, 7
DAMPING, DECAY = 0.05, 0.5


def _mha(batch_first=True, bias=True, kdim=None, vdim=None, **kw) -> nn.MultiheadAttention:
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, H, batch_first=batch_first, bias=bias, kdim=kdim, vdim=vdim, **kw)
    with torch.no_grad():  # torch zeroes the biases: make them count
        for name, p in mha.named_parameters():
            if "bias" in name:
                p.normal_(0, 0.3)
    return mha


# name: (constructor options, inputs kind, forward options); masks are built per case below
CASES = {
    "self": (dict(), "self", dict()),
    "self-seq-first": (dict(batch_first=False), "self", dict()),
    "self-no-bias-no-weights": (dict(bias=False), "self", dict(need_weights=False)),
    "cross-kv": (dict(), "kv", dict(average_attn_weights=False)),
    "cross-all-different": (dict(batch_first=False), "cross", dict()),
    "kdim-vdim": (dict(kdim=KDIM, vdim=VDIM), "cross", dict()),
    "kdim-vdim-seq-first-sdpa": (dict(kdim=KDIM, vdim=VDIM, batch_first=False), "cross", dict(need_weights=False)),
    "padding-bool": (dict(), "kv", dict(padding="bool")),
    "padding-float-sdpa": (dict(batch_first=False), "cross", dict(padding="float", need_weights=False)),
    "mask-2d-bool": (dict(), "kv", dict(mask="2d-bool")),
    "mask-3d-float-padding": (dict(), "cross", dict(mask="3d-float", padding="float")),
    "mask-3d-sdpa": (dict(), "cross", dict(mask="3d-float", need_weights=False)),
    "causal-sdpa": (dict(), "self", dict(mask="causal", is_causal=True, need_weights=False)),
    "causal-weights": (dict(batch_first=False), "self", dict(mask="causal", is_causal=True)),
    "causal-padding": (dict(), "self", dict(mask="causal", is_causal=True, padding="bool", need_weights=False)),
    "bias-kv": (dict(add_bias_kv=True), "kv", dict(padding="bool", mask="2d-bool")),
    "zero-attn": (dict(add_zero_attn=True, batch_first=False), "cross", dict(mask="3d-float", padding="bool")),
    "bias-kv-zero-attn-sdpa": (dict(add_bias_kv=True, add_zero_attn=True), "self", dict(need_weights=False, padding="bool")),
    "unbatched": (dict(), "cross", dict(padding="bool")),
}


def _inputs(mha: nn.MultiheadAttention, kind: str, unbatched: bool = False, seed: int = 1):
    """query, key, value (``kind``: one tensor, key is value, or three), batch-first or not as the module wants."""
    g = torch.Generator().manual_seed(seed)
    src = L if kind == "self" else S
    q = torch.randn(N, L, E, generator=g)
    k = q if kind == "self" else torch.randn(N, src, mha.kdim, generator=g)
    v = k if kind in ("self", "kv") else torch.randn(N, src, mha.vdim, generator=g)
    if unbatched:
        return q[0], k[0], v[0]
    if not mha.batch_first:
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))
    return q, k, v


def _masks(opts: dict, src: int, batch: int = N) -> dict:
    """The forward's keyword arguments, masks built (a padded key never covers a whole row)."""
    kw = {k: v for k, v in opts.items() if k not in ("padding", "mask")}
    g = torch.Generator().manual_seed(2)
    if opts.get("padding"):
        pad = torch.zeros(batch, src, dtype=torch.bool)
        pad[0, -1] = pad[-1, 0] = True
        kw["key_padding_mask"] = pad if opts["padding"] == "bool" else torch.zeros(batch, src).masked_fill(pad, -1e9)
    mask = opts.get("mask")
    if mask == "2d-bool":
        kw["attn_mask"] = torch.rand(L, src, generator=g) > 0.7
        kw["attn_mask"][:, 1] = False
    elif mask == "3d-float":
        kw["attn_mask"] = torch.randn(batch * H, L, src, generator=g)
    elif mask == "causal":
        kw["attn_mask"] = nn.Transformer.generate_square_subsequent_mask(L, dtype=torch.get_default_dtype())  # (torch 2.4: float32)
    return kw


@pytest.mark.parametrize("case", list(CASES))
def test_explicit_forward_equals_torchs_forward_and_gradients(case, float64):
    options, kind, opts = CASES[case]
    unbatched = case == "unbatched"
    results = []
    for explicit in (False, True):
        mha = _mha(**options)
        q, k, v = (t.clone().requires_grad_() for t in _inputs(mha, kind, unbatched))
        if kind == "self":
            k = v = q
        elif kind == "kv":
            v = k
        src = k.shape[-2] if unbatched or mha.batch_first else k.shape[0]
        kw = _masks(opts, src + 0, batch=1 if unbatched else N)
        if unbatched and "key_padding_mask" in kw:
            kw["key_padding_mask"] = kw["key_padding_mask"][0]
        if explicit:
            out, weights = explicit_attention(mha, ExplicitAttention(mha).projections, q, k, v, **kw)
        else:
            out, weights = nn.MultiheadAttention.forward(mha, q, k, v, **kw)
        g = torch.Generator().manual_seed(5)
        loss = (out * torch.randn(out.shape, generator=g)).sum()
        if weights is not None:
            loss = loss + (weights * torch.randn(weights.shape, generator=g)).sum()
        loss.backward()
        grads = {name: p.grad for name, p in mha.named_parameters()}
        grads.update(query=q.grad, key=k.grad, value=v.grad)
        results.append((out, weights, grads))
    (out0, w0, g0), (out1, w1, g1) = results
    # NaN where torch gives NaN: on torch 2.4 a query whose keys are all masked (causal-padding) gets a NaN row.
    torch.testing.assert_close(out1, out0, rtol=1e-12, atol=1e-12, equal_nan=True)
    assert (w0 is None) == (w1 is None)
    if w0 is not None:
        torch.testing.assert_close(w1, w0, rtol=1e-12, atol=1e-12, equal_nan=True)
    assert g0.keys() == g1.keys()
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-10, atol=1e-12, equal_nan=True, msg=lambda m, n=name: f"{n}: {m}")


# -- the same model with nn.Linear projections ----------------------------------------------------------------------------------
class LinearAttention(nn.Module):
    """Multi-head attention written with four ``nn.Linear`` layers on batch-first tokens (no spdkfac code)."""

    def __init__(self, mha: nn.MultiheadAttention) -> None:
        super().__init__()
        bias = mha.in_proj_bias is not None
        self.batch_first = mha.batch_first
        self.q_proj = nn.Linear(E, E, bias=bias)
        self.k_proj = nn.Linear(mha.kdim, E, bias=bias)
        self.v_proj = nn.Linear(mha.vdim, E, bias=bias)
        self.out_proj = nn.Linear(E, E, bias=bias)
        with torch.no_grad():
            weights = mha.in_proj_weight.chunk(3) if mha._qkv_same_embed_dim else (mha.q_proj_weight, mha.k_proj_weight, mha.v_proj_weight)
            for lin, w, i in zip((self.q_proj, self.k_proj, self.v_proj), weights, range(3)):
                lin.weight.copy_(w)
                if bias:
                    lin.bias.copy_(mha.in_proj_bias[i * E : (i + 1) * E])
            self.out_proj.weight.copy_(mha.out_proj.weight)
            if bias:
                self.out_proj.bias.copy_(mha.out_proj.bias)

    def forward(self, query, key, value, key_padding_mask=None):
        if not self.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        n, tgt = query.shape[:2]
        q, k, v = (proj(x) for proj, x in zip((self.q_proj, self.k_proj, self.v_proj), (query, key, value)))
        q, k, v = (t.reshape(n, t.shape[1], H, E // H).transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(E // H)
        if key_padding_mask is not None:
            scores = scores.masked_fill(key_padding_mask.view(n, 1, 1, -1), float("-inf"))
        out = self.out_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(n, tgt, E))
        return out if self.batch_first else out.transpose(0, 1)


class AttentionNet(nn.Module):
    """Tokens (and a second, cross-attended sequence) -> attention -> tanh -> mean -> Linear head."""

    def __init__(self, attn: nn.Module, kind: str, kdim: int, vdim: int) -> None:
        super().__init__()
        self.attn, self.kind = attn, kind
        self.batch_first = getattr(attn, "batch_first", True)
        self.embed = nn.Linear(4, E)
        self.kv = nn.Linear(4, max(kdim, vdim)) if kind != "self" else None
        self.head = nn.Linear(E, 3)
        self.kdim, self.vdim = kdim, vdim

    def forward(self, x: torch.Tensor, padding: torch.Tensor | None = None) -> torch.Tensor:
        tokens = torch.tanh(self.embed(x))  # (N, L, E)
        key = value = tokens
        if self.kv is not None:
            memory = torch.tanh(self.kv(x[:, :S] * 0.5))  # (N, S, max(kdim, vdim))
            key, value = memory[..., : self.kdim], memory[..., : self.vdim]
        if not self.batch_first:
            tokens, key, value = (t.transpose(0, 1) for t in (tokens, key, value))
        if self.kv is None:
            key = value = tokens  # self-attention: one tensor, as torch's fast paths want
        elif self.kind == "kv":
            value = key  # cross-attention to one memory: k and v are one product
        out = self.attn(tokens, key, value, key_padding_mask=padding)
        out = out[0] if isinstance(out, tuple) else out
        out = out if self.batch_first else out.transpose(0, 1)
        return self.head(torch.tanh(out).mean(dim=1))


def _nets(batch_first: bool, bias: bool, kind: str, kdim: int | None):
    mha = _mha(batch_first=batch_first, bias=bias, kdim=kdim, vdim=VDIM if kdim else None)
    torch.manual_seed(7)
    mine = AttentionNet(mha, kind, mha.kdim, mha.vdim)
    ref = AttentionNet(LinearAttention(mha), kind, mha.kdim, mha.vdim)
    ref.load_state_dict({k: v for k, v in mine.state_dict().items() if not k.startswith("attn.")}, strict=False)
    return mine, ref


def _data(kind: str):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, L, 4, generator=g)
    y = torch.randint(0, 3, (6,), generator=g)
    src = L if kind == "self" else S
    padding = torch.zeros(6, src, dtype=torch.bool)
    padding[1, -1] = padding[4, :2] = True
    return x, y, padding


def _train(model: nn.Module, opt, x, y, padding, steps: int) -> None:
    for s in range(steps):
        opt.zero_grad()
        F.cross_entropy(model(x + 0.1 * s, padding), y).backward()
        opt.step()


KW = dict(lr=0.1, momentum=0.9, weight_decay=1e-3, damping=0.01, factor_decay=0.9, kl_clip=0.01, backend="single")


@pytest.mark.parametrize(
    ("batch_first", "bias", "kind", "kdim", "method"),
    [
        (True, True, "self", None, "inverse"),
        (False, True, "self", None, "eigen"),
        (True, False, "cross", None, "inverse"),
        (False, True, "cross", KDIM, "inverse"),
        (True, True, "cross", KDIM, "ekfac"),
        (False, True, "kv", None, "eigen"),
    ],
)
def test_kfac_step_equals_the_model_with_linear_projections(batch_first, bias, kind, kdim, method, float64):
    mine, ref = _nets(batch_first, bias, kind, kdim)
    x, y, padding = _data(kind)
    opts = [SPDKFACOptimizer(net, compute_method=method, **KW) for net in (mine, ref)]
    assert [la.name for la in opts[0].layers] == [la.name for la in opts[1].layers]
    assert "attn.q_proj" in [la.name for la in opts[0].layers]
    for net, opt in zip((mine, ref), opts):
        _train(net, opt, x, y, padding, steps=3)
    for a, b in zip(opts[0].layers, opts[1].layers):
        for kind_ in ("A", "G"):
            torch.testing.assert_close(a.factor(kind_), b.factor(kind_), rtol=1e-10, atol=1e-12, msg=lambda m, n=a.name: f"{n}: {m}")
    attn, lin = mine.attn, ref.attn
    weights = attn.in_proj_weight.chunk(3) if attn._qkv_same_embed_dim else (attn.q_proj_weight, attn.k_proj_weight, attn.v_proj_weight)
    for i, proj in enumerate((lin.q_proj, lin.k_proj, lin.v_proj)):
        torch.testing.assert_close(weights[i], proj.weight, rtol=1e-9, atol=1e-11)
        if bias:
            torch.testing.assert_close(attn.in_proj_bias[i * E : (i + 1) * E], proj.bias, rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(attn.out_proj.weight, lin.out_proj.weight, rtol=1e-9, atol=1e-11)
    for name in ("embed.weight", "head.weight", "head.bias") + (("kv.weight",) if kind != "self" else ()):
        torch.testing.assert_close(mine.state_dict()[name], ref.state_dict()[name], rtol=1e-9, atol=1e-11)
    assert not torch.equal(mine.head.weight, _nets(batch_first, bias, kind, kdim)[0].head.weight)  # it trained


@pytest.mark.parametrize(
    ("batch_first", "kind", "kdim", "grams"),
    [(True, "self", None, 1), (False, "self", None, 1), (True, "cross", None, 2), (False, "cross", KDIM, 3)],
    ids=["self", "self-sequence-first", "cross-key-is-value", "cross-kdim-vdim"],
)
def test_q_k_and_v_of_one_input_compute_its_gram_once_and_step_bitwise_alike(batch_first, kind, kdim, grams, monkeypatch):
    """Self-attention's q, k and v read one tensor: one Gram for their three A, and the steps of three apart."""
    computed: list[int] = []
    compute = LinearHelper._input_gram

    def counted(helper, x, dtype):
        computed.append(x.shape[-1])
        return compute(helper, x, dtype)

    def train(share: bool) -> tuple[list[torch.Tensor], list[int]]:
        computed.clear()
        with monkeypatch.context() as patch:
            patch.setattr(LinearHelper, "_input_gram", counted)
            if not share:
                patch.setattr(SharedInputGram, "gram", lambda self, x, dtype, ones, compute: compute())
            mine, _ = _nets(batch_first, True, kind, kdim)
            opt = SPDKFACOptimizer(mine, **KW)
            _train(mine, opt, *_data(kind), steps=3)
        return [p.detach().clone() for p in mine.parameters()], list(computed)

    shared, calls_shared = train(True)
    apart, calls_apart = train(False)
    for a, b in zip(shared, apart, strict=True):
        assert torch.equal(a, b)
    others = 4 if kind == "cross" else 3  # embed, out_proj, head (and kv): one Gram each per step
    assert len(calls_apart) == 3 * (3 + others)
    assert len(calls_shared) == 3 * (grams + others)


# -- reference from the definitions -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["inverse", "eigen"])
@pytest.mark.parametrize("kdim", [None, KDIM])
def test_factors_and_update_match_the_definition(kdim, method, float64):
    """One step on a lone cross-attention module: each projection is a Linear layer on its input rows."""
    mha = _mha(batch_first=False, kdim=kdim, vdim=VDIM if kdim else None)
    q_in, k_in, v_in = _inputs(mha, "cross")  # (len, N, dim)
    padding = torch.zeros(N, S, dtype=torch.bool)
    padding[0, 1] = True
    opt = SPDKFACOptimizer(
        mha, lr=1.0, momentum=0.0, damping=DAMPING, factor_decay=DECAY, kl_clip=None, backend="single", compute_method=method
    )
    out, _ = mha(q_in, k_in, v_in, key_padding_mask=padding, need_weights=False)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(9))
    ((out * weights).sum() / N).backward()  # a batch-mean loss
    grads = {name: p.grad.clone() for name, p in mha.named_parameters()}
    before = {name: p.detach().clone() for name, p in mha.named_parameters()}
    opt.step()
    change = {name: before[name] - p.detach() for name, p in mha.named_parameters()}

    # Reference: the projections by hand from the parameters, their output gradients from autograd.
    w = [before["in_proj_weight"][i * E : (i + 1) * E] for i in range(3)] if kdim is None else [before[f"{c}_proj_weight"] for c in "qkv"]
    b = before["in_proj_bias"].chunk(3)
    ins = [t.transpose(0, 1).reshape(-1, t.shape[-1]) for t in (q_in, k_in, v_in)]  # rows, sample-major
    projected = [(x @ wi.T + bi).requires_grad_() for x, wi, bi in zip(ins, w, b)]
    q, k, v = (p.reshape(N, -1, H, E // H).transpose(1, 2) for p in projected)
    scores = (q @ k.transpose(-2, -1) / math.sqrt(E // H)).masked_fill(padding.view(N, 1, 1, S), float("-inf"))
    context = (scores.softmax(-1) @ v).transpose(1, 2).reshape(-1, E).detach().requires_grad_()
    ref_out = (context @ before["out_proj.weight"].T + before["out_proj.bias"]).reshape(N, L, E).transpose(0, 1)
    torch.testing.assert_close(ref_out, out.detach(), rtol=1e-12, atol=1e-12)
    ((ref_out * weights).sum() / N).backward()
    (scores.softmax(-1) @ v).transpose(1, 2).reshape(-1, E).backward(context.grad)
    layers = {layer.name.rpartition(".")[2]: layer for layer in opt.layers}
    assert list(layers) == ["q_proj", "k_proj", "v_proj", "out_proj"]
    rows = [(x, p.grad, i) for i, (x, p) in enumerate(zip(ins, projected))] + [(context.detach(), None, 3)]
    for a_rows, g_rows, i in rows:
        name = ("q_proj", "k_proj", "v_proj", "out_proj")[i]
        if i == 3:
            g_rows = (weights / N).transpose(0, 1).reshape(-1, E)
            grad = torch.cat([grads["out_proj.weight"], grads["out_proj.bias"].unsqueeze(1)], 1)
        else:
            wname = "in_proj_weight" if kdim is None else f"{'qkv'[i]}_proj_weight"
            wgrad = grads[wname][i * E : (i + 1) * E] if kdim is None else grads[wname]
            grad = torch.cat([wgrad, grads["in_proj_bias"][i * E : (i + 1) * E].unsqueeze(1)], 1)
        torch.testing.assert_close(g_rows.T @ torch.cat([a_rows, torch.ones(len(a_rows), 1)], 1), grad)  # Σ g ⊗ [a, 1]
        A, G = factors(a_rows, g_rows, N, bias=True, shared=False)
        A = DECAY * torch.eye(A.shape[0]) + (1 - DECAY) * A
        G = DECAY * torch.eye(E) + (1 - DECAY) * G
        torch.testing.assert_close(layers[name].A, A, rtol=1e-11, atol=1e-12, msg=lambda m, n=name: f"A {n}: {m}")
        torch.testing.assert_close(layers[name].G, G, rtol=1e-11, atol=1e-12, msg=lambda m, n=name: f"G {n}: {m}")
        u = update(A, G, grad, DAMPING, method)
        if i == 3:
            got = torch.cat([change["out_proj.weight"], change["out_proj.bias"].unsqueeze(1)], 1)
        else:
            wchange = change[wname][i * E : (i + 1) * E] if kdim is None else change[wname]
            got = torch.cat([wchange, change["in_proj_bias"][i * E : (i + 1) * E].unsqueeze(1)], 1)
        torch.testing.assert_close(got, u, rtol=1e-9, atol=1e-11, msg=lambda m, n=name: f"update {n}: {m}")


# -- distributed -------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kind", "kdim", "options"), [("cross", KDIM, dict(placement="lbp")), ("self", None, dict(distribute_preconditioning=True))]
)
def test_n_workers_equal_one_in_process_with_bitwise_replicas(kind, kdim, options, float64):
    """Sequence-first attention with key padding: 2 ranks = 1 on the global batch.

    Cross-attention with kdim/vdim (separate weights), LBP placement; self-attention (q, k, v rows of one
    parameter) with each layer preconditioned by one gradient worker and broadcast (MEM-OPT).
    """
    x, y, padding = _data(kind)

    def run(backend):
        size = 1 if isinstance(backend, str) else backend.size
        rank = 0 if isinstance(backend, str) else backend.rank
        model = models[rank if size > 1 else 2]
        opt = SPDKFACOptimizer(model, **{**KW, "backend": backend, **options})
        local = len(x) // size
        part = slice(rank * local, (rank + 1) * local)
        _train(model, opt, x[part], y[part], padding[part], steps=4)
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    models = [_nets(False, True, kind, kdim)[0] for _ in range(3)]  # built outside the rank threads
    ref = run("single")
    ranks = run_ranks(2, run)
    for key, value in ref.items():
        torch.testing.assert_close(ranks[0][key], value, rtol=1e-9, atol=1e-11, msg=lambda m, k=key: f"{k}: {m}")
        assert torch.equal(ranks[0][key], ranks[1][key]), f"{key} differs between ranks"


# -- behaviour around the optimizer -------------------------------------------------------------------------------------------
def test_the_model_stays_as_it_was_and_runs_torchs_forward_without_the_hooks(float64):
    mine, _ = _nets(True, True, "self", None)
    keys, modules = list(mine.state_dict()), len(list(mine.modules()))
    opt = SPDKFACOptimizer(mine, **KW)
    assert list(mine.state_dict()) == keys
    assert len(list(mine.modules())) == modules
    explicit = mine.attn.forward
    assert isinstance(explicit, ExplicitAttention)
    assert explicit.hooked()
    x, _y, _padding = _data("self")
    seen = []
    handle = explicit.projections[0].register_forward_hook(lambda *_: seen.append(1))
    mine(x)  # training, gradients on: the explicit forward
    mine.eval()
    native = nn.MultiheadAttention.forward(mine.attn, *(torch.tanh(mine.embed(x)),) * 3)[0]
    with torch.no_grad():  # (torch's own forward may take its fused path here, rounding otherwise: compared alike)
        native_fast = nn.MultiheadAttention.forward(mine.attn, *(torch.tanh(mine.embed(x)),) * 3)[0]
        assert torch.equal(mine.attn(*(torch.tanh(mine.embed(x)),) * 3)[0], native_fast)  # evaluation: torch's forward
    assert seen == [1]
    # In eval mode with gradients on, the explicit forward (a part of a training model may be in eval mode), alike (to
    # rounding: the explicit forward's products are its own, and some CPUs' kernels round torch's otherwise).
    torch.testing.assert_close(mine.attn(*(torch.tanh(mine.embed(x)),) * 3)[0], native, rtol=1e-13, atol=1e-15)
    assert seen == [1, 1]
    handle.remove()
    mine.train()
    opt.remove_hooks()
    assert not explicit.hooked()
    native = nn.MultiheadAttention.forward(mine.attn, *(torch.tanh(mine.embed(x)),) * 3)[0]
    assert torch.equal(mine.attn(*(torch.tanh(mine.embed(x)),) * 3)[0], native)
    clone = pickle.loads(pickle.dumps(mine))
    torch.testing.assert_close(clone(x), mine(x))
    copied = copy.deepcopy(mine)
    assert copied.attn.forward.module is copied.attn


def test_a_second_optimizer_hooks_the_same_projections():
    mine, _ = _nets(True, True, "self", None)
    first = SPDKFACOptimizer(mine, lr=0.1, backend="single")
    first.remove_hooks()
    second = SPDKFACOptimizer(mine, lr=0.1, backend="single")
    assert second.layers[0].module is mine.attn.forward.projections[0]
    x, y, _padding = _data("self")
    for _ in range(2):
        second.zero_grad()
        F.cross_entropy(mine(x), y).backward()
        second.step()
    assert all(torch.isfinite(p).all() for p in mine.parameters())


def test_summary_covers_attention_and_names_what_it_refuses():
    class MyAttention(nn.MultiheadAttention):
        def forward(self, query, key, value, **kwargs):
            return super().forward(query, key, value, **kwargs)

    mine, _ = _nets(True, True, "self", None)
    opt = SPDKFACOptimizer(mine, lr=0.1, backend="single")
    summary = opt.kfac_summary()
    assert "(100.0%)" in summary
    assert "3 x MultiheadAttention q/k/v projection" in summary
    net = nn.Sequential(nn.Linear(E, E))
    net.attn = MyAttention(E, H, batch_first=True)
    with pytest.warns(UserWarning, match="attn.out_proj"):
        opt = SPDKFACOptimizer(net, lr=0.1, backend="single")
    summary = opt.kfac_summary()
    assert "1 x MyAttention: not supported: a subclass of MultiheadAttention with its own forward()" in summary
    assert [la.name for la in opt.layers] == ["0"]


class _Ops(TorchDispatchMode):
    """Records the ATen operations run inside it, by name; :attr:`products` counts the matrix products."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))

    @property
    def products(self) -> int:
        """``mm``/``addmm`` calls: a Linear's forward is one."""
        return sum(name in ("aten.mm", "aten.addmm") for name in self.names)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(("inputs", "products"), [("self", 1), ("kv", 2), ("three", 3)])
def test_projections_of_one_input_are_one_product_as_in_torch(inputs, products, bias):
    """q, k and v of one tensor (self-attention) are one product of ``in_proj_weight``, k and v of one memory one
    product, as torch's forward computes them; the values equal three separate products' to rounding, and the
    gradients reach every projection's hook and the input."""
    mha = _mha(bias=bias)
    g = torch.Generator().manual_seed(1)
    x, memory = torch.randn(N, L, E, generator=g), torch.randn(N, S, E, generator=g)
    args = {"self": (x, x, x), "kv": (x, memory, memory), "three": (x, memory, memory.clone())}[inputs]
    results = []
    for same_qk, same_kv in ((args[0] is args[1], args[1] is args[2]), (False, False)):  # (as torch would; always apart)
        leaves = [a.detach().requires_grad_() for a in args]
        if inputs == "self":
            leaves = [leaves[0]] * 3
        elif inputs == "kv":
            leaves[2] = leaves[1]
        projections = ExplicitAttention(mha).projections
        seen: dict[int, torch.Tensor] = {}

        def on_output(module: nn.Module, _inputs: tuple, output: torch.Tensor, store: dict = seen) -> None:
            output.register_hook(lambda grad, index=module.index: store.__setitem__(index, grad))

        handles = [p.register_forward_hook(on_output) for p in projections]
        mha.zero_grad()
        with _Ops() as forward:
            outputs = project(mha, projections, tuple(leaves), same_qk, same_kv)
        sum((o * (i + 1)).sum() for i, o in enumerate(outputs)).backward()
        for h in handles:
            h.remove()
        assert len(seen) == 3  # each projection's output gradient, whichever product made it
        grads = [p.grad.clone() for p in mha.parameters() if p.grad is not None] + [
            a.grad.clone() for a in {id(a): a for a in leaves}.values()
        ]
        results.append((forward.products, outputs, grads, [seen[i] for i in range(3)]))
    (count, outputs, grads, seen), (apart_count, apart_outputs, apart_grads, apart_seen) = results
    assert (count, apart_count) == (products, 3)
    for got, want in zip([*outputs, *grads, *seen], [*apart_outputs, *apart_grads, *apart_seen]):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_the_explicit_forward_of_self_attention_is_torchs_product():
    """In self-attention the explicit forward makes q, k and v by torch's one product: its output and its input's
    gradient are torch's forward's, bitwise (three products would sum the input's gradient in another order)."""
    mha = _mha()
    x = torch.randn(N, L, E, generator=torch.Generator().manual_seed(2))
    results = []
    for forward in (
        lambda x: nn.MultiheadAttention.forward(mha, x, x, x, need_weights=False)[0],
        lambda x: explicit_attention(mha, ExplicitAttention(mha).projections, x, x, x, need_weights=False)[0],
    ):
        leaf = x.clone().requires_grad_()
        out = forward(leaf)
        out.square().sum().backward()
        results.append((out.detach(), leaf.grad))
    (torch_out, torch_grad), (out, grad) = results
    assert torch.equal(out, torch_out)
    assert torch.equal(grad, torch_grad)


@pytest.mark.parametrize("bias", [True, False])
def test_packed_projections_split_once_and_their_gradients_are_one_concatenation(bias):
    """q, k and v read their rows of ``in_proj_weight`` (and ``in_proj_bias``) as views of one split: the backward
    pass concatenates their gradients, with no zero-filled copy per projection, and every value is the slicing's."""

    grads = []
    for rows in (projection_rows, lambda mha: [() for _ in range(3)]):  # split once; each projection slicing its rows
        mha = _mha(bias=bias)
        x = torch.randn(N, L, E, generator=torch.Generator().manual_seed(1), requires_grad=True)
        projections = ExplicitAttention(mha).projections
        outputs = [p(x, *r) for p, r in zip(projections, rows(mha))]
        with _Ops() as ops:
            sum((o * (i + 1)).sum() for i, o in enumerate(outputs)).backward()
        grads.append((ops.names, {name: p.grad.clone() for name, p in mha.named_parameters() if p.grad is not None}, x.grad.clone()))
    (split_ops, split_grads, split_x), (sliced_ops, sliced_grads, sliced_x) = grads
    assert "aten.slice_backward" in sliced_ops  # (what the split avoids)
    assert "aten.slice_backward" not in split_ops
    assert split_grads.keys() == sliced_grads.keys()
    assert "in_proj_weight" in split_grads
    for name, grad in sliced_grads.items():
        assert torch.equal(split_grads[name], grad), name
    assert torch.equal(split_x, sliced_x)
    assert projection_rows(_mha(kdim=KDIM, vdim=VDIM)) == [(), (), ()]  # separate weights: each projection its own


def test_attention_in_eval_mode_inside_a_training_model_takes_its_factors(float64):
    """An encoder put in eval mode while the model trains (its dropout off): its attention runs the explicit forward,
    so q, k, v and out_proj take their factors, and the run is the one of the model all in train mode (no dropout)."""
    x, y = batch(8)
    results = []
    for part_in_eval in (True, False):
        model = small_transformer()
        opt = SPDKFACOptimizer(model, lr=0.1, backend="single")
        for s in range(3):
            model.train()
            if part_in_eval:
                model.encoder.eval()
            opt.zero_grad()
            F.cross_entropy(model(x + 0.1 * s), y).backward()
            opt.step()
        results.append((model, {la.name: la.A for la in opt.layers}))
    (evaluated, factors_a), (plain, factors_b) = results
    assert factors_a.keys() == factors_b.keys()
    assert not torch.equal(factors_a["encoder.layers.0.self_attn.q_proj"], torch.eye(13, dtype=torch.float64))
    for name in factors_a:
        assert torch.equal(factors_a[name], factors_b[name]), name
    for a, b in zip(evaluated.parameters(), plain.parameters()):
        assert torch.equal(a, b)
