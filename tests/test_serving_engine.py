"""The serving engine alone (no HTTP): mixed concurrent requests give each request's own result
(greedy: Generator.generate alone; seeded samples: themselves alone), no new step signatures after
warm-up, cancelled rows are freed."""

import gc
import random
import threading
from collections import Counter

import pytest

from generation import Generator
from generation.serving.device_rows import batch_buckets, chunk_shape, length_buckets
from generation.serving.engine import Engine, EngineConfig, EngineError
from generation.serving.params import SamplingParams

MAX_LENGTH, WIDTH = 64, 16
WORDS = "the of and a to in is was it for on with as his that by at from her he said".split()


@pytest.fixture(scope="module")
def generator():
    return Generator.from_pretrained("checkpoints/bloom-tiny", dtype="fp32", device="cpu")


@pytest.fixture(scope="module")
def engine(generator):
    engine = Engine(generator, EngineConfig(max_batch=4, max_length=MAX_LENGTH, bucket_width=WIDTH))
    engine.start()
    assert engine.ready.wait(60)
    yield engine
    engine.stop()


def alone(generator, prompt, params: SamplingParams):
    extra = {}
    if params.sampling:
        extra = dict(do_sample=True, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                     seed=params.seed, num_return_sequences=params.n)
    if params.repetition_penalty != 1.0:
        extra["repetition_penalty"] = params.repetition_penalty
    result = generator.generate([prompt], max_length=MAX_LENGTH, max_new_tokens=params.max_tokens, ignore_eos=False,
                                bucket_width=WIDTH, stop=params.stop or None, **extra)[0]
    return [s.token_ids for s in result.sequences]


def test_buckets():
    assert batch_buckets(1) == [1] and batch_buckets(6) == [1, 2, 4, 6] and batch_buckets(8) == [1, 2, 4, 8]
    # Chunks: from 8 up, at most 4 sizes (a Gaudi keeps 4 graphs per step module: HPU_MAX_GRAPHS).
    # (segment length, segment counts): segments of max(8, C/4) tokens, 1, 2, 4 of them
    assert chunk_shape(32) == (8, [1, 2, 4]) and chunk_shape(5) == (5, [1]) and chunk_shape(12) == (12, [1])
    assert chunk_shape(128) == (32, [1, 2, 4]) and chunk_shape(16) == (8, [1, 2]) and chunk_shape(24) == (8, [1, 2, 3])
    assert length_buckets(64, 16) == [16, 32, 48, 64] and length_buckets(50, 16) == [16, 32, 48, 50]
    assert length_buckets(64, 0) == [64]


def test_mixed_load_equals_each_request_alone(generator, engine):
    rng = random.Random(0)
    warm = set(generator.backend.signatures)
    cases = []
    for i in range(12):
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 30)))
        kind = i % 4
        params = SamplingParams(max_tokens=rng.randint(1, 30))
        if kind == 1:
            params = SamplingParams(max_tokens=12, temperature=0.7, top_k=rng.choice([0, 5]), top_p=rng.choice([1.0, 0.8]),
                                    seed=i, n=rng.choice([1, 2]))
        elif kind == 2:
            params = SamplingParams(max_tokens=10, repetition_penalty=1.3)
        elif kind == 3:
            params = SamplingParams(max_tokens=20, stop=[" the", "and"])
        cases.append((prompt, params))
    handles = []

    def submit_later(i, prompt, params):
        threading.Event().wait(rng.random() * 0.05)  # arrivals spread over the running steps
        handles.append((i, engine.submit(generator.tokenizer.encode(prompt), params)))

    threads = [threading.Thread(target=submit_later, args=(i, p, s)) for i, (p, s) in enumerate(cases)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results = {i: [s.token_ids for s in h.result(timeout=60)] for i, h in handles}
    # Signatures are checked before the reference runs (Generator.generate has its own shapes).
    assert generator.backend.signatures == warm
    for i, (prompt, params) in enumerate(cases):
        assert results[i] == alone(generator, prompt, params), (i, prompt, params)
    assert engine.running_rows == 0 and engine.queue_length == 0
    # The load really shared steps, and rows moved down and buckets changed as rows left.
    assert engine.stats["peak_rows"] > 1 and engine.stats["row_moves"] > 0 and engine.stats["bucket_changes"] > 1
    # Prompts that came while rows ran joined in chunks inside their decode steps.
    assert engine.stats["prompts_chunked"] > 0, engine.stats


def test_waiting_requests_are_prefilled_together(generator):
    """A burst of arrivals is prefilled in groups of at most max_prefill (4, then 3 in the 4-row
    prefill with a filler row), not one by one, a prompt far longer than the others alone; every row
    still equals its request alone."""
    engine = Engine(generator, EngineConfig(max_batch=8, max_length=MAX_LENGTH, bucket_width=WIDTH, max_prefill=4))
    groups = []
    real_prefill = engine.device_rows.prefill
    engine.device_rows.prefill = lambda prompts, *rest: groups.append([len(p) for p in prompts]) or real_prefill(prompts, *rest)
    rng = random.Random(1)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 10))) for _ in range(7)]
    prompts.append(" ".join(["the"] * 50))  # 64 slots for it and 16 for the others: padding them wastes too much
    params = SamplingParams(max_tokens=6)
    handles = [engine.submit(generator.tokenizer.encode(p), params) for p in prompts]
    while engine.step():
        pass
    assert [len(g) for g in groups] == [4, 3, 1] and groups[-1][0] >= 50
    for prompt, handle in zip(prompts, handles):
        assert [s.token_ids for s in handle.result(1)] == alone(generator, prompt, params), prompt


