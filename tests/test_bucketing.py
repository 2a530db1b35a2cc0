"""Bucketing (``bucket_width``) and the warm-up: the same tokens as transformers and as unbucketed
static shapes; exactly one step shape per bucket used; a cache sized to what a request can reach,
of exactly layers x 2 x rows x heads x length x head_dim x dtype bytes; and a warm-up that leaves
no shape for requests to meet for the first time."""

from __future__ import annotations

import pytest
import torch
import transformers

import bloom
from generation.generator import Generator
from generation.request.options import build_options
from generation.run.warmup import chunk_sizes, step_shapes, warm_up

PROMPTS = [
    "a",
    "It was the best of times",
    "The quick brown fox jumps over the lazy dog",
    "Numbers 1 2 3 4 5 6 7 8 9 10 11 12",
]
MAX_LENGTH = 32


def ceil_to(value: int, width: int) -> int:
    return (value + width - 1) // width * width


@pytest.fixture(scope="module")
def folder(make_ckpt):
    return make_ckpt(hidden_size=64, n_layer=2, n_head=4, seed=7)


@pytest.fixture(scope="module")
def generator(folder):
    return Generator.from_pretrained(folder)


@pytest.fixture(scope="module")
def hf_tokens(folder, generator):
    """transformers' greedy continuation of each prompt alone, up to MAX_LENGTH tokens in all."""
    model = transformers.BloomForCausalLM.from_pretrained(folder).eval()
    out = {}
    for prompt in PROMPTS:
        ids = generator.tokenizer.encode(prompt)
        with torch.no_grad():
            seq = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_length=MAX_LENGTH, do_sample=False, num_beams=1, eos_token_id=None,
                                 pad_token_id=3)
        out[prompt] = seq[0, len(ids):].tolist()
    return out


def test_prompt_lengths_span_several_buckets(generator):
    # Otherwise the tests below would not exercise more than one bucket.
    lengths = [len(generator.tokenizer.encode(p)) for p in PROMPTS]
    assert len({ceil_to(n, 8) for n in lengths}) >= 2 and max(lengths) > 8


@pytest.mark.parametrize("width", [4, 8, 13, 64])
@pytest.mark.parametrize("max_new_tokens", [None, 5])
def test_bucketed_tokens_equal_transformers_and_unbucketed(generator, hf_tokens, width, max_new_tokens):
    bucketed = generator.generate(PROMPTS, max_length=MAX_LENGTH, max_new_tokens=max_new_tokens, bucket_width=width)
    plain = generator.generate(PROMPTS, max_length=MAX_LENGTH, max_new_tokens=max_new_tokens)
    for prompt, ours, reference in zip(PROMPTS, bucketed, plain):
        expected = hf_tokens[prompt][:max_new_tokens]
        assert ours.token_ids == expected, (prompt, width)
        assert reference.token_ids == expected
    # A row alone gets the same tokens as inside the batch (its buckets differ).
    alone = generator.generate(PROMPTS[1], max_length=MAX_LENGTH, max_new_tokens=max_new_tokens, bucket_width=width)
    assert alone[0].token_ids == bucketed[1].token_ids


def expected_signatures(lengths: list[int], width: int, max_length: int, max_new: int | None) -> set[tuple]:
    """The step shapes the issue asks for, worked out from its definition of buckets:
    prompts padded to the next multiple of the bucket, the cache to the next multiple above the
    furthest slot a row can reach, and the decode window to the bucket holding the newest token."""
    budgets = [max_length - n if max_new is None else min(max_length - n, max_new) for n in lengths]
    rows, longest = len(lengths), max(lengths)
    prompt_len = ceil_to(longest, width)
    cache_len = max(prompt_len, ceil_to(max(n + k for n, k in zip(lengths, budgets)), width))
    shapes = {("prefill", rows, prompt_len, cache_len)}
    for step in range(max(budgets) - 1):  # the token of step s sits at slot <= longest - 1 + s + 1
        shapes.add(("decode", rows, cache_len, min(cache_len, ceil_to(longest + step + 1, width))))
    return shapes


def seen_signatures(backend) -> set[tuple]:
    """(kind, rows, P, K) for prefills and (kind, rows, K, window) for decodes, from the backend."""
    out = set()
    for name, inputs, static in backend.signatures:
        rows = inputs[0][0][0]
        if name == "prefill":
            out.add((name, rows, inputs[0][0][1], static[-1]))
        else:
            out.add((name, rows, static[-2], static[-1]))
    return out


