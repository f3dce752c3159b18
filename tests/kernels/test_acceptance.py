"""The fused acceptance kernels equal their PyTorch references on the same draws (random
shapes, vocabularies across block boundaries, exact ties, rows that accept nothing, some or
everything), and the references keep the rules' distributions."""

import pytest
import torch

from conftest import kernel_device, triton_module
from pipeline.kernels.acceptance import accept_greedy_reference, accept_sampling_reference, inverse_cdf


@pytest.fixture(scope="module")
def kernels():
    return triton_module("pipeline.kernels.acceptance_triton")


def greedy_case(gen, b, k, v, dtype):
    logits = torch.randn((b, k + 1, v), generator=gen).to(dtype)
    argmax = logits.argmax(dim=-1)
    draft = argmax[:, :k].clone()
    wrong = torch.rand((b, k), generator=gen) < 0.25  # some rows stop early, some accept all
    draft[wrong] = (draft[wrong] + 1 + torch.randint(0, v - 1, (int(wrong.sum()),), generator=gen)) % v
    num_proposed = torch.randint(0, k + 1, (b,), generator=gen)
    return draft, num_proposed, logits


@pytest.mark.parametrize("b, k, v", [(1, 0, 50), (3, 1, 1000), (4, 4, 1025), (2, 7, 3000), (5, 3, 4097)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_kernel_equals_the_reference(kernels, b, k, v, dtype):
    gen = torch.Generator().manual_seed(b * 100 + k)
    draft, num_proposed, logits = greedy_case(gen, b, k, v, dtype)
    want = accept_greedy_reference(draft, num_proposed, logits)
    dev = kernel_device()
    got = kernels.accept_greedy_triton(draft.to(dev), num_proposed.to(dev), logits.to(dev))
    assert [g.cpu().tolist() for g in got] == [w.tolist() for w in want]
    assert 0 < want[0].sum() or k == 0 or (num_proposed == 0).all()  # the case accepts something


def test_greedy_kernel_breaks_ties_to_the_lowest_id_across_blocks(kernels):
    """Exact ties inside a block and across two 1024-entry blocks: the lowest id wins, as in torch.argmax."""
    v = 3000
    logits = torch.zeros((2, 3, v))
    logits[0, :, [700, 2100]] = 5.0  # tie across blocks
    logits[1, :, [20, 21, 2999]] = 5.0  # tie inside a block and across
    draft = torch.tensor([[700, 2100], [20, 20]])
    want = accept_greedy_reference(draft, torch.tensor([2, 2]), logits)
    assert want[0].tolist() == [1, 2] and want[1].tolist() == [700, 20]
    dev = kernel_device()
    got = kernels.accept_greedy_triton(draft.to(dev), torch.tensor([2, 2], device=dev), logits.to(dev))
    assert [g.cpu().tolist() for g in got] == [w.tolist() for w in want]


def sampling_case(gen, b, k, v, closeness):
    """p [B, K+1, V] with some zero entries (as top-p leaves), q near p by `closeness`
    (1: q == p, every proposal accepted), drafts drawn from q."""
    p = torch.softmax(3 * torch.randn((b, k + 1, v), generator=gen), dim=-1)
    p = p * (torch.rand((b, k + 1, v), generator=gen) > 0.3)
    p = p / p.sum(dim=-1, keepdim=True)
    other = torch.softmax(3 * torch.randn((b, k, v), generator=gen), dim=-1)
    q = closeness * p[:, :k] + (1 - closeness) * other
    draft = torch.multinomial(q.reshape(-1, v), 1, generator=gen).reshape(b, k)
    num_proposed = torch.randint(0, k + 1, (b,), generator=gen)
    return draft, num_proposed, q, p, torch.rand((b, k), generator=gen), torch.rand(b, generator=gen)


@pytest.mark.parametrize("b, k, v", [(4, 1, 100), (3, 4, 1500), (6, 6, 2049)])
@pytest.mark.parametrize("closeness", [0.0, 0.9, 1.0])
def test_sampling_kernel_equals_the_reference_on_the_same_draws(kernels, b, k, v, closeness):
    gen = torch.Generator().manual_seed(v + k)
    case = sampling_case(gen, b, k, v, closeness)
    want = accept_sampling_reference(*case)
    dev = kernel_device()
    got = kernels.accept_sampling_triton(*(x.to(dev) for x in case))
    assert [g.cpu().tolist() for g in got] == [w.tolist() for w in want]
    if closeness == 1.0:  # q == p: every real proposal is accepted
        assert want[0].tolist() == case[1].tolist()


def test_inverse_cdf_draws_each_index_by_its_weight():
    weights = torch.tensor([[0.0, 1.0, 0.0, 3.0, 0.5, 0.0]])
    u = torch.rand(200_000, generator=torch.Generator().manual_seed(0))
    draws = inverse_cdf(weights.expand(len(u), -1), u)
    freq = torch.bincount(draws, minlength=6).float() / len(u)
    torch.testing.assert_close(freq, weights[0] / weights.sum(), atol=5e-3, rtol=0)
    assert inverse_cdf(weights, torch.tensor([0.0])).item() == 1  # u = 0: the first positive weight
    assert inverse_cdf(weights, torch.tensor([1.0])).item() == 4  # past the total: the last positive one


def test_sampling_reference_emits_tokens_distributed_as_p():
    """One position, a draft q far from p: the emitted token (accepted draft, or the residual's
    draw) is distributed as p (the rule's whole point)."""
    v, n = 5, 200_000
    gen = torch.Generator().manual_seed(1)
    p = torch.tensor([0.1, 0.4, 0.0, 0.2, 0.3])
    q = torch.tensor([0.5, 0.1, 0.3, 0.05, 0.05])
    draft = torch.multinomial(q, n, replacement=True, generator=gen)[:, None]
    num_accepted, nxt = accept_sampling_reference(
        draft, torch.ones(n, dtype=torch.long), q.expand(n, 1, v), p.expand(n, 2, v),
        torch.rand((n, 1), generator=gen), torch.rand(n, generator=gen))
    emitted = torch.where(num_accepted == 1, draft[:, 0], nxt)
    freq = torch.bincount(emitted, minlength=v).float() / n
    torch.testing.assert_close(freq, p, atol=5e-3, rtol=0)
