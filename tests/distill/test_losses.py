"""Each distillation loss against its formula, on random logits (never zeros)."""

import math

import pytest
import torch

from pipeline.train.losses import (
    DraftVocab, Teacher, aligned_log_probs, distill_loss, expected_acceptance, forward_kl, jsd, reverse_kl,
    top1_agreement, total_variation,
)

V = 11


def random_pair(n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, V, generator=g) * 2, torch.randn(n, V, generator=g) * 2  # teacher, student logits


def by_formula(p, q, kind, beta=0.5):
    """Plain-Python reference over one position's probability lists."""
    kl = lambda a, b: sum(x * math.log(x / y) for x, y in zip(a, b) if x > 0)
    if kind == "forward_kl":
        return kl(p, q)
    if kind == "reverse_kl":
        return kl(q, p)
    if kind == "tv":
        return 0.5 * sum(abs(x - y) for x, y in zip(p, q))
    m = [beta * x + (1 - beta) * y for x, y in zip(p, q)]
    return beta * kl(p, m) + (1 - beta) * kl(q, m)


@pytest.mark.parametrize("kind, fn", [("forward_kl", forward_kl), ("reverse_kl", reverse_kl),
                                      ("tv", total_variation), ("jsd", jsd)])
def test_divergences_match_their_formulas(kind, fn):
    t, s = random_pair()
    p_log, q_log = torch.log_softmax(t, -1), torch.log_softmax(s, -1)
    got = fn(p_log, q_log)
    for i in range(t.shape[0]):
        want = by_formula(p_log[i].exp().tolist(), q_log[i].exp().tolist(), kind)
        assert got[i].item() == pytest.approx(want, rel=1e-4, abs=1e-6)


def test_jsd_beta_is_asymmetric_and_bounded():
    t, s = random_pair()
    p_log, q_log = torch.log_softmax(t, -1), torch.log_softmax(s, -1)
    for beta in (0.1, 0.9):
        want = [by_formula(p_log[i].exp().tolist(), q_log[i].exp().tolist(), "jsd", beta) for i in range(5)]
        assert jsd(p_log, q_log, beta).tolist() == pytest.approx(want, rel=1e-4)
    assert (jsd(p_log, q_log) <= math.log(2) + 1e-6).all()
    assert not torch.allclose(jsd(p_log, q_log, 0.1), jsd(p_log, q_log, 0.9))


def test_divergences_vanish_only_for_equal_distributions():
    t, _ = random_pair()
    p_log = torch.log_softmax(t, -1)
    for fn in (forward_kl, reverse_kl, total_variation, jsd):
        assert fn(p_log, p_log).abs().max() < 1e-6
        assert (fn(p_log, torch.log_softmax(t.flip(-1), -1)) > 1e-3).all()


def test_expected_acceptance_is_the_sum_of_minimums():
    t, s = random_pair()
    p, q = torch.softmax(t, -1), torch.softmax(s, -1)
    torch.testing.assert_close(expected_acceptance(s, Teacher(t)), torch.minimum(p, q).sum(-1))


def test_temperature_softens_both_sides_and_rescales_kl():
    t, s = random_pair()
    T = 2.0
    got = distill_loss("forward_kl", s, Teacher(t), labels=torch.zeros(5, dtype=torch.long), temperature=T)
    want = T**2 * forward_kl(torch.log_softmax(t / T, -1), torch.log_softmax(s / T, -1)).mean()
    torch.testing.assert_close(got, want)


def test_cross_entropy_uses_the_targets_tokens():
    _, s = random_pair()
    labels = torch.tensor([1, 3, 5, 7, 9])
    got = distill_loss("ce", s, Teacher(torch.zeros(5, V)), labels)
    want = -torch.log_softmax(s, -1)[torch.arange(5), labels].mean()
    torch.testing.assert_close(got, want)


def test_topk_teacher_puts_the_drafts_remaining_mass_in_one_bucket():
    t, s = random_pair()
    k = 4
    top_logits, top_ids = t.topk(k, dim=-1)
    p_log, q_log = aligned_log_probs(s, Teacher(top_logits, top_ids))
    assert p_log.shape == q_log.shape == (5, k + 1)
    torch.testing.assert_close(q_log.exp().sum(-1), torch.ones(5))
    torch.testing.assert_close(p_log.exp().sum(-1), torch.ones(5))
    assert torch.isneginf(p_log[:, -1]).all()
    q = torch.softmax(s, -1)
    torch.testing.assert_close(q_log[:, :k].exp(), q.gather(-1, top_ids))
    # With k = V the top-k teacher is the full teacher.
    full_logits, full_ids = t.topk(V, dim=-1)
    for kind in ("forward_kl", "tv", "jsd", "reverse_kl"):
        a = distill_loss(kind, s, Teacher(full_logits, full_ids), labels=top_ids[:, 0])
        b = distill_loss(kind, s, Teacher(t), labels=top_ids[:, 0])
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_losses_have_gradients_for_the_draft():
    t, s = random_pair()
    for kind in ("forward_kl", "reverse_kl", "jsd", "tv", "ce"):
        s_ = s.clone().requires_grad_(True)
        distill_loss(kind, s_, Teacher(t), labels=t.argmax(-1)).backward()
        assert s_.grad.abs().sum() > 0, kind


