"""Sampling parity: logit bias, repetition / presence / frequency penalties, logprobs, per-choice seeds, and the
checks of their parameters; each deterministic with a seed and independent of the batch."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from engine.api import SamplingParams
from engine.errors import InvalidRequestError
from engine.input_processor import validate_params
from engine.sampling import SequenceSampler, choice_seed, sample_sequences
from tests.engine.engine_helpers import make_engine, random_tokens

VOCAB = 64


def row(seed: int = 0) -> torch.Tensor:
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_logit_bias_is_added_and_clamped_to_100():
    x = row()
    s = SequenceSampler(SamplingParams(logit_bias=((5, 1000.0), (7, -3.5))), [1])
    out = s.process(x)
    assert out[5] == pytest.approx(float(x[5]) + 100.0)
    assert out[7] == pytest.approx(float(x[7]) - 3.5)
    mask = torch.ones(VOCAB, dtype=torch.bool)
    mask[[5, 7]] = False
    assert torch.equal(out[mask], x[mask])
    greedy = SequenceSampler(SamplingParams(temperature=0.0, logit_bias=((9, 100.0),)), [1])
    assert greedy.sample(x).token_id == 9
    banned = int(torch.argmax(x))
    ban = SequenceSampler(SamplingParams(temperature=0.0, logit_bias=((banned, -100.0),)), [1])
    assert ban.sample(x).token_id != banned


def test_repetition_penalty_matches_hugging_face():
    prompt, output = [1, 2, 3, 40], [3, 5, 5]
    x = row(1)
    s = SequenceSampler(SamplingParams(repetition_penalty=1.3), prompt)
    for t in output:
        s.accept(t)
    ids = torch.tensor([prompt + output])
    want = RepetitionPenaltyLogitsProcessor(1.3)(ids, x[None].clone())[0]
    torch.testing.assert_close(s.process(x), want)


def test_presence_and_frequency_penalties_follow_openai_formula_over_output_only():
    prompt, output = [4, 4, 4], [5, 5, 6]
    x = row(2)
    s = SequenceSampler(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), prompt)
    for t in output:
        s.accept(t)
    want = x.clone()
    want[5] -= 2 * 0.25 + 0.5
    want[6] -= 1 * 0.25 + 0.5  # prompt token 4 is not penalized (OpenAI counts generated tokens)
    torch.testing.assert_close(s.process(x), want)


def test_logprobs_are_log_softmax_of_processed_row_with_sorted_top_k():
    x = row(3)
    s = SequenceSampler(SamplingParams(temperature=0.0, logprobs=5, logit_bias=((2, 4.0),)), [1])
    tok = s.sample(x)
    lp = torch.log_softmax(s.process(x), dim=-1)
    assert tok.token_id == int(torch.argmax(lp))
    assert tok.logprob == pytest.approx(float(lp[tok.token_id]))
    assert [t for t, _ in tok.top_logprobs] == torch.topk(lp, 5).indices.tolist()
    assert tok.top_logprobs[0] == (tok.token_id, pytest.approx(tok.logprob))
    vals = [v for _, v in tok.top_logprobs]
    assert vals == sorted(vals, reverse=True)
    zero = SequenceSampler(SamplingParams(logprobs=0, seed=1), [1]).sample(x)
    assert zero.logprob is not None and zero.top_logprobs == ()
    assert SequenceSampler(SamplingParams(seed=1), [1]).sample(x).logprob is None


def test_batched_rows_sample_as_alone():
    params = [
        SamplingParams(seed=7, presence_penalty=1.0, logprobs=3),
        SamplingParams(temperature=0.0),
        SamplingParams(seed=8, repetition_penalty=1.5, top_k=10),
    ]
    rows = torch.stack([row(10 + i) for i in range(3)])
    batch = sample_sequences(rows, [SequenceSampler(p, [1, 2]) for p in params])
    alone = [sample_sequences(rows[i : i + 1], [SequenceSampler(p, [1, 2])])[0] for i, p in enumerate(params)]
    assert batch == alone


def test_choice_seeds_are_seed_plus_index_and_wrap():
    assert choice_seed(10, 3) == 13
    assert choice_seed(None, 3) is None
    assert choice_seed((1 << 64) - 1, 1) == 0
    a = SequenceSampler(SamplingParams(seed=5), [1]).fork(2)
    b = SequenceSampler(SamplingParams(seed=7), [1])
    x = row(4)
    assert [a.sample(x).token_id for _ in range(10)] == [b.sample(x).token_id for _ in range(10)]


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"seed": 1 << 64}, "seed"),
        ({"seed": -(1 << 63) - 1}, "seed"),
        ({"n": 0}, "n"),
        ({"n": 1000}, "n"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logit_bias": ((-1, 1.0),)}, "logit_bias"),
        ({"logit_bias": ((1, float("nan")),)}, "logit_bias"),
    ],
)
def test_bad_sampling_params_are_named(kwargs, param):
    with pytest.raises(InvalidRequestError) as err:
        validate_params(SamplingParams(**kwargs))
    assert err.value.param == param


def test_logit_bias_outside_vocabulary_is_refused_before_queueing():
    eng = make_engine()
    with pytest.raises(InvalidRequestError) as err:
        eng.add_request([5, 6, 7], SamplingParams(logit_bias=((10_000, 1.0),)))
    assert err.value.param == "logit_bias"
    assert not eng.has_unfinished()


def test_engine_penalties_and_logprobs_batched_equal_alone():
    params = SamplingParams(
        max_tokens=8,
        seed=3,
        presence_penalty=0.7,
        frequency_penalty=0.3,
        repetition_penalty=1.2,
        logprobs=2,
        ignore_eos=True,
    )
    prompt = random_tokens(21, 1)

    def run(with_others: bool):
        eng = make_engine()
        req = eng.add_request(prompt, params)
        if with_others:
            for i in range(3):
                eng.add_request(random_tokens(30 + i, 5 + i), SamplingParams(max_tokens=6, seed=i))
        logprobs = []
        while eng.has_unfinished():
            for o in eng.step():
                if o.request_id == req.request_id:
                    logprobs.extend(o.logprobs)
        return req.output_token_ids, logprobs

    alone, batched = run(False), run(True)
    assert alone[0] == batched[0] and len(alone[0]) == 8
    assert [lp.token_id for lp in alone[1]] == alone[0]
    for a, b in zip(alone[1], batched[1], strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert len(a.top_logprobs) == 2
