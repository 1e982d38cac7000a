"""The GPT head's fused output layer + cross entropy against F.linear + F.cross_entropy
(vocab-parallel layouts: tests/distributed/test_tensor_parallel.py and the layout tests)."""
import pytest
import torch
import torch.nn.functional as F

from megatron.mpu.cross_entropy import LogitsBuffers, linear_cross_entropy


def reference(hidden, weight, target, vocab_limit=None, label_smoothing=0.0):
    logits = F.linear(hidden, weight).float()
    if vocab_limit is not None:
        logits = logits.masked_fill(torch.arange(weight.shape[0]) >= vocab_limit, float("-inf"))
    return F.cross_entropy(logits.view(-1, weight.shape[0]), target.view(-1), reduction="none",
                           label_smoothing=label_smoothing).view(target.shape)


def losses_and_grads(fn, hidden, weight, target, upstream, **kwargs):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = fn(h, w, target, **kwargs)
    (loss * upstream).sum().backward()
    return loss.detach(), h.grad, w.grad


# bfloat16 with float losses: the loss as the reference's to 1e-6; the gradients within
# bfloat16 rounding of it (on CPUs the head rounds softmax - one_hot and scales by the loss
# gradient after the products, where the reference rounds the scaled gradient:
# test_bf16_gradients_as_accurate_as_the_reference compares both with float64)
@pytest.mark.parametrize("dtype,float_loss,tol,grad_tol", [(torch.float32, True, 2e-6, 2e-6),
                                                           (torch.bfloat16, True, 1e-6, 1e-2),
                                                           (torch.bfloat16, False, 3e-2, 3e-2)])
@pytest.mark.parametrize("vocab_limit,label_smoothing", [(None, 0.0), (None, 0.1), (50, 0.0)])
def test_matches_linear_then_cross_entropy(dtype, float_loss, tol, grad_tol, vocab_limit,
                                           label_smoothing):
    torch.manual_seed(0)
    hidden, weight = torch.randn(7, 3, 16).to(dtype), torch.randn(64, 16).to(dtype)
    target, upstream = torch.randint(0, 50, (7, 3)), torch.randn(7, 3)
    buffers = LogitsBuffers()
    for _ in range(2):  # the second step reuses the first one's buffers
        ours = losses_and_grads(linear_cross_entropy, hidden, weight, target, upstream,
                                buffers=buffers, vocab_limit=vocab_limit, float_loss=float_loss,
                                label_smoothing=label_smoothing)
    ref = losses_and_grads(reference, hidden, weight, target, upstream, vocab_limit=vocab_limit,
                           label_smoothing=label_smoothing)
    for a, b in zip(ours, ref):
        assert a.dtype == b.dtype
        err = ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
        assert err < (grad_tol if a is not ours[0] else max(tol, 1e-6)), err


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bf16_gradients_as_accurate_as_the_reference(seed):
    """bfloat16 head and float32 loss against float64 on the same bfloat16 values: the loss
    equals the reference's (F.linear, .float(), F.cross_entropy), and the gradients are as
    close to float64 as the reference's (which rounds at another point) within 10%."""
    torch.manual_seed(seed)
    hidden, weight = torch.randn(64, 3, 32).bfloat16(), torch.randn(500, 32).bfloat16()
    target, upstream = torch.randint(0, 500, (64, 3)), torch.randn(64, 3)
    ours = losses_and_grads(linear_cross_entropy, hidden, weight, target, upstream)
    ref = losses_and_grads(reference, hidden, weight, target, upstream)
    exact = losses_and_grads(
        lambda h, w, t: F.cross_entropy(F.linear(h, w).view(-1, 500), t.view(-1),
                                        reduction="none").view(t.shape),
        hidden.double(), weight.double(), target, upstream.double())
    torch.testing.assert_close(ours[0], ref[0], rtol=1e-6, atol=1e-6)
    for a, b, e in zip(ours[1:], ref[1:], exact[1:]):
        scale = e.abs().max()
        ours_err, ref_err = ((a.double() - e).abs().max() / scale), ((b.double() - e).abs().max() / scale)
        assert ours_err <= 1.1 * ref_err, (ours_err, ref_err)


