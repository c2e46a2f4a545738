"""The async API (engine.api contract): streaming order, usage, early close frees blocks at once, named errors
before any block is taken, stop strings, seeded sampling, shutdown."""

from __future__ import annotations

import asyncio

import pytest

from engine.api import EngineConfig, Finished, GenerationRequest, SamplingParams, TextDelta
from engine.async_engine import AsyncEngine
from engine.attention_kernels import decode_kernel_variant, prefill_kernel_variant
from engine.errors import EngineClosedError, InvalidRequestError, PromptTooLongError
from engine.native_glue import glue_kernel_variant
from tests.engine.engine_helpers import greedy, make_engine, random_tokens, tiny_checkpoint

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture
async def engine():
    ckpt = tiny_checkpoint()
    eng = AsyncEngine(make_engine(ckpt, num_blocks=64), ckpt.tokenizer)
    await eng.start()
    yield eng
    await eng.shutdown()


async def collect(eng: AsyncEngine, req: GenerationRequest) -> list:
    return [ev async for ev in eng.generate(req)]


async def test_stream_is_deltas_then_finished_with_usage(engine):
    events = await collect(engine, GenerationRequest(messages=MESSAGES, params=greedy(12)))
    *deltas, fin = events
    assert all(isinstance(d, TextDelta) for d in deltas) and isinstance(fin, Finished)
    prompt = engine.render_chat(MESSAGES)
    assert fin.finish_reason == "length"
    assert fin.usage.prompt_tokens == len(prompt) and fin.usage.completion_tokens == 12
    assert sum(len(d.token_ids) for d in deltas) == 12
    assert "".join(d.text for d in deltas) == fin.text
    assert fin.ttft_s is not None and fin.ttft_s >= 0
    # same tokens as the synchronous engine gives for the rendered prompt
    core = make_engine()
    ref = core.generate([prompt], greedy(12))[0]
    assert [t for d in deltas for t in d.token_ids] == ref


async def test_second_request_reports_cached_tokens(engine):
    system = {"role": "system", "content": "You answer questions about the cache of prefix blocks. " * 4}
    first = await collect(engine, GenerationRequest(messages=[system, *MESSAGES], params=greedy(2)))
    second = await collect(
        engine, GenerationRequest(messages=[system, MESSAGES[0] | {"content": "hello"}], params=greedy(2))
    )
    a = engine.render_chat([system, *MESSAGES])
    b = engine.render_chat([system, MESSAGES[0] | {"content": "hello"}])
    common = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    assert first[-1].usage.cached_tokens == 0
    assert second[-1].usage.cached_tokens == common > 16  # every shared token, not only whole blocks
    # the first delta already says it (a streamed answer's headers report it before the end)
    assert [first[0].cached_tokens, second[0].cached_tokens] == [0, second[-1].usage.cached_tokens]
    assert engine.stats().prefix_hit_tokens == second[-1].usage.cached_tokens
    assert engine.reset_prefix_cache() is True
    assert engine.stats().blocks_cached == 0
    third = await collect(engine, GenerationRequest(messages=[system, *MESSAGES], params=greedy(2)))
    assert third[-1].usage.cached_tokens == 0


async def test_aclose_mid_stream_frees_blocks_at_once(engine):
    stream = engine.generate(GenerationRequest(prompt_token_ids=random_tokens(100, 1), params=greedy(200)))
    got = 0
    async for ev in stream:
        assert isinstance(ev, TextDelta)
        got += 1
        if got == 3:
            break
    assert engine.stats().blocks_used > 0
    await stream.aclose()
    s = engine.stats()
    assert s.blocks_used == 0 and s.running == 0 and s.waiting == 0
    assert s.blocks_free + s.blocks_cached == s.blocks_total


async def test_cancelled_consumer_task_frees_blocks(engine):
    started = asyncio.Event()

    async def consume():
        async for _ in engine.generate(
            GenerationRequest(prompt_token_ids=random_tokens(50, 2), params=greedy(500))
        ):
            started.set()

    task = asyncio.create_task(consume())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    s = engine.stats()
    assert s.blocks_used == 0 and s.running == 0