@pytest.mark.parametrize("width,max_new", [(8, None), (8, 6), (5, 3), (64, None)])
def test_signatures_are_exactly_the_buckets_used(folder, width, max_new):
    generator = Generator.from_pretrained(folder)
    expected = set()
    for prompts in ([PROMPTS[0]], [PROMPTS[2]], PROMPTS[:2], PROMPTS):
        lengths = [len(generator.tokenizer.encode(p)) for p in prompts]
        expected |= expected_signatures(lengths, width, MAX_LENGTH, max_new)
        generator.generate(prompts, max_length=MAX_LENGTH, max_new_tokens=max_new, bucket_width=width)
    assert seen_signatures(generator.backend) == expected
    # Buckets, not one shape per step: far fewer decode shapes than steps run.
    decodes = {s for s in expected if s[0] == "decode"}
    assert len(decodes) <= -(-MAX_LENGTH // width) * 4


@pytest.mark.parametrize("width", [4, 8])
def test_each_decode_window_is_the_bucket_of_its_newest_token(folder, width):
    """Per step, not only as a set: the window holds the newest slot and ends at its bucket's end."""
    generator = Generator.from_pretrained(folder)
    seen = []
    decode = generator.runner.decode

    def spy(tokens, positions, cache, window):
        seen.append((int(positions.max()), cache.length, window))
        return decode(tokens, positions, cache, window)

    generator.runner.decode = spy
    generator.generate(PROMPTS, max_length=MAX_LENGTH, bucket_width=width)
    assert len(seen) > width
    for newest, cache_len, window in seen:
        assert window == min(cache_len, ceil_to(newest + 1, width)), (newest, window)


def test_cache_follows_the_request_not_max_length(folder):
    """With max_length 1024 and 4 new tokens, the cache and every window stay in the first buckets."""
    generator = Generator.from_pretrained(folder)
    prompt = PROMPTS[1]
    n = len(generator.tokenizer.encode(prompt))
    out = generator.generate(prompt, max_length=1024, max_new_tokens=4, bucket_width=8)
    assert len(out[0].token_ids) == 4
    (rows, length), = generator.runner._caches
    assert (rows, length) == (1, ceil_to(n + 4, 8))
    cfg = generator.model.config
    cache = generator.runner._caches[(rows, length)]
    itemsize = torch.empty((), dtype=next(generator.model.parameters()).dtype).element_size()
    assert cache.nbytes == cfg.n_layer * 2 * rows * cfg.n_head * length * cfg.head_dim * itemsize
    windows = {static[-1] for name, _, static in generator.backend.signatures if name == "decode"}
    assert max(windows) <= ceil_to(n + 4, 8)
    assert out[0].token_ids == generator.generate(prompt, max_length=MAX_LENGTH, max_new_tokens=4)[0].token_ids


@pytest.mark.parametrize("options", [
    {"bucket_width": 8},
    {"bucket_width": 8, "max_new_tokens": 5},
    {},  # static shapes: one prefill and one decode shape for every length
])
def test_warmup_leaves_no_new_shape_for_requests(folder, options):
    generator = Generator.from_pretrained(folder)
    opts = build_options(max_length=MAX_LENGTH, **options)
    report = warm_up(generator, opts, [1, 2])
    warmed = set(generator.backend.signatures)
    assert len(warmed) == len(report.shapes) == len(set(report.shapes))
    if not options:
        assert (report.count("prefill"), report.count("decode")) == (2, 2)  # batch sizes 1 and 2
    # Requests of every prompt length (one and two rows) meet only warmed-up shapes.
    ids = generator.tokenizer.encode(" ".join(["word"] * MAX_LENGTH))
    for n in range(1, MAX_LENGTH, 3):
        text = generator.tokenizer.decode(ids[:n])
        generator.generate([text], opts)
        generator.generate([text, "a"], opts)
    assert set(generator.backend.signatures) == warmed
    assert "shapes in" in report.describe()


@pytest.mark.parametrize("copies", [{"num_beams": 3}, {"do_sample": True, "num_return_sequences": 3}])
def test_warmup_shapes_cover_beams_and_sampled_copies(folder, copies):
    opts = build_options(max_length=16, bucket_width=8, **copies)
    shapes = step_shapes(opts, 2)
    # Each prompt is prefilled once, in a cache as long as the prompt; decode runs 2 x 3 rows.
    assert {(s.rows, s.cache_len == s.prompt_len) for s in shapes if s.kind == "prefill"} == {(2, True)}
    assert {s.rows for s in shapes if s.kind == "decode"} == {6}
    generator = Generator.from_pretrained(folder)
    report = warm_up(generator, opts, 2)
    assert report.shapes == shapes
    warmed = set(generator.backend.signatures)
    generator.generate(PROMPTS[:2], opts)
    assert set(generator.backend.signatures) == warmed


def test_chunk_sizes():
    assert chunk_sizes(5, 2) == [1, 2]
    assert chunk_sizes(4, 2) == [2]
    assert chunk_sizes(1, 8) == [1]


def test_cli_warmup_prints_its_time(capsys, folder):
    code = bloom.main(["--weights", str(folder), "--max_length", "24", "--options", "bucket_width=8", "--warmup",
                       "--quiet", "Hello there"])
    captured = capsys.readouterr()
    assert code == 0
    # Prompts padded to 8, 16 or 24; with the CLI's prefix cache, the rest of a 24-slot prompt after a
    # hit runs in one more shape (a rest of 16).
    assert "warm-up: 3 prefill, 1 extend and 3 decode shapes in" in captured.err
    assert captured.out.strip()
    code = bloom.main(["--weights", str(folder), "--max_length", "24", "--options", "bucket_width=8", "--warmup",
                       "--quiet", "--prefix_cache", "0", "Hello there"])
    assert code == 0 and "warm-up: 3 prefill and 3 decode shapes in" in capsys.readouterr().err