VOCAB = torch.tensor([0, 2, 3, 5, 8, 9])  # a draft vocabulary of 6 of the V target tokens


def on_target_ids(draft_logits):
    """Draft-vocabulary logits spread onto the target's vocabulary (-inf elsewhere)."""
    full = torch.full((len(draft_logits), V), float("-inf"))
    full[:, VOCAB] = draft_logits
    return full


def test_acceptance_over_a_draft_vocabulary_counts_the_mass_it_cannot_reach():
    t, s = random_pair()
    draft_logits, vocab = s[:, : len(VOCAB)], DraftVocab(VOCAB, V)
    p, q = torch.softmax(t, -1), torch.softmax(on_target_ids(draft_logits), -1)
    want = torch.minimum(p, q).sum(-1)
    torch.testing.assert_close(expected_acceptance(draft_logits, Teacher(t), vocab), want)  # online teacher
    top_logits, top_ids = t.topk(4, dim=-1)  # offline top-k, some of it outside the draft vocabulary
    assert not torch.isin(top_ids, VOCAB).all()
    p_top = torch.softmax(top_logits, -1)
    want = torch.minimum(p_top, q.gather(-1, top_ids)).sum(-1)
    torch.testing.assert_close(expected_acceptance(draft_logits, Teacher(top_logits, top_ids), vocab), want)
    # And it is the same number the full-vocabulary path gives for a draft with -inf outside.
    torch.testing.assert_close(expected_acceptance(draft_logits, Teacher(top_logits, top_ids), vocab),
                               expected_acceptance(on_target_ids(draft_logits), Teacher(top_logits, top_ids)))


def test_a_draft_vocabulary_learns_the_teacher_renormalised_to_it():
    t, s = random_pair(n=6)
    draft_logits, vocab = s[:, : len(VOCAB)], DraftVocab(VOCAB, V)
    top_logits, top_ids = t.topk(3, dim=-1)
    top_ids[0] = torch.tensor([1, 4, 6])  # no token of the draft vocabulary: nothing to learn
    teacher, keep = vocab.teacher(Teacher(top_logits, top_ids))
    assert torch.equal(keep, torch.isin(top_ids, VOCAB).any(-1)) and not keep[0] and keep.sum() >= 3
    q_log = torch.log_softmax(draft_logits[keep], -1)
    for row, (ids, logits) in enumerate(zip(top_ids[keep], top_logits[keep])):
        inside = torch.isin(ids, VOCAB)
        p_log = torch.log_softmax(logits[inside], -1)
        q_at = q_log[row, vocab.index[ids[inside]]]
        q_rest = torch.log1p(-q_at.exp().sum())
        want = (p_log.exp() * (p_log - q_at)).sum()
        got = forward_kl(*aligned_log_probs(draft_logits[keep][row : row + 1],
                                            Teacher(teacher.logits[row : row + 1], teacher.ids[row : row + 1])))
        torch.testing.assert_close(got, want[None])
        assert torch.isfinite(q_rest)
    # An online teacher: its logits at the draft vocabulary's tokens.
    online, keep = vocab.teacher(Teacher(t))
    assert keep.all() and torch.equal(online.logits, t[:, VOCAB])
    # Cross-entropy ignores target tokens outside the vocabulary.
    labels = vocab.labels(torch.tensor([0, 1, 9, 4, 5, 3]))
    assert labels.tolist() == [0, -100, 5, -100, 3, 2]


def test_top1_agreement_compares_target_tokens():
    t, _ = random_pair()
    vocab = DraftVocab(VOCAB, V)
    best = t.argmax(-1)
    draft_logits = torch.zeros(5, len(VOCAB))
    inside = vocab.index[best] >= 0
    draft_logits[inside, vocab.index[best[inside]]] = 1.0  # agrees where it can
    got = top1_agreement(draft_logits, Teacher(t), vocab)
    assert got.tolist() == inside.float().tolist()
    top_logits, top_ids = t.topk(3, dim=-1)
    torch.testing.assert_close(top1_agreement(draft_logits, Teacher(top_logits, top_ids), vocab), got)