async def test_prompt_too_long_is_raised_before_any_block_is_taken():
    ckpt = tiny_checkpoint()
    eng = AsyncEngine(make_engine(ckpt, num_blocks=8, max_model_len=300), ckpt.tokenizer)
    await eng.start()
    try:
        with pytest.raises(PromptTooLongError) as ctx:
            eng.generate(GenerationRequest(prompt_token_ids=random_tokens(300, 3), params=greedy(1)))
        assert (ctx.value.what, ctx.value.prompt_tokens, ctx.value.limit) == ("context", 301, 300)
        with pytest.raises(PromptTooLongError) as pool:
            eng.generate(GenerationRequest(prompt_token_ids=random_tokens(128, 3), params=greedy(1)))
        assert (pool.value.what, pool.value.limit) == ("pool", 8 * 16)
        # an explicit max_tokens that cannot fit beside the prompt is refused too (OpenAI, vLLM)
        with pytest.raises(PromptTooLongError) as both:
            eng.generate(GenerationRequest(prompt_token_ids=random_tokens(100, 3), params=greedy(201)))
        assert (both.value.what, both.value.prompt_tokens, both.value.completion_tokens) == (
            "context",
            100,
            201,
        )
        assert "301 tokens (100 in the messages, 201 in the completion)" in str(both.value)
        # ... and one the whole block pool (128 tokens, smaller than the context here) cannot hold
        with pytest.raises(PromptTooLongError) as pooled:
            eng.generate(GenerationRequest(prompt_token_ids=random_tokens(100, 3), params=greedy(29)))
        assert (pooled.value.what, pooled.value.limit, pooled.value.completion_tokens) == ("pool", 128, 29)
        s = eng.stats()
        assert s.blocks_used == 0 and s.waiting == 0 and s.running == 0 and s.prefix_query_tokens == 0
        # the longest prompt that fits still runs
        events = await collect(
            eng, GenerationRequest(prompt_token_ids=random_tokens(127, 3), params=greedy(1))
        )
        assert events[-1].usage.prompt_tokens == 127
    finally:
        await eng.shutdown()


@pytest.mark.parametrize(
    ("req", "param"),
    [
        (GenerationRequest(prompt_token_ids=[5, 6], params=SamplingParams(max_tokens=0)), "max_tokens"),
        (GenerationRequest(prompt_token_ids=[5, 6], params=SamplingParams(temperature=-0.5)), "temperature"),
        (GenerationRequest(prompt_token_ids=[5, 6], params=SamplingParams(top_p=0.0)), "top_p"),
        (GenerationRequest(prompt_token_ids=[5, 6], params=SamplingParams(top_p=1.5)), "top_p"),
        (GenerationRequest(prompt_token_ids=[5, 6], params=SamplingParams(top_k=-1)), "top_k"),
        (GenerationRequest(prompt_token_ids=[5, 6], params=SamplingParams(stop=("",))), "stop"),
        (GenerationRequest(prompt_token_ids=[]), "prompt"),
        (GenerationRequest(prompt_token_ids=[5, 384]), "prompt"),
        (GenerationRequest(prompt_token_ids=[-1]), "prompt"),
        (GenerationRequest(), "prompt"),
        (GenerationRequest(prompt_token_ids=[5], prompt="hi"), "prompt"),
        (GenerationRequest(prompt=""), "prompt"),
        (GenerationRequest(messages=[{"role": "wizard", "content": "hi"}]), "messages"),
    ],
)
async def test_invalid_requests_are_named_and_take_nothing(engine, req, param):
    with pytest.raises(InvalidRequestError) as err:
        engine.generate(req)
    assert err.value.param == param
    s = engine.stats()
    assert s.blocks_used == 0 and s.waiting == 0 and s.requests == 0


async def test_stop_string_ends_the_stream_and_is_never_emitted(engine):
    prompt = random_tokens(20, 4)
    full = await collect(engine, GenerationRequest(prompt_token_ids=prompt, params=greedy(24)))
    text = full[-1].text
    assert len(text) >= 6
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = text.index(stop)
    events = await collect(
        engine,
        GenerationRequest(
            prompt_token_ids=prompt, params=SamplingParams(max_tokens=24, temperature=0.0, stop=(stop,))
        ),
    )
    fin = events[-1]
    assert fin.finish_reason == "stop" and fin.text == text[:cut]
    assert "".join(e.text for e in events[:-1]) == text[:cut]
    emitted = ""
    for e in events[:-1]:
        emitted += e.text
        assert stop not in emitted


