"""The prefix cache (bloom_hpu/prefix_cache.py, bloom_hpu/runtime/prefixed.py, generation/run/prefix_pool.py):
with it, prompts that share whole blocks with earlier ones (or with each other) copy their keys and
values instead of computing them, and every result is transformers' on the same weights: greedy
tokens, beams and log-probs (fp32, 1e-5); seeded samples those of the same generator without it.
"""

from __future__ import annotations

import re

import pytest
import torch
import transformers

from bloom_hpu.prefix_cache import PrefixCache
from dequantized import write_dequantized
from generation.generator import Generator
from generation.run.prefix_pool import PrefixCacheError, parse_size
from utils.random_checkpoint import make_random_checkpoint

SHARED = "Question: what comes after one? Answer: two. Question: and after two? Answer: three. " * 3
PROMPTS = [SHARED + "Question: after three?", SHARED + "Question: before one? Answer:", SHARED + "Q"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_random_checkpoint(tmp_path_factory.mktemp("prefix"), hidden_size=64, n_layer=3, n_head=4, seed=7)


@pytest.fixture(scope="module")
def reference(folder):
    return transformers.BloomForCausalLM.from_pretrained(folder).eval()


def hf_greedy(model, ids: list[int], new: int) -> tuple[list[int], list[float]]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False, output_scores=True,
                             return_dict_in_generate=True, pad_token_id=3)
    tokens = out.sequences[0, len(ids):].tolist()
    return tokens, [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.scores, tokens)]


