"""``StaticBloom.mixed``: a decode step carrying a chunk of one row's prompt gives the logits and
cache slots that a separate decode and a separate prefill of the whole prompt give (fp32), in both
cache layouts, with a padded chunk; so does one carrying several prompts' segments (one prompt over
two segments of the step, an unused segment repeating a used one); through the runner its
signature is recorded."""

import pytest
import torch

from bloom_hpu.config import BloomConfig
from bloom_hpu.model import StaticBloom
from bloom_hpu.runtime.backends import Backend
from bloom_hpu.runtime.steps import StepRunner

K, ROWS, JOINING = 32, 4, 2  # cache length, rows, the row whose prompt arrives in chunks


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    model = StaticBloom(BloomConfig(vocab_size=256, hidden_size=64, n_layer=2, n_head=4)).eval()
    for p in model.parameters():  # LayerNorms away from 1/0, so every weight matters
        torch.nn.init.normal_(p, std=0.3)
    return model


def clone(cache):
    keys = [k.clone() for k in cache.keys]
    values = [v.clone() for v in cache.values]
    return keys, values


@pytest.mark.parametrize("per_layer", [False, True])
@pytest.mark.parametrize("done,real", [(0, 9), (5, 7), (20, 11)])  # prompt tokens in the cache, real chunk tokens
@torch.no_grad()
def test_mixed_equals_decode_and_prefill(model, per_layer, done, real):
    g = torch.Generator().manual_seed(done)
    chunk_size = 16
    prompt = torch.randint(0, 256, (done + real,), generator=g)
    lengths = torch.tensor([6, 11, done, 3])
    lengths[JOINING] = max(done, 1)  # a prefill needs one token; slot 0 is then rewritten by the chunk when done = 0
    ids = torch.randint(0, 256, (ROWS, 12), generator=g)
    ids = torch.nn.functional.pad(ids, (0, K - 12))
    ids[JOINING, : done] = prompt[:done]
    cache = model.allocate_cache(ROWS, K, per_layer)
    model.prefill(ids[:, : max(12, done)], lengths, cache)
    before = clone(cache)

    tokens = torch.randint(0, 256, (ROWS, 1), generator=g)
    positions = lengths.clone()
    positions[JOINING] = done  # the joining row's filler goes where its chunk starts
    chunk = torch.zeros(1, chunk_size, dtype=torch.long)
    chunk[0, :real] = prompt[done:]
    window = K
    mixed = model.mixed(tokens, positions, chunk, torch.tensor([JOINING]), torch.tensor([done]),
                        torch.tensor([real]), cache, window)

    # Reference 1: a plain decode of the same rows on the cache as it was.
    reference = model.allocate_cache(ROWS, K, per_layer)
    for mine, saved in zip(list(reference.keys) + list(reference.values), before[0] + before[1]):
        mine.copy_(saved)
    decoded = model.decode(tokens, positions, reference, window)
    running = [r for r in range(ROWS) if r != JOINING]
    torch.testing.assert_close(mixed[running], decoded[running], rtol=1e-5, atol=1e-5)
    # Reference 2: the whole prompt prefilled at once.
    alone = model.allocate_cache(1, K, per_layer)
    first = model.prefill(prompt[None], torch.tensor([done + real]), alone)
    torch.testing.assert_close(mixed[ROWS], first[0], rtol=1e-5, atol=1e-5)
    # The slots: running rows as after the decode, the joining row's prompt as after its prefill.
    for layer in range(model.config.n_layer):
        for mine, theirs, whole in ((cache.keys, reference.keys, alone.keys), (cache.values, reference.values, alone.values)):
            for r in running:
                torch.testing.assert_close(mine[layer][r, :, :16], theirs[layer][r, :, :16], rtol=1e-5, atol=1e-5)
            n = done + real
            torch.testing.assert_close(mine[layer][JOINING, :, :n], whole[layer][0, :, :n], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("per_layer", [False, True])
@torch.no_grad()
def test_segments_of_several_prompts_in_one_step(model, per_layer):
    """Rows 1 and 3 join together: row 1's prompt (5 done, 11 to go) over two segments of 8, row
    3's (3 tokens) in a third, the fourth segment a repeat of the third. Each prompt's first-token
    logits and slots are its whole prefill's; rows 0 and 2 decode as in a plain decode."""
    g = torch.Generator().manual_seed(7)
    c = 8
    long_prompt = torch.randint(0, 256, (16,), generator=g)
    short_prompt = torch.randint(0, 256, (3,), generator=g)
    ids = torch.nn.functional.pad(torch.randint(0, 256, (ROWS, 12), generator=g), (0, K - 12))
    ids[1, :5] = long_prompt[:5]
    lengths = torch.tensor([6, 5, 9, 1])
    cache = model.allocate_cache(ROWS, K, per_layer)
    model.prefill(ids[:, :12], lengths, cache)
    before = clone(cache)

    tokens = torch.randint(0, 256, (ROWS, 1), generator=g)
    positions = torch.tensor([6, 5, 9, 0])  # the joining rows' fillers where their prompts continue
    chunk = torch.zeros(4, c, dtype=torch.long)
    chunk[0] = long_prompt[5:13]
    chunk[1, :3] = long_prompt[13:]
    chunk[2, :3] = short_prompt
    chunk[3] = chunk[2]
    rows, starts, reals = torch.tensor([1, 1, 3, 3]), torch.tensor([5, 13, 0, 0]), torch.tensor([8, 3, 3, 3])
    mixed = model.mixed(tokens, positions, chunk, rows, starts, reals, cache, K)
    assert mixed.shape == (ROWS + 4, 256)

    reference = model.allocate_cache(ROWS, K, per_layer)
    for mine, saved in zip(list(reference.keys) + list(reference.values), before[0] + before[1]):
        mine.copy_(saved)
    decoded = model.decode(tokens, positions, reference, K)
    torch.testing.assert_close(mixed[[0, 2]], decoded[[0, 2]], rtol=1e-5, atol=1e-5)
    for prompt, row, logits in ((long_prompt, 1, mixed[ROWS + 1]), (short_prompt, 3, mixed[ROWS + 2])):
        alone = model.allocate_cache(1, K, per_layer)
        first = model.prefill(prompt[None], torch.tensor([len(prompt)]), alone)
        torch.testing.assert_close(logits, first[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(mixed[ROWS + 3], mixed[ROWS + 2])
        for layer in range(model.config.n_layer):
            n = len(prompt)
            torch.testing.assert_close(cache.keys[layer][row, :, :n], alone.keys[layer][0, :, :n], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(cache.values[layer][row, :, :n], alone.values[layer][0, :, :n], rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_the_runner_records_a_mixed_signature(model):
    backend = Backend("cpu")
    runner = StepRunner(model, backend)
    cache = runner.cache(2, K)
    logits = runner.mixed(torch.zeros(2, 1, dtype=torch.long), torch.zeros(2, dtype=torch.long),
                          torch.zeros(1, 8, dtype=torch.long), torch.tensor([1]), torch.tensor([28]),
                          torch.tensor([3]), cache, 16)
    assert logits.shape == (3, 256)
    assert backend.signatures_of("mixed") == {("mixed", (((2, 1), "torch.int64"), ((2,), "torch.int64"),
                                                         ((1, 8), "torch.int64"), ((1,), "torch.int64"),
                                                         ((1,), "torch.int64"), ((1,), "torch.int64")), (2, K, 16))}


def test_the_server_joins_prompts_in_chunks_on_the_hpu_layout(hpu_stand_in, tiny_checkpoint):
    """On the HPU stand-in (per-layer cache written whole; in-place writes into views refused while
    capturing): a prompt joining a running row in chunks gives what the generator gives alone, and
    after warm-up no step captures a new graph."""
    from test_hpu import hpu_generator

    from generation.serving.engine import Engine, EngineConfig
    from generation.serving.params import SamplingParams

    generator = hpu_generator(tiny_checkpoint)
    engine = Engine(generator, EngineConfig(max_batch=2, max_length=32, bucket_width=16, prefill_chunk=8))
    assert all(c.per_layer for c in engine.device_rows.caches.values())
    engine.warm_up()
    warm, captured = set(generator.backend.signatures), generator.backend.captured
    encode = generator.tokenizer.encode
    prompts = ["It was the best of times", "a b c d e f g h i j k l m n o p"]  # the second over 2 chunks
    params = SamplingParams(max_tokens=6)
    first = engine.submit(encode(prompts[0]), params)
    engine.step()
    second = engine.submit(encode(prompts[1]), params)
    while engine.step():
        pass
    assert engine.stats["prompts_chunked"] == 1 and engine.stats["mixed_steps"] >= 2
    assert generator.backend.signatures == warm and generator.backend.captured == captured
    for prompt, handle in zip(prompts, (first, second)):
        ref = generator.generate([prompt], max_length=32, max_new_tokens=6, ignore_eos=False, bucket_width=16)[0]
        assert [s.token_ids for s in handle.result(1)] == [ref.sequences[0].token_ids], prompt