async def test_stop_token_ends_generation(engine):
    prompt = random_tokens(20, 5)
    first = (await collect(engine, GenerationRequest(prompt_token_ids=prompt, params=greedy(1))))[
        0
    ].token_ids[0]
    events = await collect(
        engine,
        GenerationRequest(
            prompt_token_ids=prompt,
            params=SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=(first,)),
        ),
    )
    fin = events[-1]
    assert fin.finish_reason == "stop" and fin.usage.completion_tokens == 1


async def test_seed_reproducibility_alone_and_in_a_crowd(engine):
    prompt = random_tokens(30, 6)
    params = SamplingParams(max_tokens=16, temperature=1.0, top_k=50, seed=123, ignore_eos=True)

    def ids(events):
        return [t for e in events if isinstance(e, TextDelta) for t in e.token_ids]

    a = ids(await collect(engine, GenerationRequest(prompt_token_ids=prompt, params=params)))
    crowd = [
        collect(
            engine,
            GenerationRequest(
                prompt_token_ids=random_tokens(25, 50 + i), params=SamplingParams(max_tokens=16, seed=i)
            ),
        )
        for i in range(5)
    ]
    results = await asyncio.gather(
        collect(engine, GenerationRequest(prompt_token_ids=prompt, params=params)), *crowd
    )
    assert ids(results[0]) == a
    other_seed = ids(
        await collect(
            engine,
            GenerationRequest(
                prompt_token_ids=prompt,
                params=SamplingParams(max_tokens=16, temperature=1.0, top_k=50, seed=124, ignore_eos=True),
            ),
        )
    )
    assert other_seed != a


async def test_concurrent_streams_all_finish_with_their_alone_output(engine):
    prompts = [random_tokens(40 + 7 * i, 70 + i) for i in range(8)]
    results = await asyncio.gather(
        *(collect(engine, GenerationRequest(prompt_token_ids=p, params=greedy(10))) for p in prompts)
    )
    ref = make_engine(enable_prefix_caching=False)
    for p, events in zip(prompts, results, strict=True):
        assert [t for e in events[:-1] for t in e.token_ids] == ref.generate([p], greedy(10))[0]
    assert engine.stats().requests == 8 and engine.stats().blocks_used == 0


async def test_a_step_wakes_the_event_loop_once_for_all_its_streams(engine, monkeypatch):
    loop = asyncio.get_running_loop()
    calls: list[int] = []
    original = loop.call_soon_threadsafe

    def counting(callback, *args, **kwargs):
        batch = args[0] if args else None
        calls.append(len(batch) if isinstance(batch, list) else 1)  # events carried by this wake-up
        return original(callback, *args, **kwargs)

    monkeypatch.setattr(loop, "call_soon_threadsafe", counting)
    prompt = random_tokens(40, 5)
    steps_before = engine.core.num_steps
    results = await asyncio.gather(
        *(collect(engine, GenerationRequest(prompt_token_ids=prompt, params=greedy(10))) for _ in range(4))
    )
    steps = engine.core.num_steps - steps_before
    assert [len(events) for events in results] == [11] * 4  # 10 deltas and Finished, each stream
    assert sum(calls) == 44  # every event delivered, through at most one wake-up per step
    assert 0 < len(calls) <= steps < 44


async def test_shutdown_aborts_open_streams_and_closes_the_engine():
    ckpt = tiny_checkpoint()
    eng = AsyncEngine(make_engine(ckpt), ckpt.tokenizer)
    await eng.start()
    stream = eng.generate(GenerationRequest(prompt_token_ids=random_tokens(10, 7), params=greedy(2000)))
    first = await stream.__anext__()
    assert isinstance(first, TextDelta)
    await eng.shutdown()
    rest = [ev async for ev in stream]
    assert isinstance(rest[-1], Finished) and rest[-1].finish_reason == "abort"
    assert eng.stats().blocks_used == 0
    with pytest.raises(EngineClosedError):
        eng.generate(GenerationRequest(prompt_token_ids=[5], params=greedy(1)))


