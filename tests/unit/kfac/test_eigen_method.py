"""compute_method='eigen': the update is the dense (A ⊗ G + γI)^-1 solve; clamping, the stage, checkpoints."""

import io
import warnings

import pytest
import torch
import torch.nn as nn
from nets import batch, small_net

from spdkfac import SPDKFACOptimizer
from spdkfac.comm import CommBackend, CompletedHandle
from spdkfac.kfac.eigenbasis import EIGEN_CLAMP, eigen_payload, unpack_eigen
from spdkfac.kfac.methods import payload_size
from spdkfac.plan.placement import place
from spdkfac.step.decomposition_stage import compute_eigen

pytestmark = pytest.mark.filterwarnings("ignore:no perf_model given")
KW = dict(lr=0.05, momentum=0.0, weight_decay=0.0, kl_clip=None, factor_decay=0.8, backend="single")


def _dense_eigen_update(A: torch.Tensor, G: torch.Tensor, grad: torch.Tensor, damping: float) -> torch.Tensor:
    """``(A ⊗ G + γI)^-1 vec(grad)`` (column-stacking vec) by an explicit dense solve in float64."""
    A, G, grad = A.double(), G.double(), grad.double()
    F = torch.kron(A, G) + damping * torch.eye(A.shape[0] * G.shape[0], dtype=torch.float64)
    sol = torch.linalg.solve(F, grad.T.reshape(-1))
    return sol.reshape(grad.shape[1], grad.shape[0]).T


def _step(model, opt, x, y):
    """One step; returns each layer's gradient matrix before it and the update it applied (``-Δθ / lr``)."""
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    grads = {layer.name: layer.grad_matrix().clone() for layer in opt.layers}
    before = {layer.name: _weights(layer) for layer in opt.layers}
    opt.step()
    lr = opt.param_groups[0]["lr"]
    return grads, {layer.name: (before[layer.name] - _weights(layer)) / lr for layer in opt.layers}


def _weights(layer):
    w = layer.module.weight.detach().reshape(layer.g_dim, -1)
    return torch.cat([w, layer.module.bias.detach()[:, None]], 1) if layer.has_bias else w.clone()


def test_eigen_update_equals_dense_damped_kronecker_solve(float64):
    model = small_net()
    x, y = batch(8)
    opt = SPDKFACOptimizer(model, compute_method="eigen", damping=0.01, factor_update_freq=2, inv_update_freq=2, **KW)
    for s in range(3):
        _step(model, opt, x + 0.1 * s, y)
    # Step 3 keeps step 2's decompositions and factors; a new damping must apply without a new decomposition.
    opt.param_groups[0]["damping"] = 0.003
    grads, updates = _step(model, opt, x + 0.3, y)
    for layer in opt.layers:
        expected = _dense_eigen_update(layer.A, layer.G, grads[layer.name], 0.003)
        torch.testing.assert_close(updates[layer.name], expected, rtol=1e-7, atol=1e-10, msg=layer.name)
        # Not the per-factor damping of the inverse method: the two differ on these factors.
        inv = (
            torch.linalg.inv(layer.G + 0.003 * torch.eye(layer.g_dim))
            @ grads[layer.name]
            @ torch.linalg.inv(layer.A + 0.003 * torch.eye(layer.a_dim))
        )
        assert not torch.allclose(updates[layer.name], inv, rtol=1e-3)


def test_eigenvalues_below_threshold_are_zero_and_the_update_uses_the_clamped_factor(float64):
    torch.manual_seed(0)
    q, _ = torch.linalg.qr(torch.randn(5, 5))
    values = torch.tensor([-1e-6, 1e-12, 0.5 * EIGEN_CLAMP, 0.3, 2.0])  # negative and tiny: rounding noise of a PSD factor
    A = q @ torch.diag(values) @ q.T
    eig = unpack_eigen(eigen_payload(A), 5)
    assert eig.d.tolist()[:3] == [0.0, 0.0, 0.0]
    torch.testing.assert_close(eig.d[3:], values[3:])
    assert eig.Q.is_contiguous()
    torch.testing.assert_close(eig.Q @ torch.diag(eig.d) @ eig.Q.T, q @ torch.diag(torch.where(values < EIGEN_CLAMP, 0.0, values)) @ q.T)

    layer = SPDKFACOptimizer(nn.Linear(4, 3, bias=True), compute_method="eigen", **KW).layers[0]
    G = torch.randn(3, 3)
    G = G @ G.T
    layer.set_decomposition("A", eig)
    layer.set_decomposition("G", unpack_eigen(eigen_payload(G), 3))
    grad = torch.randn(3, 5)
    clamped = eig.Q @ torch.diag(eig.d) @ eig.Q.T
    damping = 1e-7  # small enough that the -1e-6 eigenvalue, unclamped, would change the result visibly
    # The clamped zeros make the Kronecker product's smallest eigenvalue the damping: 1/1e-7 amplifies rounding to
    # ~1e-7 relative, so the comparison allows 1e-5 (the unclamped -1e-6 eigenvalue would differ by order 1).
    torch.testing.assert_close(layer.precondition(grad, damping), _dense_eigen_update(clamped, G, grad, damping), rtol=1e-5, atol=1e-12)
    with pytest.raises(TypeError, match="damping"):
        layer.precondition(grad)  # type: ignore[call-arg]


