"""Tests of ``engine.output_processor``: stop checks in order, held-back text, final outputs, counters, and
block hashes that grow with generated tokens."""

from __future__ import annotations

from engine.api import SamplingParams
from engine.block_hash import hash_request_blocks
from engine.input_processor import InputProcessor
from engine.kv_cache_manager import KVCacheManager
from engine.output_processor import OutputProcessor
from engine.request import Request
from engine.stats import EngineCounters

EOS = 0


class Letters:
    """A decoder of ids 0-25 as the letters a-z."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(97 + i % 26) for i in ids)


def setup(
    params: SamplingParams, prompt: list[int] | None = None
) -> tuple[OutputProcessor, Request, EngineCounters]:
    kv = KVCacheManager(16, 4)
    inputs = InputProcessor(
        kv,
        vocab_size=26,
        max_model_len=64,
        model_id="m",
        tokenizer=Letters(),
        eos_token_ids=(EOS,),
        clock=lambda: 1.0,
    )
    counters = EngineCounters()
    return (
        OutputProcessor(counters, 4, kv.hash_fn),
        inputs.make_request("r", prompt or [1, 2, 3], params, ""),
        counters,
    )


def test_tokens_stream_text_until_max_tokens_then_one_final_output() -> None:
    out, req, counters = setup(SamplingParams(max_tokens=3))
    steps = [out.process_token(req, t, 2.0 + k) for k, t in enumerate([7, 4, 11])]
    assert [(s.new_token_ids, s.text, s.finished) for s in steps] == [
        ([7], "h", False),
        ([4], "e", False),
        ([11], "l", True),
    ]
    final = steps[-1]
    assert final.finish_reason == "length" and req.finish_reason == "length"
    assert (final.usage.prompt_tokens, final.usage.completion_tokens, final.usage.cached_tokens) == (3, 3, 0)
    assert final.ttft_s == 1.0 and final.full_text == "hel"
    assert counters.decode_tokens == 3 and counters.requests == 1


def test_stop_token_finishes_first_and_its_text_is_never_emitted() -> None:
    out, req, _ = setup(SamplingParams(max_tokens=1, stop=("a",)))
    final = out.process_token(req, EOS, 2.0)  # EOS decodes to "a", a stop string too: the stop token wins
    assert (final.finished, final.finish_reason, final.text, final.full_text) == (True, "stop", "", "")
    assert final.new_token_ids == [EOS]


def test_a_stop_token_has_no_logprob_the_tokens_of_the_text_do() -> None:
    """A trial: '<|im_end|>' came back in ``logprobs`` after 'Yes.', so their tokens did not spell the text."""
    from engine.api import TokenLogprob

    out, req, _ = setup(SamplingParams(max_tokens=5, logprobs=0))
    word = out.process_token(req, 7, 2.0, TokenLogprob(7, -0.1))
    final = out.process_token(req, EOS, 3.0, TokenLogprob(EOS, -0.2))
    assert (word.text, [e.token_id for e in word.logprobs]) == ("h", [7])
    assert (final.finish_reason, final.new_token_ids, final.logprobs) == ("stop", [EOS], [])


def test_stop_string_cuts_the_text_before_it() -> None:
    out, req, _ = setup(SamplingParams(max_tokens=10, stop=("cd",)))
    first = out.process_token(req, 1, 2.0)  # "b"
    held = out.process_token(req, 2, 3.0)  # "c" may start the stop string: held back
    final = out.process_token(req, 3, 4.0)  # "d"
    assert (first.text, held.text, held.finished) == ("b", "", False)
    assert (final.finished, final.finish_reason, final.full_text) == (True, "stop", "b")


def test_finish_flushes_held_text_and_abort_counts_as_finished() -> None:
    out, req, counters = setup(SamplingParams(max_tokens=10, stop=("cd",)))
    out.process_token(req, 2, 2.0)  # "c" held back
    final = out.finish(req, "abort")
    assert (final.finished, final.finish_reason, final.text, final.new_token_ids) == (True, "abort", "c", [])
    assert req.finish_reason == "abort" and counters.requests == 1
    untouched, req2, _ = setup(SamplingParams())
    assert untouched.finish(req2, "abort").ttft_s is None


def test_generated_tokens_extend_the_block_hashes_by_whole_blocks() -> None:
    out, req, _ = setup(SamplingParams(max_tokens=10), prompt=[1, 2, 3])
    assert req.block_hashes == []
    out.process_token(req, 4, 2.0)  # 4 tokens: the first block is full
    assert req.block_hashes == hash_request_blocks([1, 2, 3, 4], 4, ("m", ""))
    for t in (5, 6, 7):
        out.process_token(req, t, 3.0)
    assert len(req.block_hashes) == 1
    out.process_token(req, 8, 4.0)
    assert req.block_hashes == hash_request_blocks([1, 2, 3, 4, 5, 6, 7, 8], 4, ("m", ""))