def test_a_burst_at_an_idle_engine_is_gathered_and_its_rows_start_together(generator, monkeypatch):
    """Requests arriving one after another at an idle engine, each soon after the last, are all
    prefilled (in groups) before any row chooses a token or decodes, so no mixed step stalls the
    first and their rows start together. Every request (greedy, sampled, penalised) equals itself
    alone."""
    from generation.serving import admission

    monkeypatch.setattr(admission, "BURST_WAIT_S", 10.0)
    engine = Engine(generator, EngineConfig(max_batch=8, max_length=MAX_LENGTH, bucket_width=WIDTH, max_prefill=2,
                                            burst_wait_ms=500))  # generous: arrivals 20 ms apart on a busy CI
    cases = [("the cat sat", SamplingParams(max_tokens=9)),
             ("a dog and a cat", SamplingParams(max_tokens=8, temperature=0.8, seed=3)),
             ("in the house of", SamplingParams(max_tokens=10, frequency_penalty=1.5, presence_penalty=0.5)),
             ("it was the best of", SamplingParams(max_tokens=7, repetition_penalty=1.3)),
             ("on his way", SamplingParams(max_tokens=12, frequency_penalty=2.0)),
             ("she said that", SamplingParams(max_tokens=6))]
    handles, started = [], []
    real_prefill = engine.device_rows.prefill
    engine.device_rows.prefill = lambda *a: started.append(sum(h.first_token_at is not None for h in handles)) \
        or real_prefill(*a)

    def arrive():
        for prompt, params in cases[1:]:
            threading.Event().wait(0.02)
            handles.append(engine.submit(generator.tokenizer.encode(prompt), params))

    handles.append(engine.submit(generator.tokenizer.encode(cases[0][0]), cases[0][1]))
    arrivals = threading.Thread(target=arrive)
    arrivals.start()
    engine.step()
    arrivals.join()
    # A penalised row's counts hold its own tokens only.
    for slot, row in enumerate(engine.rows):
        if row is not None and row.handle.params.frequency_penalty:
            counts = engine.opts.counts[slot]
            assert {int(t): int(counts[t]) for t in counts.nonzero()} == Counter(row.ids), row.handle.prompt_ids
    while engine.step():
        pass
    assert engine.stats["prompts_prefilled"] == 6 and engine.stats["mixed_steps"] == 0
    assert started == [0, 0, 0]  # every group prefilled before the first token
    on_their_own = Engine(generator, EngineConfig(max_batch=8, max_length=MAX_LENGTH, bucket_width=WIDTH))
    for (prompt, params), handle in zip(cases, handles):
        ours = [s.token_ids for s in handle.result(1)]
        if params.presence_penalty or params.frequency_penalty:  # the server's alone: one request at a time
            single = on_their_own.submit(generator.tokenizer.encode(prompt), params)
            while on_their_own.step():
                pass
            assert ours == [s.token_ids for s in single.result(1)], prompt
        else:
            assert ours == alone(generator, prompt, params), prompt


def test_a_started_engine_leaves_the_long_lived_heap_out_of_garbage_collection(generator):
    """Once warmed up, the engine freezes what exists (the model, the tokenizer), which a full
    collection would walk holding the interpreter lock (0.22 s with bloom-560m). It still serves,
    exactly."""
    engine = Engine(generator, EngineConfig(max_batch=2, max_length=MAX_LENGTH, bucket_width=WIDTH))
    try:
        engine.start(warm_up=False)
        assert engine.ready.wait(60)
        assert gc.get_freeze_count() > 0
        model = generator.runner.model
        assert not any(o is model for o in gc.get_objects())  # frozen objects are left out of every pass
        params = SamplingParams(max_tokens=5)
        handle = engine.submit(generator.tokenizer.encode("the cat sat"), params)
        assert [s.token_ids for s in handle.result(60)] == alone(generator, "the cat sat", params)
    finally:
        engine.stop()
        gc.unfreeze()  # the process is the test suite's, not a server's