class _TwoRankView(CommBackend):
    """Rank ``rank`` of two, in one process: broadcasts record their buffers and complete at once."""

    name = "fake"

    def __init__(self, rank: int) -> None:
        self._rank, self.sent = rank, []

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return 2

    def allreduce_async(self, tensor, name):  # pragma: no cover - not used by the stage
        raise NotImplementedError

    def broadcast_async(self, tensor, root, name):
        self.sent.append((root, tensor))
        return CompletedHandle()

    def barrier(self) -> None:  # pragma: no cover
        pass


def test_owner_keeps_exactly_the_buffer_it_broadcasts(float64):
    torch.manual_seed(0)
    mats = {}
    for key, d in ((("A", "l0"), 6), (("G", "l0"), 4), (("A", "l1"), 5), (("G", "l1"), 3)):
        m = torch.randn(d, d)
        mats[key] = m @ m.T
    plan = place("seq", [(k, m.shape[0]) for k, m in mats.items()], 2, lambda d: 1.0, lambda d: 1.0)
    backend = _TwoRankView(0)
    out = compute_eigen(plan, mats, backend)
    assert len(backend.sent) == 4
    for _root, buffer in backend.sent:
        assert buffer.numel() in {payload_size("eigen", m.shape[0]) for m in mats.values()}
    for key, eig in out.items():
        if plan.owner(key) == 0:  # computed here: Q and d are views of the sent buffer, row-major
            buffer = next(b for r, b in backend.sent if r == 0 and b.numel() == payload_size("eigen", eig.d.numel()))
            assert eig.Q.data_ptr() == buffer.data_ptr()
            assert eig.Q.is_contiguous()
            assert eig.d.data_ptr() == buffer[eig.d.numel() ** 2 :].data_ptr()


def _train(opt, model, x, y, start, stop):
    for s in range(start, stop):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x + 0.1 * s), y).backward()
        opt.step()


def test_eigen_checkpoint_resumes_bitwise_and_the_other_method_is_refused():
    kw = dict(lr=0.05, momentum=0.9, damping=0.01, factor_update_freq=2, inv_update_freq=4, backend="single")
    x, y = batch(8)
    full, half = small_net(), small_net()
    opt_full = SPDKFACOptimizer(full, compute_method="eigen", **kw)
    _train(opt_full, full, x, y, 0, 9)
    opt_half = SPDKFACOptimizer(half, compute_method="eigen", **kw)
    _train(opt_half, half, x, y, 0, 5)
    buf = io.BytesIO()
    torch.save(opt_half.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf)
    assert state["kfac"]["compute_method"] == "eigen"

    resumed = SPDKFACOptimizer(half, compute_method="eigen", **kw)
    opt_half.remove_hooks()
    resumed.load_state_dict(state)
    _train(resumed, half, x, y, 5, 9)
    for k, v in full.state_dict().items():
        assert torch.equal(half.state_dict()[k], v), k

    with pytest.raises(ValueError, match="saved with compute_method='eigen' but this optimizer uses compute_method='inverse'"):
        SPDKFACOptimizer(small_net(), **kw).load_state_dict(state)
    inverse_state = SPDKFACOptimizer(small_net(), **kw).state_dict()
    del inverse_state["kfac"]["compute_method"]  # a checkpoint from before the option: it holds inverses
    with pytest.raises(ValueError, match=r"saved with compute_method='inverse'.*cannot precondition here"):
        SPDKFACOptimizer(small_net(), compute_method="eigen", **kw).load_state_dict(inverse_state)


def test_compute_method_validated_and_shown():
    with pytest.raises(ValueError, match=r"compute_method must be one of \('inverse', 'eigen', 'ekfac'\), got 'eigh'"):
        SPDKFACOptimizer(small_net(), lr=0.1, compute_method="eigh", backend="single")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = SPDKFACOptimizer(small_net(), lr=0.1, compute_method="eigen", backend="single")
    assert "compute_method='eigen'" in repr(opt)
    assert set(opt.memory_usage()) == {"A", "G", "A_eigen", "G_eigen"}
