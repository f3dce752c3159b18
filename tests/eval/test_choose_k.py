"""eval's automatic num_draft_tokens follows τ and medians of interleaved cost timings, so a
noisy machine (another process taking the cores now and then) does not flip it."""

import random

from pipeline.eval.measure import best_num_draft_tokens, expected_tokens_per_pass, median_seconds, predicted_speedup

KS = [1, 2, 3, 4, 6]
ALPHA = [0.8, 0.7, 0.6, 0.5, 0.45, 0.4]  # acceptance by draft position
COST = {"one": 1.0, "draft": 0.2, **{("verify", k): 1 + 0.1 * k for k in KS}}  # in target forwards


class NoisyClock:
    """Virtual time: a call advances it by its true cost, ten times that on a random fifth of
    calls (a stall: the cores were busy with something else)."""

    def __init__(self, seed: int, stall: float = 0.2, factor: float = 10.0) -> None:
        self.now, self.rng, self.stall, self.factor = 0.0, random.Random(seed), stall, factor

    def __call__(self) -> float:
        return self.now

    def spend(self, cost: float) -> None:
        self.now += cost * (self.factor if self.rng.random() < self.stall else 1.0)


def sweep_rows(seconds: dict, clock: NoisyClock) -> list[dict]:
    """What eval's sweep gives for each k: the predicted speedup from the timed costs, and the
    tokens/s of one timed decode of 20 target passes (the measured speedup)."""
    rows = []
    for k in KS:
        start = clock()
        clock.spend(20 * (COST[("verify", k)] + k * COST["draft"]))
        tokens_per_s = 20 * expected_tokens_per_pass(ALPHA[:k]) / (clock() - start)
        rows.append(dict(num_draft_tokens=k, tokens_per_s=tokens_per_s, predicted_speedup=predicted_speedup(
            ALPHA[:k], seconds["draft"] / seconds["one"], seconds[("verify", k)] / seconds["one"])))
    return rows


def test_the_chosen_num_draft_tokens_does_not_follow_a_noisy_clock():
    exact = [dict(num_draft_tokens=k, tokens_per_s=0.0,
                  predicted_speedup=predicted_speedup(ALPHA[:k], COST["draft"], COST[("verify", k)])) for k in KS]
    best = best_num_draft_tokens(exact)
    chosen, by_tokens_per_s = [], []
    for seed in range(50):
        clock = NoisyClock(seed)
        steps = {name: (lambda cost=cost: clock.spend(cost)) for name, cost in COST.items()}
        seconds = median_seconds(steps, None, reps=15, clock=clock)  # as eval times its costs
        rows = sweep_rows(seconds, clock)
        chosen.append(best_num_draft_tokens(rows))
        by_tokens_per_s.append(max(rows, key=lambda r: r["tokens_per_s"])["num_draft_tokens"])
    assert set(chosen) == {best}
    assert len(set(by_tokens_per_s)) > 1  # the noise is real: picking by one measured speed flips


def test_values_predicted_alike_go_to_the_smallest():
    """Predictions within NEAR_BEST of the best are equal as far as the timings can tell: the
    smallest such k wins, so a few percent of timing noise between them cannot flip the choice."""
    rows = lambda *speedups: [dict(num_draft_tokens=k, tokens_per_s=0.0, predicted_speedup=v)
                              for k, v in zip([1, 2, 3], speedups)]
    assert best_num_draft_tokens(rows(1.0, 1.485, 1.406)) == 2
    assert best_num_draft_tokens(rows(1.167, 1.46, 1.47)) == 2  # the same draft timed on a busy machine
    assert best_num_draft_tokens(rows(1.003, 1.007, 1.008)) == 1
    assert best_num_draft_tokens(rows(1.0, 1.2, 1.5)) == 3


def test_chains_without_a_prediction_fall_back_to_the_measured_speed():
    rows = [dict(num_draft_tokens=1, tokens_per_s=10.0, predicted_speedup=None),
            dict(num_draft_tokens=2, tokens_per_s=12.0, predicted_speedup=1.1)]
    assert best_num_draft_tokens(rows) == 2
    rows[1]["predicted_speedup"], rows[0]["predicted_speedup"] = 0.9, 1.2
    assert best_num_draft_tokens(rows) == 1