def test_a_request_arriving_during_an_idle_prefill_joins_the_burst(generator):
    """A client late for the gathering, whose request arrives while the burst's first group is
    prefilled, is prefilled before any row chooses a token, not fed later through the running rows'
    steps; every request equals itself alone."""
    engine = Engine(generator, EngineConfig(max_batch=8, max_length=MAX_LENGTH, bucket_width=WIDTH, max_prefill=2,
                                            burst_wait_ms=0))
    params = SamplingParams(max_tokens=6)
    encode = generator.tokenizer.encode
    late, first_tokens = [], []
    real_prefill = engine.device_rows.prefill

    def prefill(*args):
        first_tokens.append(sum(h.first_token_at is not None for h in handles + late))
        if not late:
            late.append(engine.submit(encode("on his way to the"), params))
        return real_prefill(*args)

    engine.device_rows.prefill = prefill
    handles = [engine.submit(encode(p), params) for p in ("the cat sat", "a dog and a cat")]
    engine.step()
    while engine.step():
        pass
    assert first_tokens == [0, 0] and engine.stats["prompts_prefilled"] == 3 and engine.stats["mixed_steps"] == 0
    for prompt, handle in zip(("the cat sat", "a dog and a cat", "on his way to the"), handles + late):
        assert [s.token_ids for s in handle.result(1)] == alone(generator, prompt, params), prompt


@pytest.mark.parametrize("prefill_chunk", [8, 32])
def test_prompts_join_in_segments_while_rows_run(generator, prefill_chunk):
    """Prompts that arrive while a row runs are fed in segments inside its decode steps (a long one
    over several), never in a prefill of their own: the running row gains a token at every step;
    every request still equals itself alone, and no step signature is new after warm-up. With
    8 tokens a step, one segment a step; with 32, four segments of 8, so one step carries several
    prompts, and several pieces of the long one."""
    engine = Engine(generator, EngineConfig(max_batch=4, max_length=MAX_LENGTH, bucket_width=WIDTH,
                                            prefill_chunk=prefill_chunk))
    engine.warm_up()
    warm = set(generator.backend.signatures)
    calls = {"prefill": 0, "mixed": 0}
    carried = []  # the slots of each mixed step's segments
    for name in calls:
        real = getattr(engine.device_rows, name)
        setattr(engine.device_rows, name, lambda *a, real=real, name=name: calls.__setitem__(name, calls[name] + 1) or real(*a))
    real_mixed = engine.device_rows.mixed
    engine.device_rows.mixed = lambda *a: carried.append([seg[0] for seg in a[4]]) or real_mixed(*a)
    encode = generator.tokenizer.encode
    cases = [("the cat sat on the mat", SamplingParams(max_tokens=30, ignore_eos=True))]
    first = engine.submit(encode(cases[0][0]), cases[0][1])
    engine.step()  # nothing ran before it: a plain prefill
    long_prompt = " ".join(WORDS[i % len(WORDS)] for i in range(27))  # over 8-token chunks: 4 of them
    cases += [("a dog and a cat", SamplingParams(max_tokens=8, temperature=0.8, seed=3, n=2)),  # copies of its row
              (long_prompt, SamplingParams(max_tokens=8)),
              ("in the house", SamplingParams(max_tokens=6, repetition_penalty=1.3))]
    handles = [first] + [engine.submit(encode(p), params) for p, params in cases[1:]]
    assert len(encode(long_prompt)) > 3 * 8
    while True:
        row = next((r for r in engine.rows if r is not None and r.handle is first), None)
        before = len(row.ids) if row is not None else None
        if not engine.step():
            break
        if row is not None and any(r is row for r in engine.rows):
            assert len(row.ids) == before + 1  # no step passed it by
    assert generator.backend.signatures == warm
    if prefill_chunk == 8:
        assert calls["prefill"] == 1 and calls["mixed"] >= 4 + 1 + 1 and all(len(c) == 1 for c in carried)
    else:
        assert calls["prefill"] == 1 and max(len(set(c)) for c in carried) >= 2  # several prompts in a step
        assert any(len(c) > len(set(c)) for c in carried)  # the long prompt: several pieces in a step
    assert engine.stats["prompts_chunked"] == 3
    for (prompt, params), handle in zip(cases, handles):
        expected = alone(generator, prompt, params) if not params.ignore_eos else None
        if expected is not None:
            assert [s.token_ids for s in handle.result(1)] == expected, prompt
    [sequence] = first.result(1)
    reference = generator.generate([cases[0][0]], max_length=MAX_LENGTH, max_new_tokens=30, ignore_eos=True,
                                   bucket_width=WIDTH)[0].sequences[0]
    assert sequence.token_ids == reference.token_ids