def common_length(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def check_against(reference, generator, prompts, new=10, **options):
    results = generator.generate(prompts, max_length=max(len(generator.tokenizer.encode(p)) for p in prompts) + new,
                                 ignore_eos=True, logprobs=True, **options)
    for prompt, result in zip(prompts, results):
        ids = generator.tokenizer.encode(prompt)
        tokens, logprobs = hf_greedy(reference, ids, len(result.token_ids))
        assert result.token_ids == tokens, prompt
        assert result.sequences[0].token_logprobs == pytest.approx(logprobs, abs=1e-5)
    return results


def test_a_batch_sharing_a_prefix_computes_it_once_and_gives_transformers_results(folder, reference):
    generator = Generator.from_pretrained(folder, prefix_cache="16MB")
    first = check_against(reference, generator, PROMPTS)
    block = generator.runner.prefix.block
    shared_blocks = min(len(generator.tokenizer.encode(p)) - 1 for p in PROMPTS) // block
    # The first batch: the shared prefix computed once, for one prompt (its tokens are not counted
    # as cached there); the others copy it.
    assert sorted(r.cached_tokens >= block for r in first) == [False, True, True]
    assert generator.last_stats.cached_tokens == sum(r.cached_tokens for r in first)
    # A later batch: everything short of each prompt's last token comes from the pool (whole
    # blocks, and the leading part of the block that the first batch's reply filled).
    again = check_against(reference, generator, PROMPTS, new=6)
    for prompt, r in zip(PROMPTS, again):
        assert r.cached_tokens == len(generator.tokenizer.encode(prompt)) - 1
    assert min(r.cached_tokens for r in again) >= shared_blocks * block


def test_partial_block_matches_and_prompts_past_their_last_block(folder, reference):
    generator = Generator.from_pretrained(folder, prefix_cache="16MB")
    block = generator.runner.prefix.block
    base = generator.tokenizer.encode(SHARED)
    check_against(reference, generator, [SHARED])
    # Diverging inside the second block: the first block, and the second as far as it agrees.
    text = generator.tokenizer.decode(base[: block + 5]) + " something else entirely, and more words here"
    ids = generator.tokenizer.encode(text)
    agree = common_length(ids, base)
    assert block < agree < 2 * block
    assert check_against(reference, generator, [text])[0].cached_tokens == agree
    # Exactly a whole number of blocks long: the last token is still computed.
    whole = generator.tokenizer.decode(base[: 2 * block])
    if len(generator.tokenizer.encode(whole)) == 2 * block:
        assert check_against(reference, generator, [whole])[0].cached_tokens == 2 * block - 1


def test_eviction_under_a_tiny_pool_keeps_results_exact(folder, reference):
    generator = Generator.from_pretrained(folder, prefix_cache=0)
    per_block = generator.model.config.n_layer * 2 * generator.model.config.hidden_size * 32 * 4
    from generation.run.prefix_pool import enable_prefix_cache

    pool = enable_prefix_cache(generator, 3 * per_block)  # three blocks
    assert pool.capacity == 3
    others = ["A completely different prompt that shares nothing with the others, long enough for blocks "
              "of its own and then some more words to be sure " * 2]
    for prompts in (PROMPTS, others, PROMPTS, others):
        check_against(reference, generator, prompts, new=4)
    assert pool.stats.evicted_blocks > 0 and pool.used_blocks <= 3


def test_beams_and_seeded_samples_with_the_cache(folder, reference):
    cached = Generator.from_pretrained(folder, prefix_cache="16MB")
    plain = Generator.from_pretrained(folder)
    ids = cached.tokenizer.encode(PROMPTS[0])
    for _ in range(2):  # a miss, then a hit
        ours = cached.generate(PROMPTS[0], max_length=len(ids) + 6, num_beams=3, num_return_sequences=2,
                               ignore_eos=True)
        with torch.no_grad():
            theirs = reference.generate(torch.tensor([ids]), max_new_tokens=6, num_beams=3, num_return_sequences=2,
                                        do_sample=False, pad_token_id=3)
        assert [s.token_ids for s in ours[0].sequences] == [row[len(ids):].tolist() for row in theirs]
    options = dict(max_length=len(ids) + 12, do_sample=True, seed=5, top_k=20, num_return_sequences=2)
    for _ in range(2):
        assert [[s.token_ids for s in r.sequences] for r in cached.generate(PROMPTS, **options)] == \
            [[s.token_ids for s in r.sequences] for r in plain.generate(PROMPTS, **options)]
    assert cached.runner.prefix.stats.hits > 0


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_weights_with_the_cache_are_transformers_on_the_dequantized_weights(folder, tmp_path, mode):
    generator = Generator.from_pretrained(folder, quantize=mode, group_size=32 if mode == "int4" else None,
                                          prefix_cache="16MB")
    reference = transformers.BloomForCausalLM.from_pretrained(
        write_dequantized(folder, generator.model, tmp_path / "dq")).eval()
    for _ in range(2):
        results = generator.generate(PROMPTS, max_length=max(len(generator.tokenizer.encode(p)) for p in PROMPTS) + 8,
                                     ignore_eos=True)
        for prompt, r in zip(PROMPTS, results):
            ids = generator.tokenizer.encode(prompt)
            assert r.token_ids == hf_greedy(reference, ids, len(r.token_ids))[0]
    assert all(r.cached_tokens > 0 for r in results)


def test_a_conversation_turn_finds_the_previous_turns_generated_tokens(tiny_checkpoint):
    # The embedded default writes words, which tokenize back to the ids it generated (random
    # weights write token soup that need not).
    generator = Generator.from_pretrained(tiny_checkpoint, prefix_cache="16MB")
    reference = transformers.BloomForCausalLM.from_pretrained(tiny_checkpoint).eval()
    prompt_ids = generator.tokenizer.encode(SHARED)
    first = generator.generate(SHARED, max_length=len(prompt_ids) + 80, ignore_eos=True)[0]
    turn = prompt_ids + first.token_ids
    follow = generator.tokenizer.decode(turn) + " And then?"
    ids = generator.tokenizer.encode(follow)
    common = common_length(ids, turn)
    result = check_against(reference, generator, [follow])[0]
    # Everything of the first turn that the second repeats came from the pool, its generated
    # tokens too (the reply tokenizes back the same for at least a block here), but the last
    # generated token (never fed back, so never in the cache).
    assert common >= len(prompt_ids) + 32
    assert result.cached_tokens == min(common, len(turn) - 1, len(ids) - 1)


def test_prefix_cache_sizes_are_parsed_and_refused_clearly(folder):
    assert parse_size("512MB") == 512 * 1000**2 and parse_size("1GiB") == 1 << 30 and parse_size("2") == 2 << 20
    assert parse_size(0) == 0 and parse_size(None) == 0
    for bad in ("lots", "-1GB", "5 parsecs", 1.5):
        with pytest.raises(PrefixCacheError):
            parse_size(bad)
    with pytest.raises(PrefixCacheError, match="holds no block"):
        Generator.from_pretrained(folder, prefix_cache="10B")
    assert Generator.from_pretrained(folder, prefix_cache=0).runner.prefix is None


def test_block_digests_name_the_whole_prefix_and_the_namespace():
    pool = PrefixCache(n_layer=1, heads=1, head_dim=2, capacity=2, dtype=torch.float32, device="cpu", block=4)
    a = pool.digests(list(range(12)))
    b = pool.digests([99] + list(range(1, 12)))
    assert len(a) == 3 and all(x != y for x, y in zip(a, b))  # a different first token changes every block
    assert pool.digests(list(range(12)), namespace="adapter-1") != a
    assert pool.digests(list(range(8)) + [0, 0, 0, 0])[:2] == a[:2]


def tiny_pool() -> PrefixCache:
    """Three blocks of four tokens: small enough that every store below evicts."""
    return PrefixCache(n_layer=1, heads=1, head_dim=2, capacity=3, dtype=torch.float32, device="cpu", block=4)


def blocks(*starts: int) -> list[int]:
    """Whole blocks of four tokens, block k counting up from ``starts[k]``: prompts that share
    their first blocks share those starts."""
    return [start + t for start in starts for t in range(4)]


def test_eviction_shortens_a_stored_prefix_from_its_end():
    pool = tiny_pool()
    a = blocks(100, 200, 300)
    pool.plan_store(a, len(a))  # the pool full of A
    pool.plan_store(blocks(400), 4)  # B takes one block: A's deepest, not its trunk (nor B's own)
    assert pool.peek(a) == 8 and pool.peek(blocks(400)) == 4
    assert pool.stats.evicted_blocks == 1 and pool.used_blocks == 3
    pool.plan_store(blocks(500), 4)
    assert pool.peek(a) == 4  # the trunk still matches while A holds a block


def test_a_shared_trunk_outlives_its_leaves_and_a_lookup_renews_a_prefix():
    pool = tiny_pool()
    a, x = blocks(100, 200), blocks(100, 900)  # one trunk, two leaves
    pool.plan_store(a, len(a))
    pool.plan_store(x, len(x))
    pool.plan_store(blocks(400), 4)  # evicts A's leaf, the least recent: X renewed the trunk since
    assert (pool.peek(a), pool.peek(x), pool.peek(blocks(400))) == (4, 8, 4)
    assert len(pool.match(x)) == 2  # X used again: now the most recent
    pool.plan_store(blocks(500), 4)
    assert (pool.peek(x), pool.peek(blocks(400)), pool.peek(blocks(500))) == (8, 0, 4)


def test_a_store_never_evicts_the_prefix_it_extends():
    pool = tiny_pool()
    a = blocks(100, 200, 300)
    pool.plan_store(a, len(a))
    longer = blocks(100, 200, 600, 700)  # A's first two blocks, then two of its own: one fits
    placements = pool.plan_store(longer, len(longer))
    assert [i for i, _ in placements] == [2]
    assert pool.peek(longer) == 12 and pool.peek(a) == 8
    assert len(set(pool.match(longer))) == 3  # three distinct pool blocks
    five = blocks(1, 2, 3, 4, 5)  # larger than the pool: what fits of it, from its start
    pool.plan_store(five, len(five))
    assert pool.peek(five) == 12 and pool.peek(a) == 0


def test_a_block_whose_parent_is_gone_is_evicted_first():
    # The order above never evicts a parent before its children; a block orphaned anyway (here by
    # hand) can never match until its parent is stored again, so it goes before any held prefix.
    pool = tiny_pool()
    b, a = blocks(400), blocks(100, 200)
    pool.plan_store(b, 4)
    pool.plan_store(a, len(a))  # LRU order: B, A's leaf, A's trunk
    trunk = pool.digests(a)[0]
    pool._free.append(pool._evict(trunk))
    assert pool.peek(a) == 0 and pool.used_blocks == 2
    pool.plan_store(blocks(500), 4)  # takes the free block
    pool.plan_store(blocks(600), 4)  # evicts A's orphaned leaf, not B (older by use)
    assert pool.peek(b) == 4 and pool.peek(blocks(500)) == 4 and pool.peek(blocks(600)) == 4
    pool.plan_store(a, len(a))  # A again: the trunk back and, of A's leaf, what the pool keeps
    assert pool.peek(a) == 8


def test_a_partial_lookup_takes_what_agrees_of_the_next_block_and_a_match_never_does():
    pool = tiny_pool()
    pool.plan_store(blocks(100, 200), 8)
    prompt = blocks(100) + [200, 201, 999, 5]  # the second block agrees for two tokens
    assert pool.peek(prompt) == 4 and pool.peek(prompt, partial=True) == 6
    assert pool.peek(prompt, limit=5, partial=True) == 5
    assert pool.peek(prompt, partial=True, span=7) == 4  # the second block would not fit in the row
    assert pool.lookup(prompt, partial=True) == (pool.match(blocks(100, 200)), 6)
    assert len(pool.match(prompt)) == 1  # what the server copies: whole blocks only
    assert pool.peek([100, 101, 5], partial=True) == 2  # a first block too


def test_a_tail_is_kept_and_a_longer_one_replaces_it():
    pool = tiny_pool()
    assert len(pool.plan_store(blocks(100) + [7, 8], 6, tail_span=8)) == 2  # a whole block and a tail
    assert pool.peek(blocks(100) + [7, 8, 9], partial=True) == 6
    assert len(pool.plan_store(blocks(100) + [7, 8, 9], 7, tail_span=8)) == 1  # the longer tail ...
    assert pool.used_blocks == 2  # ... in place of the shorter one
    assert pool.peek(blocks(100) + [7, 8, 9, 10], partial=True) == 7
    assert pool.plan_store(blocks(100) + [7], 5, tail_span=8) == []  # held: the longer tail starts with it
    assert len(pool.plan_store(blocks(300) + [1, 2], 6)) == 1  # no tail unless asked
    pool = tiny_pool()
    assert len(pool.plan_store(blocks(500) + [1], 5, tail_span=6)) == 1  # a tail's block must fit the row


def test_a_tail_goes_before_the_blocks_it_continues():
    pool = tiny_pool()
    turn = blocks(100, 200) + [7]
    pool.plan_store(turn, len(turn), tail_span=12)  # the pool full: two blocks and a tail
    pool.plan_store(blocks(400), 4)
    assert pool.peek(turn + [1], partial=True) == 8 and pool.peek(blocks(400)) == 4


def test_a_request_file_job_with_the_cache_writes_the_records_of_one_without_it(folder, tmp_path):
    """Few-shot lines (one shared block, their own questions), log-probs with alternatives, echo
    and best_of: the same records as without the cache (whose records tests/test_requests.py checks
    against transformers), and usage says what the pool served."""
    import json

    from generation.jobs.runner import run_requests

    lines = [{"prompt": SHARED + f"Question: after {word}?", "max_tokens": 1 + i % 4, "temperature": 0,
              "logprobs": 1 + i % 3} for i, word in enumerate(["one", "two", "three", "four", "five"])]
    lines += [{"prompt": SHARED + "Echo me", "max_tokens": 2, "temperature": 0, "logprobs": 2, "echo": True},
              {"prompt": SHARED + "Best of", "max_tokens": 3, "temperature": 0.8, "seed": 3, "n": 1, "best_of": 2,
               "logprobs": 1}]
    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(json.dumps(line) + "\n" for line in lines))

    def job(generator, name):
        summary = run_requests(generator, requests, tmp_path / name, progress=False)
        assert summary.answered == len(lines) and summary.errors == 0
        return summary, [json.loads(r)["result"] for r in (tmp_path / name).read_text().splitlines()]

    _, plain = job(Generator.from_pretrained(folder), "plain.jsonl")
    cached_generator = Generator.from_pretrained(folder, prefix_cache="16MB")
    for name in ("first.jsonl", "again.jsonl"):
        summary, cached = job(cached_generator, name)
        for a, b in zip(plain, cached):
            for ca, cb in zip(a["choices"], b["choices"]):
                assert ca["text"] == cb["text"] and ca["finish_reason"] == cb["finish_reason"]
                la, lb = ca["logprobs"], cb["logprobs"]
                assert la["tokens"] == lb["tokens"]
                assert [x is None for x in la["token_logprobs"]] == [x is None for x in lb["token_logprobs"]]
                assert [x for x in la["token_logprobs"] if x is not None] == \
                    pytest.approx([x for x in lb["token_logprobs"] if x is not None], abs=1e-5)
                assert [sorted(t) if t else t for t in la["top_logprobs"]] == \
                    [sorted(t) if t else t for t in lb["top_logprobs"]]
            assert {k: v for k, v in b["usage"].items() if k != "prompt_tokens_details"} == a["usage"]
        assert summary.cached_tokens == sum(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in cached)
        assert summary.cached_tokens > 0


@pytest.mark.slow
def test_two_ranks_with_the_cache_give_transformers_tokens(folder, reference, tmp_path):
    """Each rank keeps its shard of the blocks; the ranks look up the same ids in the same order,
    so they agree on every hit without a word (a rank that copied other slots would give other
    logits after the all-reduce). One prompt per batch: the later batches hit the first's blocks."""
    import json
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "two.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)}
    command = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(port),
               str(root / "bloom.py"), "--weights", str(folder), "--max_length", "160", "--prefix_cache", "16MB",
               "--batch_size", "1", "--output_file", str(out), *PROMPTS]
    done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    cached = [int(n) for n in re.findall(r"cached prompt tokens: (\d+)", done.stdout)]
    assert cached[0] == 0 and all(n > 0 for n in cached[1:]) and len(cached) == len(PROMPTS)
    tokenizer = Generator.from_pretrained(folder).tokenizer
    for prompt, record in zip(PROMPTS, json.loads(out.read_text())):
        ids = tokenizer.encode(prompt)
        assert record["token_ids"] == hf_greedy(reference, ids, 160 - len(ids))[0]
