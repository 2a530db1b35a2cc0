"""The prefix cache in the server: the official ``openai`` client against a real server on a
loopback port. Concurrent requests sharing a system prompt and not, arriving on an idle engine
(prefill groups) and while rows run (prompts joining in segments), give each request's answer
alone; a hit never returns another adapter's keys and values; the usage and /metrics say what the
pool served; warm-up's step shapes are all a load needs."""

from __future__ import annotations

import random
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from generation import Generator
from lora_adapters import make_adapter
from servers import engine_server

CKPT = dict(hidden_size=64, n_layer=2, n_head=4, seed=7)
MAX_LENGTH, WIDTH = 160, 32
SYSTEM = ("You are a helpful assistant who answers every question about the weather, the sea and the "
          "stars in one short sentence, politely and plainly, without making anything up. ")
QUESTIONS = ["What is the sea like today?", "Will it rain?", "Name a star.", "Why is the sky blue?",
             "Is the tide high?", "How cold is it?"]
OTHERS = ["the cat sat on the mat and", "It was the best of times, it was", "a b c d"]


@pytest.fixture(scope="module")
def folders(make_ckpt, tmp_path_factory):
    base = make_ckpt(**CKPT)
    return base, {"qkv": make_adapter(base, tmp_path_factory.mktemp("qkv"), seed=21, r=4, lora_alpha=8,
                                      target_modules=["query_key_value"])}


@pytest.fixture(scope="module")
def server(folders):
    base, adapters = folders
    generator = Generator.from_pretrained(base, device="cpu", lora=adapters, prefix_cache="16MB")
    with engine_server(generator, "base", metrics=True, max_batch=8, max_length=MAX_LENGTH, bucket_width=WIDTH,
                       max_prefill=4, prefill_chunk=32) as running:
        yield generator, running.engine, running.port


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server[2]}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def references(folders):
    base, adapters = folders
    return {"base": Generator.from_pretrained(base, device="cpu"),
            "qkv": Generator.from_pretrained(base, device="cpu", peft_weights=adapters["qkv"])}


def alone(generator, prompt, max_tokens):
    return generator.generate([prompt], max_length=MAX_LENGTH, max_new_tokens=max_tokens, ignore_eos=False)[0].text


def ask(client, model, prompt, max_tokens, delay=0.0):
    time.sleep(delay)
    return client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0)


def cached_of(response) -> int:
    return response.usage.prompt_tokens_details.cached_tokens


def test_concurrent_requests_sharing_a_system_prompt_equal_each_alone(server, client, references):
    generator, engine, _ = server
    warm = set(generator.backend.signatures)
    rng = random.Random(3)
    # Two long rows start on an idle engine; the rest arrive while they run, most of them sharing the
    # system prompt (in the pool after the first of them), and join in segments after a copy.
    cases = [(OTHERS[0], 120, 0.0), (OTHERS[1], 120, 0.0)]
    cases += [(SYSTEM + q if i % 4 else rng.choice(OTHERS), rng.randint(4, 12), 0.02 + rng.random() * 0.1)
              for i, q in enumerate(QUESTIONS * 2)]
    ask(client, "base", SYSTEM + QUESTIONS[0], 2)
    with ThreadPoolExecutor(len(cases)) as pool:
        answers = list(pool.map(lambda c: ask(client, "base", c[0], c[1], c[2]), cases))
    for (prompt, max_tokens, _), answer in zip(cases, answers):
        assert answer.choices[0].text == alone(references["base"], prompt, max_tokens), prompt
    shared = [cached_of(a) for (p, _, _), a in zip(cases, answers) if p.startswith(SYSTEM)]
    assert all(n > 0 for n in shared)
    assert engine.stats["joined_after_a_hit"] > 0, engine.stats  # prompts fed in segments after a copy
    assert generator.backend.signatures == warm  # warm-up ran every shape, the extends included
    # A burst onto the idle engine: prefill groups copy what the pool holds.
    prefills = engine.stats["prefills"]
    burst = [(SYSTEM + q, 6) for q in QUESTIONS[:4]]
    with ThreadPoolExecutor(len(burst)) as pool:
        again = list(pool.map(lambda c: ask(client, "base", *c), burst))
    assert engine.stats["prefills"] > prefills
    for (prompt, max_tokens), answer in zip(burst, again):
        assert answer.choices[0].text == alone(references["base"], prompt, max_tokens)
        assert cached_of(answer) > 0
    assert generator.backend.signatures == warm


def stepped_engine(folder, max_tokens: int):
    """An engine with a prefix cache, stepped in this thread: (generator, engine, run), where
    ``run(prompts)`` submits the prompts together and steps until all are answered (their handles)."""
    from generation.serving.engine import Engine, EngineConfig
    from generation.serving.params import SamplingParams

    generator = Generator.from_pretrained(folder, device="cpu", prefix_cache="16MB")
    engine = Engine(generator, EngineConfig(max_batch=8, max_length=MAX_LENGTH, bucket_width=WIDTH, max_prefill=4))
    encode, params = generator.tokenizer.encode, SamplingParams(max_tokens=max_tokens)

    def run(prompts):
        handles = [engine.submit(encode(p), params) for p in prompts]
        while engine.step():
            pass
        return handles

    return generator, engine, run


def test_waiting_prompts_the_pool_holds_are_prefilled_apart_from_those_it_does_not(folders, references):
    """Queued on an idle engine: a long prompt the pool has never seen, then prompts whose system
    prompt it holds. Grouped together, the new prompt's rest would need the whole length and the
    group would copy nothing; apart, every held prompt copies its blocks."""
    generator, engine, run = stepped_engine(folders[0], max_tokens=4)
    run([SYSTEM + QUESTIONS[0]])  # the system prompt into the pool
    fresh = "A long prompt of its own that the pool has never seen, about rivers and hills, " * 2
    prompts = [fresh] + [SYSTEM + q for q in QUESTIONS[1:4]]
    handles = run(prompts)
    assert handles[0].cached_tokens == 0 and all(h.cached_tokens > 0 for h in handles[1:])
    for prompt, handle in zip(prompts, handles):
        assert handle.result(1)[0].text == alone(references["base"], prompt, 4)