def test_buffer_is_reused_across_steps_and_released_without_grad():
    hidden, weight = torch.randn(4, 8, requires_grad=True), torch.randn(32, 8)
    target = torch.randint(0, 32, (4,))
    buffers = LogitsBuffers()
    linear_cross_entropy(hidden, weight, target, buffers=buffers).sum().backward()
    (buf,) = buffers._free[((4, 32), torch.float32, torch.device("cpu"))]
    pointer = buf.data_ptr()
    linear_cross_entropy(hidden, weight, target, buffers=buffers).sum().backward()
    assert [b.data_ptr() for b in buffers._free[((4, 32), torch.float32, torch.device("cpu"))]] == [pointer]
    with torch.no_grad():  # nothing to keep for a backward: the buffer goes straight back
        linear_cross_entropy(hidden, weight, target, buffers=buffers)
    assert len(buffers._free[((4, 32), torch.float32, torch.device("cpu"))]) == 1


def test_micro_batches_in_flight_get_buffers_of_their_own():
    """A pipeline schedule runs several forwards before their backwards."""
    torch.manual_seed(1)
    weight = torch.randn(32, 8, requires_grad=True)
    hiddens = [torch.randn(4, 8, requires_grad=True) for _ in range(3)]
    targets = [torch.randint(0, 32, (4,)) for _ in range(3)]
    buffers = LogitsBuffers()
    losses = [linear_cross_entropy(h, weight, t, buffers=buffers) for h, t in zip(hiddens, targets)]
    for loss in reversed(losses):
        loss.sum().backward()
    ours = [h.grad for h in hiddens] + [weight.grad]
    for h in hiddens:
        h.grad = None
    weight.grad = None
    for h, t in zip(hiddens, targets):
        reference(h, weight, t).sum().backward()
    for a, b in zip(ours, [h.grad for h in hiddens] + [weight.grad]):
        assert torch.allclose(a, b, atol=1e-6)
    assert len(buffers._free[((4, 32), torch.float32, torch.device("cpu"))]) == 3


def test_second_backward_is_a_clear_error():
    hidden = torch.randn(4, 8, requires_grad=True)
    loss = linear_cross_entropy(hidden, torch.randn(32, 8), torch.randint(0, 32, (4,))).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="cannot run backward twice"):
        loss.backward()


def test_weight_gradient_goes_straight_into_main_grad():
    """With the reducer's fp32 buffer attached, the head adds its weight gradient there
    (on top of what is in it) and hands autograd nothing; a 16-bit weight's product is
    widened as it is added, with the bits of the 16-bit gradient it replaces."""
    torch.manual_seed(2)
    hidden, target = torch.randn(6, 8), torch.randint(0, 32, (6,))
    weight = torch.nn.Parameter(torch.randn(32, 8))
    expected = losses_and_grads(reference, hidden, weight.detach(), target, torch.ones(6))[2]
    weight.main_grad = torch.full((32, 8), 0.5)
    linear_cross_entropy(hidden, weight, target).sum().backward()
    assert weight.grad is None
    torch.testing.assert_close(weight.main_grad, expected + 0.5)
    plain = torch.nn.Parameter(weight.detach().bfloat16())
    linear_cross_entropy(hidden.bfloat16(), plain, target).sum().backward()
    half = torch.nn.Parameter(weight.detach().bfloat16())
    half.main_grad = torch.full((32, 8), 0.5)
    linear_cross_entropy(hidden.bfloat16(), half, target).sum().backward()
    assert half.grad is None and plain.grad.dtype == torch.bfloat16
    assert torch.equal(half.main_grad, torch.full((32, 8), 0.5).add_(plain.grad))


def test_only_the_latest_shape_is_kept():
    """Evaluation over many lengths must not keep a logits buffer per length."""
    weight, buffers = torch.randn(32, 8), LogitsBuffers()
    with torch.no_grad():
        for rows in (3, 4, 5):
            linear_cross_entropy(torch.randn(rows, 8), weight, torch.randint(0, 32, (rows,)),
                                 buffers=buffers)
    assert list(buffers._free) == [((5, 32), torch.float32, torch.device("cpu"))]


def test_label_smoothing_with_masked_vocabulary_padding_is_refused():
    """Smoothing averages log p over every column; masked padding (log 0) would make the loss
    NaN, so the combination is an error (a limit covering the whole vocabulary is fine)."""
    hidden, weight = torch.randn(4, 8, requires_grad=True), torch.randn(32, 8)
    target = torch.randint(0, 30, (4,))
    with pytest.raises(ValueError, match="label_smoothing 0.1 with vocab_limit 30 .of 32"):
        linear_cross_entropy(hidden, weight, target, vocab_limit=30, label_smoothing=0.1)
    loss = linear_cross_entropy(hidden, weight, target, vocab_limit=32, label_smoothing=0.1)
    assert torch.isfinite(loss).all()