async def test_from_config_loads_a_checkpoint_and_serves_text_prompts():
    ckpt = tiny_checkpoint()
    eng = AsyncEngine.from_config(None, ckpt.path, EngineConfig(num_blocks=32, device="cpu"))
    # the checkpoint's id, and the decode, prefill and glue kernels' parts where native (engine.native_decode,
    # engine.native_glue)
    runner = eng.core.runner
    kernels = decode_kernel_variant(runner.decode_kernel) + prefill_kernel_variant(runner.prefill_kernel)
    kernels += glue_kernel_variant(runner.glue_kernel)
    assert eng.model_id == ckpt.model_id + kernels
    assert eng.max_model_len == 2048
    named = AsyncEngine.from_config("my-model", ckpt.path, EngineConfig(num_blocks=32, device="cpu"))
    assert named.model_id == "my-model"
    await eng.start()
    try:
        events = await collect(eng, GenerationRequest(prompt="hello world", params=greedy(3)))
        bos = eng.tokenizer.encode("hello world", add_special_tokens=True)
        assert events[-1].usage.prompt_tokens == len(bos)
    finally:
        await eng.shutdown()


async def test_bad_engine_settings_are_rejected():
    ckpt = tiny_checkpoint()
    with pytest.raises(ValueError, match="dtype"):
        AsyncEngine.from_config(None, ckpt.path, EngineConfig(dtype="int3"))
    for bad in (0, "sometimes"):  # refused before anything loads, naming the setting
        with pytest.raises(ValueError, match="engine.dense_min_rows must be auto, null or an integer >= 1"):
            AsyncEngine.from_config(None, ckpt.path, EngineConfig(dense_min_rows=bad))
    with pytest.raises(ValueError, match="max_model_len"):
        make_engine(ckpt, max_model_len=4096)
    with pytest.raises(ValueError, match="scheduling"):
        make_engine(ckpt, scheduling="random")


def test_streams_on_different_event_loops_are_served():
    """One engine, consumed from two successive event loops (as two asyncio.run calls or two test loops do)."""
    ckpt = tiny_checkpoint()
    eng = AsyncEngine(make_engine(ckpt), ckpt.tokenizer)

    async def one(seed: int):
        return await collect(
            eng, GenerationRequest(prompt_token_ids=random_tokens(12, seed), params=greedy(4))
        )

    first = asyncio.run(one(1))
    second = asyncio.run(one(2))
    assert first[-1].usage.completion_tokens == second[-1].usage.completion_tokens == 4
    asyncio.run(eng.shutdown())


async def test_a_failing_forward_ends_every_stream_with_a_named_error_and_frees_blocks():
    ckpt = tiny_checkpoint()
    core = make_engine(ckpt)
    eng = AsyncEngine(core, ckpt.tokenizer)

    def broken(*args, **kwargs):
        raise RuntimeError("simulated kernel failure")

    core.runner.execute = broken
    with pytest.raises(EngineClosedError, match="simulated kernel failure"):
        await collect(eng, GenerationRequest(prompt_token_ids=random_tokens(20, 8), params=greedy(3)))
    s = eng.stats()
    assert s.blocks_used == 0 and s.running == 0 and s.waiting == 0
    with pytest.raises(EngineClosedError):
        eng.generate(GenerationRequest(prompt_token_ids=[5], params=greedy(1)))
    await eng.shutdown()


async def test_prompts_from_the_tokenizer_memo_equal_whole_encodes_per_tenant(engine):
    """A repeated system prompt comes from the tokenizer's piece memo of its tenant (engine.piece_memo): the
    prompt ids, tokens and cached counts are those of a whole-text encode of the rendered chat."""
    system = {"role": "system", "content": "You answer questions about the cache of prefix blocks. " * 8}
    memo = engine.tokenizer.pieces
    assert memo.exact
    memo.clear()
    hits, cached, tokens = [], [], []
    core = make_engine()
    for salt, question in [("a", "hi"), ("a", "what now?"), ("b", "what now?")]:
        messages = [system, {"role": "user", "content": question}]
        req = GenerationRequest(messages=messages, params=greedy(3), cache_salt=salt)
        whole = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(messages))
        before = memo.hits
        assert engine.prompt_token_ids(req) == whole
        hits.append(memo.hits - before)
        events = await collect(engine, req)
        assert events[-1].usage.prompt_tokens == len(whole)
        cached.append(events[-1].usage.cached_tokens)
        tokens.append([t for e in events[:-1] for t in e.token_ids])
        assert tokens[-1] == core.generate([whole], greedy(3))[0]
    assert hits == [0, 1, 0]  # the first render of tenant a stored the system piece; b has its own scope
    assert cached[0] == 0 and cached[1] > 16 and cached[2] == 0