def test_a_prefill_groups_filler_rows_are_not_lookups(folders):
    """Three prompts prefilled together on an idle engine run as a group of 4 (a filler row makes up
    the bucket): the pool's stats (what /metrics exports) count 3 lookups, all hits."""
    generator, engine, run = stepped_engine(folders[0], max_tokens=2)
    run([SYSTEM + QUESTIONS[0]])  # the system prompt into the pool: one lookup, a miss
    stats = generator.runner.prefix.stats
    lookups, hits, prefills = stats.lookups, stats.hits, engine.stats["prefills"]
    handles = run([SYSTEM + q for q in QUESTIONS[1:4]])
    assert engine.stats["prefills"] == prefills + 1  # one group
    assert engine.device_rows.prefill_size(3) == 4  # of four rows: one filler
    assert all(h.cached_tokens > 0 for h in handles)
    assert (stats.lookups - lookups, stats.hits - hits) == (3, 3)


def test_a_prefix_computed_for_a_group_is_one_miss_as_it_is_alone(folders, references):
    """Three prompts sharing a system prompt the pool has never held, prefilled together: the
    shared prefix is computed once, for one of them, which counts a miss (no cached tokens); the
    other two count hits, as a prompt arriving alone after it would. So a prefix costs one miss
    however its prompts arrive."""
    generator, engine, run = stepped_engine(folders[0], max_tokens=2)
    stats = generator.runner.prefix.stats
    prompts = [SYSTEM + q for q in QUESTIONS[:3]]
    handles = run(prompts)
    assert (stats.lookups, stats.hits) == (3, 2)
    assert sorted(h.cached_tokens > 0 for h in handles) == [False, True, True]
    assert stats.cached_tokens == sum(h.cached_tokens for h in handles)
    for prompt, handle in zip(prompts, handles):
        assert handle.result(1)[0].text == alone(references["base"], prompt, 2)
    later = run([SYSTEM + QUESTIONS[3]])  # alone, after: a hit of the same blocks
    assert (stats.lookups, stats.hits) == (4, 3)
    assert later[0].cached_tokens >= max(h.cached_tokens for h in handles) > 0


def test_a_hit_never_crosses_adapters(server, client, references):
    prompt = SYSTEM + "Tell me about the moon."
    base = ask(client, "base", prompt, 8)
    adapted = ask(client, "qkv", prompt, 8)
    assert base.choices[0].text == alone(references["base"], prompt, 8)
    assert adapted.choices[0].text == alone(references["qkv"], prompt, 8)
    assert adapted.choices[0].text != base.choices[0].text  # the adapter changes the answer
    assert cached_of(adapted) == 0  # the base model's blocks of the same prompt are not the adapter's
    assert cached_of(ask(client, "qkv", prompt, 8)) > 0  # its own are


def test_a_conversation_resent_finds_its_previous_turn(server, client, references):
    first_prompt = SYSTEM + "What do you see at night?"
    first = ask(client, "base", first_prompt, 24)
    follow = first_prompt + first.choices[0].text + " And in the morning?"
    second = ask(client, "base", follow, 8)
    assert second.choices[0].text == alone(references["base"], follow, 8)
    assert cached_of(second) >= len(references["base"].tokenizer.encode(first_prompt)) // 32 * 32


def test_metrics_export_the_pool(server, client):
    ask(client, "base", SYSTEM + QUESTIONS[0], 2)
    with urllib.request.urlopen(f"http://127.0.0.1:{server[2]}/metrics") as response:
        text = response.read().decode()
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
              if line.startswith("bloom_prefix_cache_")}
    assert values["bloom_prefix_cache_hits"] > 0 and values["bloom_prefix_cache_cached_tokens"] > 0
    assert 0 < values["bloom_prefix_cache_used_blocks"] <= values["bloom_prefix_cache_capacity_blocks"]
    assert values["bloom_prefix_cache_lookups"] == values["bloom_prefix_cache_hits"] + values["bloom_prefix_cache_misses"]


@pytest.mark.slow
def test_two_ranks_serve_hits_with_one_process_answers(folders, references, tmp_path):
    """Rank 0 decides; the other rank makes the same pool calls (copy_prefix, store_prefix and the
    prefills) in the same order, so its shard of every block is where rank 0 thinks it is."""
    from test_serving_tp import launch, stop

    serve = ["--serve", "--max_batch", "4", "--max_length", str(MAX_LENGTH), "--bucket_width", str(WIDTH),
             "--max_prefill", "2", "--prefix_cache", "16MB"]
    proc, port = launch(folders[0], serve, 2, tmp_path / "two.log")
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
        cases = [(SYSTEM + q, 6, 0.03 * i) for i, q in enumerate(QUESTIONS[:4])] + [(OTHERS[0], 40, 0.0)]
        for round_ in range(2):
            with ThreadPoolExecutor(len(cases)) as pool:
                answers = list(pool.map(lambda c: ask(client, folders[0].name, c[0], c[1], c[2]), cases))
            for (prompt, max_tokens, _), answer in zip(cases, answers):
                assert answer.choices[0].text == alone(references["base"], prompt, max_tokens), prompt
        assert all(cached_of(a) > 0 for (p, _, _), a in zip(cases, answers) if p.startswith(SYSTEM))
    finally:
        assert stop(proc) in (0, -2, 130)
