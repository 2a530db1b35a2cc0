"""The prefix cache under the graph stand-in (tests/graph_stand_in), HPU and CUDA personalities:
hits and misses replay captured graphs and give the eager CPU's tokens, and a second identical load
captures and compiles nothing (the pool's copies keep a few shapes, the extends one per rest bucket)."""

from __future__ import annotations

import pytest

from generation.generator import Generator
from generation.run.warmup import warm_up

SHARED = "Question: what comes after one? Answer: two. Question: and after two? Answer: three. " * 2
LOADS = [[SHARED + "Question: after three?", SHARED + "Q"], [SHARED + "And before one?"],
         ["Nothing shared here at all", SHARED + "Question: after three? Answer:"]]
# Beams take the same prefill (tests/test_prefix_cache.py checks them against transformers).
SEARCHES = {"greedy": {}, "sampling": {"do_sample": True, "seed": 5, "top_k": 20, "num_return_sequences": 2}}


@pytest.fixture(scope="module")
def checkpoint(make_ckpt):
    return make_ckpt(hidden_size=64, n_layer=2, n_head=4, seed=7)


@pytest.fixture(scope="module")
def eager(checkpoint):
    return Generator.from_pretrained(checkpoint, device="cpu")


def sequences(results):
    return [[s.token_ids for s in r.sequences] for r in results]


@pytest.mark.parametrize("search", list(SEARCHES))
def test_prefix_hits_replay_graphs_with_the_eager_tokens(graph_stand_in, checkpoint, eager, search):
    generator = Generator.from_pretrained(checkpoint, device=graph_stand_in.device, prefix_cache="8MB")
    options = dict(max_length=96, bucket_width=32, ignore_eos=True, **SEARCHES[search])
    with graph_stand_in.off_card():
        expected = [sequences(eager.generate(prompts, **options)) for prompts in LOADS]
    # Warm-up runs every shape a load can take, the extends of every rest bucket included: then
    # the first load (misses, shared prefixes computed once) captures nothing, and the second
    # (hits, shorter rests) neither captures nor compiles anything.
    warm_up(generator, generator.options(**options), sorted({len(p) for p in LOADS}))
    captures = graph_stand_in.captures
    assert [sequences(generator.generate(p, **options)) for p in LOADS] == expected
    assert graph_stand_in.captures == captures
    lazy = graph_stand_in.lazy.compiles if graph_stand_in.lazy else 0
    hits = generator.runner.prefix.stats.hits
    assert [sequences(generator.generate(p, **options)) for p in LOADS] == expected
    assert generator.runner.prefix.stats.hits > hits
    assert graph_stand_in.captures == captures
    assert (graph_stand_in.lazy.compiles if graph_stand_in.lazy else 0) == lazy
