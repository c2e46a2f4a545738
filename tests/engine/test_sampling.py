"""Sampling: greedy, temperature, top-k, top-p, and per-request generators independent of the batch."""

from __future__ import annotations

import pytest
import torch

from engine.api import SamplingParams
from engine.sampling import apply_top_k, apply_top_p, greedy_ids, make_generator, sample, sample_row


def test_greedy_is_argmax_and_lowest_id_on_tie():
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0], [5.0, -1.0, 2.0, 0.0]])
    params = [SamplingParams(temperature=0.0)] * 2
    gens = [make_generator(0), make_generator(1)]
    assert sample(logits, params, gens) == [1, 0]


def test_greedy_ids_are_torch_argmax_on_ties_nan_inf_and_any_float_dtype():
    g = torch.Generator().manual_seed(3)
    rows = torch.randn(9, 49152, generator=g)
    rows[1, 7] = rows[1, 40000] = rows[1].max() + 1  # a tie: the lowest id
    rows[2, 100], rows[2, 200] = float("nan"), float("nan")  # the first NaN
    rows[3] = float("-inf")  # all -inf: id 0
    rows[4, :] = 0.0
    rows[5, 49151] = float("inf")
    assert (
        greedy_ids(rows)
        == torch.argmax(rows, dim=-1).tolist()
        == [
            *greedy_ids(rows[:1]),
            7,
            100,
            0,
            0,
            49151,
            *torch.argmax(rows[6:], dim=-1).tolist(),
        ]
    )
    assert greedy_ids(rows[1]) == [7]  # one [vocab] row
    assert greedy_ids(rows[::2]) == torch.argmax(rows[::2], dim=-1).tolist()  # a non-contiguous view
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        assert greedy_ids(rows.to(dtype)) == torch.argmax(rows.to(dtype), dim=-1).tolist()


def test_top_k_keeps_exactly_k():
    logits = torch.tensor([0.1, 0.5, 0.3, 0.9, -1.0])
    out = apply_top_k(logits, 2)
    assert torch.isfinite(out).tolist() == [False, True, False, True, False]
    assert apply_top_k(logits, 0) is logits


def test_top_p_keeps_smallest_set_reaching_mass():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    # 0.5 < 0.7 so the second token is needed; 0.5 + 0.3 >= 0.7 so the third is not.
    assert torch.isfinite(apply_top_p(logits, 0.7)).tolist() == [True, True, False, False]
    # the most likely token is always kept
    assert torch.isfinite(apply_top_p(logits, 0.01)).tolist() == [True, False, False, False]
    assert apply_top_p(logits, 1.0) is logits


def test_top_k_one_is_greedy_whatever_the_temperature():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(3))
    p = SamplingParams(temperature=5.0, top_k=1)
    draws = {sample_row(logits, p, make_generator(s)) for s in range(20)}
    assert draws == {int(logits.argmax())}


def test_seeded_sampling_does_not_depend_on_batch():
    vocab = 100
    g = torch.Generator().manual_seed(0)
    row = torch.randn(vocab, generator=g)
    others = torch.randn(5, vocab, generator=g)
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=42)

    def draw_alone(n):
        gen = make_generator(42)
        return [sample(row[None], [p], [gen])[0] for _ in range(n)]

    def draw_in_batch(n, position):
        gen = make_generator(42)
        other_gens = [make_generator(100 + i) for i in range(5)]
        other_params = [SamplingParams(temperature=0.7, seed=100 + i) for i in range(5)]
        out = []
        for _ in range(n):
            batch = torch.cat([others[:position], row[None], others[position:]])
            params = other_params[:position] + [p] + other_params[position:]
            gens = other_gens[:position] + [gen] + other_gens[position:]
            out.append(sample(batch, params, gens)[position])
        return out

    alone = draw_alone(30)
    assert alone == draw_in_batch(30, 0) == draw_in_batch(30, 3) == draw_in_batch(30, 5)
    assert len(set(alone)) > 1  # it really samples


def test_different_seeds_differ_and_distribution_follows_temperature():
    logits = torch.tensor([2.0, 1.0, 0.0])
    hot = SamplingParams(temperature=100.0)
    cold = SamplingParams(temperature=0.05)
    gen = make_generator(7)
    hot_draws = [sample_row(logits, hot, gen) for _ in range(300)]
    cold_draws = [sample_row(logits, cold, gen) for _ in range(300)]
    assert set(hot_draws) == {0, 1, 2}
    assert cold_draws.count(0) >= 295
    a = [sample_row(logits, hot, make_generator(1)) for _ in range(1)]
    seq1 = [sample_row(logits, hot, g1) for g1 in [make_generator(1)] for _ in range(40)]
    seq2 = [sample_row(logits, hot, g2) for g2 in [make_generator(2)] for _ in range(40)]
    assert seq1 != seq2
    assert a[0] == seq1[0]


def test_sample_rejects_mismatched_rows():
    with pytest.raises(ValueError, match="rows"):
        sample(torch.zeros(2, 4), [SamplingParams()], [make_generator(0)])


@pytest.mark.parametrize("temperature", [5e-324, 1e-300, 1e-45])
def test_a_vanishing_temperature_samples_the_argmax_instead_of_failing(temperature: float) -> None:
    # logit / temperature overflows to inf here: without the max shift softmax gives NaN and multinomial raises
    logits = torch.tensor([1.5, 3.0, -2.0, float("-inf")])
    params = SamplingParams(temperature=temperature, top_k=3, top_p=0.9)
    draws = {sample_row(logits, params, make_generator(s)) for s in range(10)}
    assert draws == {1}
    assert sample(logits[None].repeat(2, 1), [params, params], [make_generator(0), make_generator(1)]) == [
        1,
        1,
    ]
