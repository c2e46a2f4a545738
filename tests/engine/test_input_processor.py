"""Tests of ``engine.input_processor``: request checks (each names its parameter, nothing is taken) and the
engine request built for a checked prompt."""

from __future__ import annotations

import pytest

from engine.api import SamplingParams
from engine.block_hash import hash_request_blocks
from engine.errors import InvalidRequestError, PromptTooLongError
from engine.input_processor import InputProcessor, validate_params, validate_prompt
from engine.kv_cache_manager import KVCacheManager

EOS = (2, 7)


class Letters:
    """A decoder of ids 0-25 as the letters a-z."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(97 + i % 26) for i in ids)


def processor(
    tokenizer: Letters | None = None, *, num_blocks: int = 8, max_model_len: int = 64
) -> InputProcessor:
    return InputProcessor(
        KVCacheManager(num_blocks, 4),
        vocab_size=100,
        max_model_len=max_model_len,
        model_id="m",
        tokenizer=tokenizer,
        eos_token_ids=EOS,
        clock=lambda: 12.5,
    )


@pytest.mark.parametrize(
    ("params", "param"),
    [
        (SamplingParams(max_tokens=0), "max_tokens"),
        (SamplingParams(temperature=-0.1), "temperature"),
        (SamplingParams(temperature=float("nan")), "temperature"),
        (SamplingParams(top_p=0.0), "top_p"),
        (SamplingParams(top_k=-1), "top_k"),
        (SamplingParams(stop=("",)), "stop"),
        (SamplingParams(stop_token_ids=(-3,)), "stop_token_ids"),
    ],
)
def test_bad_parameters_are_named(params: SamplingParams, param: str) -> None:
    with pytest.raises(InvalidRequestError) as err:
        validate_params(params)
    assert err.value.param == param


@pytest.mark.parametrize("prompt", [[], [100], [-1], [True], [1.0]])
def test_bad_prompts_are_named(prompt: list) -> None:
    with pytest.raises(InvalidRequestError) as err:
        validate_prompt(prompt, 100)
    assert err.value.param == "prompt"


def test_check_prompt_refuses_what_cannot_fit_and_stop_strings_without_a_tokenizer() -> None:
    p = processor(max_model_len=20)
    with pytest.raises(InvalidRequestError) as err:
        p.check_prompt([1, 2], SamplingParams(stop=("x",)))
    assert err.value.param == "stop"
    with pytest.raises(PromptTooLongError) as ctx:
        p.check_prompt(list(range(20)), SamplingParams())
    assert (ctx.value.what, ctx.value.prompt_tokens, ctx.value.limit) == ("context", 21, 20)
    with pytest.raises(PromptTooLongError) as both:
        p.check_prompt(list(range(10)), SamplingParams(max_tokens=11))
    assert (both.value.what, both.value.completion_tokens) == ("context", 11)
    with pytest.raises(PromptTooLongError) as pool:
        processor(num_blocks=2).check_prompt(list(range(8)), SamplingParams(max_tokens=1))
    assert (pool.value.what, pool.value.limit) == ("pool", 8)
    p.check_prompt(list(range(19)), SamplingParams(max_tokens=1))  # prompt + 1 == max_model_len fits
    p.check_prompt(list(range(10)), SamplingParams(max_tokens=10))


def test_a_pool_smaller_than_the_context_bounds_max_tokens_as_the_context_does() -> None:
    """An explicit ``max_tokens`` the whole block pool cannot hold beside the prompt is refused up front (it
    was cut at the pool's size and reported as ``length``); without one, the default stops at the pool."""
    p = processor(num_blocks=4, max_model_len=64)  # the pool holds 16 tokens, the context 64
    with pytest.raises(PromptTooLongError) as err:
        p.check_prompt(list(range(6)), SamplingParams(max_tokens=11))
    value = err.value
    assert (value.what, value.limit, value.prompt_tokens, value.completion_tokens) == ("pool", 16, 6, 11)
    assert "17 tokens of KV cache (6 in the messages, 11 in the completion)" in str(value)
    p.check_prompt(list(range(6)), SamplingParams(max_tokens=10))  # 16 fit
    assert p.make_request("r", list(range(6)), SamplingParams(max_tokens=None), "").max_tokens == 10
    wide = processor(num_blocks=32, max_model_len=64)  # the context is the smaller limit: as before
    assert wide.make_request("s", list(range(6)), SamplingParams(max_tokens=None), "").max_tokens == 58


def test_make_request_resolves_max_tokens_stop_ids_and_hashes_full_prompt_blocks() -> None:
    p = processor(Letters(), max_model_len=20)
    prompt = list(range(10))
    req = p.make_request(
        "r", prompt, SamplingParams(max_tokens=50, stop_token_ids=(9,), stop=("z",)), "tenant"
    )
    assert req.max_tokens == 10  # the room left in the context window
    assert req.stop_token_ids == frozenset({2, 7, 9})
    assert req.extra_keys == ("m", "tenant") and req.arrival_time == 12.5
    assert req.block_hashes == hash_request_blocks(prompt, 4, ("m", "tenant"))  # 2 full blocks
    assert len(req.block_hashes) == 2 and req.output is not None
    assert req.num_computed_tokens == 0 and req.num_cached_tokens is None
    plain = processor().make_request("s", [1, 2], SamplingParams(max_tokens=3, ignore_eos=True), "")
    assert plain.max_tokens == 3 and plain.stop_token_ids == frozenset() and plain.output is None