def test_openai_penalties(generator, engine):
    ids = generator.tokenizer.encode("the cat")
    plain = engine.submit(ids, SamplingParams(max_tokens=24)).result(60)[0].token_ids
    neutral = engine.submit(ids, SamplingParams(max_tokens=24, presence_penalty=0.0, frequency_penalty=0.0,
                                                repetition_penalty=1.0)).result(60)[0].token_ids
    penalised = engine.submit(ids, SamplingParams(max_tokens=24, frequency_penalty=2.0, presence_penalty=1.0)).result(60)[0].token_ids
    assert neutral == plain and penalised != plain
    assert len(set(penalised)) > len(set(plain))  # fewer repeats


def test_stream_events_join_to_the_result(generator, engine):
    params = SamplingParams(max_tokens=25, stop=["and"], logprobs=2)
    handle = engine.submit(generator.tokenizer.encode("the cat and the dog"), params)
    text, ids, lps, final = "", [], [], None
    for event in handle.events(timeout=60):
        if event.kind == "delta":
            text, ids, lps = text + event.text, ids + event.token_ids, lps + event.logprobs
        elif event.kind == "finish":
            final = event.sequence
    assert text == final.text and ids == final.token_ids and len(lps) == len(ids)
    assert all(len(lp.top) == 2 and lp.top[0][1] >= lp.logprob - 1e-6 for lp in lps)


def test_cancel_frees_rows(generator, engine):
    handles = [engine.submit(generator.tokenizer.encode("a b c"), SamplingParams(max_tokens=60)) for _ in range(6)]
    for h in handles:
        h.cancel()
    for _ in range(200):
        if engine.running_rows == 0 and engine.queue_length == 0:
            break
        threading.Event().wait(0.01)
    assert engine.running_rows == 0 and engine.queue_length == 0


def test_rejects_what_cannot_run(generator, engine):
    with pytest.raises(EngineError, match="max_length"):
        engine.submit([5] * MAX_LENGTH, SamplingParams())
    with pytest.raises(EngineError, match="rows"):
        engine.submit([5], SamplingParams(temperature=1.0, n=5))
    with pytest.raises(EngineError, match="empty"):
        engine.submit([], SamplingParams())


def test_a_failing_request_fails_alone(generator, engine, monkeypatch):
    real = engine.device_rows.runner

    class Flaky:
        def __getattr__(self, name):
            return getattr(real, name)

        def prefill(self, ids, lengths, cache):
            if (lengths == 7).any():  # fails the group it is in, then alone
                raise RuntimeError("boom")
            return real.prefill(ids, lengths, cache)

        def mixed(self, tokens, positions, chunk, row, start, length, cache, window):
            if (length == 7).any():  # the bad prompt joining while the other runs
                raise RuntimeError("boom")
            return real.mixed(tokens, positions, chunk, row, start, length, cache, window)

    monkeypatch.setattr(engine.device_rows, "runner", Flaky())
    ok = engine.submit([5] * 3, SamplingParams(max_tokens=5))
    bad = engine.submit([5] * 7, SamplingParams(max_tokens=5))
    with pytest.raises(EngineError, match="boom"):
        bad.result(60)
    [sequence] = ok.result(60)
    assert 1 <= len(sequence.token_ids) <= 5 and engine.running_rows == 0


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_a_half_precision_engine_answers_as_its_generator(dtype):
    """The engine keeps its logits in fp32 whatever the model's dtype: a bf16/fp16 server's rows
    (prefilled, then decoded) give what the same generator gives alone."""
    generator = Generator.from_pretrained("checkpoints/bloom-tiny", dtype=dtype, device="cpu")
    engine = Engine(generator, EngineConfig(max_batch=2, max_length=MAX_LENGTH, bucket_width=WIDTH))
    engine.start()
    try:
        assert engine.ready.wait(60)
        tok = generator.tokenizer
        prompts = ["It was the best of times", "And the king said"]
        params = SamplingParams(max_tokens=8)
        handles = [engine.submit(tok.encode(p), params) for p in prompts]
        got = [[s.token_ids for s in h.result(timeout=60)] for h in handles]
    finally:
        engine.stop()
    assert got == [alone(generator, p, params) for p in prompts]
