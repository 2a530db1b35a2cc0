"""Speculative decoding (generation/search/speculation.py): greedy output token for token the
output without it (and transformers'), across batch sizes, k, EOS, stop strings, budgets,
processors, dtypes and int8 weights; sampling keeps the target's distribution (chi-square) and is
reproducible; bad values are refused; on the graph stand-in nothing is captured after warm-up.

Random weights rarely repeat themselves, so besides prompt lookup the tests plant an *oracle*
guesser: it proposes the plain run's own continuation with every third guess made wrong, so
verify passes accept several guesses, reject others, and must still give the plain tokens.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from generation.generator import Generator
from generation.search import speculation
from generation.search.guesses import SpeculationError, ngram_guesses, parse_speculation
from sampling_reference import SAMPLING, assert_pairs_follow, hf_next, second_and_third

pytestmark = pytest.mark.usefixtures("verify_any_batch")  # batches past the CPU's step-aside

PROMPTS = [
    "It was the best of times",
    "a b c a b c a b c a b",
    "The quick brown fox jumps over the lazy dog and keeps running",
    "Hello, world",
    "Numbers 1 2 3",
]
REPEATING = ["And God said unto Moses", "In the beginning God created the heaven and the earth. And the earth"]


@pytest.fixture(scope="module")
def folder(make_ckpt):
    return make_ckpt(hidden_size=64, n_layer=3, n_head=4, seed=7)


@pytest.fixture(scope="module")
def generator(folder):
    return Generator.from_pretrained(folder)


@pytest.fixture(scope="module")
def reference(folder):
    transformers.logging.set_verbosity_error()
    return transformers.BloomForCausalLM.from_pretrained(folder).eval()


def hf_greedy(model, ids, max_length, eos_token_id=None, **options):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_length=max_length, do_sample=False, num_beams=1, eos_token_id=eos_token_id,
                             pad_token_id=3, **options)
    return out[0, len(ids):].tolist()


def ids_of(results):
    return [[s.token_ids for s in r.sequences] for r in results]


def oracle(generator, prompts, continuations, wrong_every=3):
    """A guesser that proposes each row's true continuation (prompt + ``continuations[b]``), the
    guess of every slot s with s % wrong_every == 1 replaced by another token (1: every guess)."""
    rows = [generator.tokenizer.encode(p) + list(c) for p, c in zip(prompts, continuations)]
    width = max(len(r) for r in rows) + 16
    truth = torch.tensor([r + [3] * (width - len(r)) for r in rows])

    def guess(sequence, used, k):
        slots = used[:, None] + torch.arange(k)
        guesses = truth.gather(1, slots.clamp(max=width - 1))
        if wrong_every:
            guesses = torch.where(slots % wrong_every == 1 % wrong_every, (guesses + 1) % 1000, guesses)
        return guesses, torch.full_like(used, k)

    return guess


def spec_run(monkeypatch, generator, prompts, guesser, k=4, **options):
    if guesser is not None:
        monkeypatch.setitem(speculation.GUESSERS, "ngram", guesser)
    results = generator.generate(prompts, speculate=f"ngram:{k}", **options)
    return ids_of(results), generator.last_stats.speculation


# --- greedy: the same tokens ------------------------------------------------------------------------


@pytest.mark.parametrize("batch,k", [(1, 1), (5, 2), (1, 4), (5, 8)])
def test_greedy_with_guesses_equals_plain_and_transformers(monkeypatch, generator, reference, k, batch):
    prompts = PROMPTS[:batch]
    options = dict(max_length=40)
    plain = ids_of(generator.generate(prompts, **options))
    for ids, prompt in zip(plain, prompts):
        assert ids[0] == hf_greedy(reference, generator.tokenizer.encode(prompt), 40)
    ours, stats = spec_run(monkeypatch, generator, prompts, oracle(generator, prompts, [p[0] for p in plain]), k,
                           **options)
    assert ours == plain
    # Guesses were accepted (several a pass) and rejected: both paths ran.
    assert 0 < stats.accepted < stats.offered and stats.verifies > 0
    if k >= 2:
        assert stats.tokens_per_verify > 1.5
    monkeypatch.undo()
    lookup, _ = spec_run(monkeypatch, generator, prompts, None, k, **options)  # prompt lookup itself
    assert lookup == plain


def test_a_greedy_batch_too_large_to_verify_steps_aside(monkeypatch, generator):
    """On the CPU a greedy batch of more than ``CPU_VERIFY_ROWS`` rows x positions decodes without
    guesses (the same tokens), said in the stats; a smaller one speculates; a sampled one speculates
    whatever its size (its rows' text must not depend on the batch)."""
    from generation.search import guesses

    monkeypatch.setattr(guesses, "CPU_VERIFY_ROWS", 16)  # the default, past the module's fixture
    prompts = REPEATING * 2  # 4 rows x (4 guesses + 1) = 20 positions
    plain = ids_of(generator.generate(prompts, max_length=48))
    assert ids_of(generator.generate(prompts, max_length=48, speculate="ngram:4")) == plain
    stats = generator.last_stats.speculation
    assert stats.stepped_aside == 1 and stats.verifies == 0
    assert "1 batch(es) too large, decoded without guesses" in stats.describe()
    generator.generate(prompts[:3], max_length=48, speculate="ngram:4")  # 3 x 5 = 15 positions
    stats = generator.last_stats.speculation
    assert stats.stepped_aside == 0 and stats.verifies > 0
    generator.generate(prompts, max_length=48, speculate="ngram:4", do_sample=True, seed=3)
    stats = generator.last_stats.speculation
    assert stats.stepped_aside == 0 and stats.verifies > 0


@pytest.mark.parametrize("options", [
    dict(ignore_eos=False),
    dict(ignore_eos=True),
    dict(ignore_eos=False, repetition_penalty=1.3, min_new_tokens=6),
    dict(ignore_eos=False, no_repeat_ngram_size=2),
    dict(ignore_eos=False, max_new_tokens=7),
    dict(ignore_eos=False, static_shapes=False),
    dict(ignore_eos=False, bucket_width=8),
], ids=["eos", "ignore_eos", "penalty+min_tokens", "no_repeat", "max_new_tokens", "dynamic", "buckets"])
def test_eos_budgets_and_processors_at_every_verified_position(monkeypatch, eos_generator, eos_reference, options):
    """On the checkpoint whose EOS wins now and then: rows end at their own EOS inside a verify
    pass, budgets cut accepted guesses, and the processors see each position's own history."""
    prompts = PROMPTS
    options = dict(max_length=36, **options)
    plain = ids_of(eos_generator.generate(prompts, **options))
    if not options["ignore_eos"] and len(options) == 2:
        assert any(ids[0][-1] == 2 for ids in plain)  # EOS really ended some rows
        assert any(ids[0][-1] != 2 for ids in plain)
    hf = {k: v for k, v in options.items() if k in ("repetition_penalty", "no_repeat_ngram_size", "max_new_tokens")}
    if "min_new_tokens" in options:
        hf["min_new_tokens"] = options["min_new_tokens"]
    for ids, prompt in zip(plain, prompts):
        if options["ignore_eos"]:
            break  # (transformers' generate always stops at its config's EOS)
        assert ids[0] == hf_greedy(eos_reference, eos_generator.tokenizer.encode(prompt), 36, eos_token_id=2, **hf)
    ours, stats = spec_run(monkeypatch, eos_generator, prompts, oracle(eos_generator, prompts, [p[0] for p in plain]),
                           **options)
    assert ours == plain
    assert stats.accepted > 0


def test_stop_strings_and_budgets_per_row(monkeypatch, eos_generator):
    prompts = PROMPTS[:4]
    plain = eos_generator.generate(prompts, max_length=40, ignore_eos=True, max_new_tokens_each=[20, 3, 11, 25])
    # A stop string taken from the middle of row 0's text, so it stops there.
    stop = plain[0].text[len(plain[0].text) // 2:][:4]
    assert stop.strip()
    options = dict(max_length=40, ignore_eos=True, max_new_tokens_each=[20, 3, 11, 25], stop=stop)
    want = eos_generator.generate(prompts, **options)
    assert want[0].finish_reason == "stop"
    guess = oracle(eos_generator, prompts, [r.token_ids for r in plain])
    monkeypatch.setitem(speculation.GUESSERS, "ngram", guess)
    got = eos_generator.generate(prompts, speculate="ngram:4", **options)
    assert [(r.token_ids, r.text, r.finish_reason) for r in got] == [(r.token_ids, r.text, r.finish_reason) for r in want]
    assert [len(r.token_ids) for r in got][1:3] == [3, 11]


def test_prompt_lookup_on_text_that_repeats(tiny_checkpoint):
    """The embedded default model's greedy text repeats itself: prompt lookup's guesses are
    accepted there, and the tokens are the plain loop's and transformers'."""
    generator = Generator.from_pretrained(tiny_checkpoint)
    reference = transformers.BloomForCausalLM.from_pretrained(tiny_checkpoint).eval()
    options = dict(max_length=64)
    plain = ids_of(generator.generate(REPEATING, **options))
    for ids, prompt in zip(plain, REPEATING):
        assert ids[0] == hf_greedy(reference, generator.tokenizer.encode(prompt), 64)
    assert ids_of(generator.generate(REPEATING, speculate="ngram:4", **options)) == plain
    stats = generator.last_stats.speculation
    assert stats.acceptance > 0.3 and stats.tokens_per_verify > 1.5
    # Alone, this prompt's text repeats only after a while: its first guesses fail (k falls to 0,
    # decodes), and a probe notices the repetition later.
    generator.generate(REPEATING[0], max_length=96, speculate="ngram:4")
    stats = generator.last_stats.speculation
    assert stats.decodes > 0 and stats.tokens_per_verify > 2.5 and stats.verifies > 10


@pytest.mark.parametrize("kwargs", [dict(dtype="bf16"), dict(quantize="int8")], ids=["bf16", "int8"])
def test_bf16_and_int8_weights(tiny_checkpoint, kwargs):
    generator = Generator.from_pretrained(tiny_checkpoint, **kwargs)
    plain = ids_of(generator.generate(REPEATING, max_length=64))
    assert ids_of(generator.generate(REPEATING, max_length=64, speculate="ngram:4")) == plain
    assert generator.last_stats.speculation.accepted > 0


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_verify_takes_the_decode_rows_route(monkeypatch, tiny_checkpoint, mode):
    """Where the CPU's measured choice gives prompts integer products and decode rows weight-only
    ones, a verify pass (a few tokens a row, standing for decode steps) takes the decode route: the
    tokens are the plain loop's."""
    from bloom_hpu.runtime.cpu import CpuOptions

    import bloom_hpu.quantize as quantize
    from bloom_hpu.runtime.steps import VerifyStep

    route = CpuOptions(choice="prompts=integer,decode=weight-only")
    generator = Generator.from_pretrained(tiny_checkpoint, quantize=mode, int8_activations="auto", cpu=route)
    plain = ids_of(generator.generate(REPEATING, max_length=64))
    routes, inside = {"prefill": set(), "verify": set()}, [False]
    takes_integer, forward = quantize.takes_integer, VerifyStep.forward

    def spied_takes_integer(module, x):
        chosen = takes_integer(module, x)
        routes["verify" if inside[0] else "prefill"].add((x.shape[-2] > 1, chosen))
        return chosen

    def spied_forward(self, *args):
        inside[0] = True
        try:
            return forward(self, *args)
        finally:
            inside[0] = False

    # The one-call verify (this CPU's kernels) is the decode step's own op: the same tokens.
    assert ids_of(generator.generate(REPEATING, max_length=64, speculate="ngram:4")) == plain
    monkeypatch.setattr(quantize, "takes_integer", spied_takes_integer)
    monkeypatch.setattr(VerifyStep, "forward", spied_forward)
    plan = generator.backend.cpu_plan
    with plan.op_by_op():  # op by op, each product picks its route
        assert ids_of(generator.generate(REPEATING, max_length=64, speculate="ngram:4")) == plain
    assert generator.last_stats.speculation.accepted > 0
    assert (True, True) in routes["prefill"]  # the prompts did take integer products
    assert routes["verify"] == {(True, False)}  # every verify product: several tokens a row, weight-only


def test_from_pretrained_speculates_every_call(tiny_checkpoint):
    generator = Generator.from_pretrained(tiny_checkpoint, speculate="ngram:2")
    assert str(generator.speculation) == "ngram:2"
    generator.generate(REPEATING[0], max_length=40)
    assert generator.last_stats.speculation.verifies > 0
    generator.generate(REPEATING[0], max_length=40, speculate="off")
    assert generator.last_stats.speculation is None


def test_failing_guesses_cost_no_verify(monkeypatch, generator):
    """Adaptive k: a row whose every guess fails drops to 0 guesses within a few passes and then
    decodes plainly, with a probe every PROBE_EVERY passes."""
    prompts = PROMPTS[:2]
    plain = ids_of(generator.generate(prompts, max_length=80, ignore_eos=True))
    ours, stats = spec_run(monkeypatch, generator, prompts,
                           oracle(generator, prompts, [p[0] for p in plain], wrong_every=1), max_length=80,
                           ignore_eos=True)
    assert ours == plain
    assert stats.accepted == 0
    passes = stats.verifies + stats.decodes
    assert stats.verifies <= 3 + passes // speculation.PROBE_EVERY + 1  # k 4 -> 2 -> 1 -> 0, then probes
    assert stats.decodes > passes * 0.8


# --- the n-gram lookup -------------------------------------------------------------------------------


def test_ngram_lookup_takes_the_longest_latest_match():
    seq = torch.tensor([
        [1, 2, 3, 4, 5, 9, 2, 3, 7, 1, 2, 3, 0, 0],  # "2 3" occurs twice; "1 2 3" once, at 0: 4 5 9 2
        [7, 7, 7, 7, 7, 7, 0, 0, 0, 0, 0, 0, 0, 0],  # period 1: one real token after the latest "7 7 7"
        [1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 0, 0, 0, 0],  # no earlier occurrence of anything
        [5, 6, 5, 6, 5, 6, 5, 6, 5, 0, 0, 0, 0, 0],  # "5 6 5" at 4 has 2 real tokens after it, at 2: 4
    ])
    guesses, counts = ngram_guesses(seq, torch.tensor([12, 6, 8, 9]), 4)
    assert counts.tolist() == [4, 1, 0, 4]
    assert guesses[0].tolist() == [4, 5, 9, 2]
    assert guesses[1, 0].item() == 7
    assert guesses[3].tolist() == [6, 5, 6, 5]


def lookup_one_row(tokens: list[int], k: int, longest: int = 3) -> list[int]:
    """Prompt lookup as its docstring states it, one row, in plain Python: for n = longest .. 1
    (n < len(tokens)), the occurrences of the last n tokens that end before the last token; the
    latest followed by k tokens, else the latest; the up to k tokens after it."""
    used = len(tokens)
    for n in range(min(longest, used - 1), 0, -1):
        ends = [p for p in range(n - 1, used - 1) if tokens[p - n + 1: p + 1] == tokens[used - n:]]
        if ends:
            end = max(ends, key=lambda p: (p + 1 + k <= used, p))
            return tokens[end + 1: end + 1 + k]
    return []


@pytest.mark.parametrize("vocab", [2, 3, 5])
def test_ngram_lookup_equals_the_per_row_reference(vocab):
    gen = torch.Generator().manual_seed(vocab)
    for k in (1, 2, 4, 8):
        seq = torch.randint(0, vocab, (16, 24), generator=gen)
        used = torch.randint(1, 25, (16,), generator=gen)
        guesses, counts = ngram_guesses(seq, used, k)
        for b in range(16):
            expected = lookup_one_row(seq[b, : used[b]].tolist(), k)
            assert counts[b].item() == len(expected), (b, k)
            assert guesses[b, : len(expected)].tolist() == expected, (b, k)


# --- sampling ---------------------------------------------------------------------------------------


def test_sampling_is_seeded_and_without_guesses_is_the_plain_sampler(monkeypatch, eos_generator):
    options = dict(max_length=30, seed=11, **SAMPLING)
    plain = ids_of(eos_generator.generate(PROMPTS, **options))
    none = lambda sequence, used, k: (torch.zeros(len(used), k, dtype=torch.long), torch.zeros_like(used))  # noqa: E731
    ours, _ = spec_run(monkeypatch, eos_generator, PROMPTS, none, **options)
    assert ours == plain  # no guess: each token drawn with the plain sampler's very noise
    monkeypatch.undo()
    guess = oracle(eos_generator, PROMPTS, [p[0] for p in plain])
    first, stats = spec_run(monkeypatch, eos_generator, PROMPTS, guess, **options)
    again, _ = spec_run(monkeypatch, eos_generator, PROMPTS, guess, **options)
    assert first == again and stats.accepted > 0


@pytest.mark.slow
def test_rejection_sampling_keeps_the_targets_distribution(monkeypatch, eos_generator, eos_reference):
    """Chi-square: the second and third tokens (t1, t2) of many seeded rows, after the most common
    first token t0, against transformers' exact joint p(t1 | t0) p(t2 | t0, t1). The guesses are
    the likeliest t1 and its likeliest t2, so both acceptance and the residual draw decide them."""
    prompt = PROMPTS[0]
    ids = eos_generator.tokenizer.encode(prompt)
    t0, p1, joint = second_and_third(eos_reference, ids)
    g1 = int(p1.argmax())
    g2 = int(hf_next(eos_reference, ids + [t0, g1]).argmax())
    assert 0.2 < p1[g1] < 0.9  # a guess that is neither always nor never accepted

    def guess(sequence, used, k):
        return torch.tensor([[g1, g2] + [0] * (k - 2)] * len(used)), torch.full_like(used, 2)

    monkeypatch.setitem(speculation.GUESSERS, "ngram", guess)
    result = eos_generator.generate(prompt, max_new_tokens=4, max_length=32, seed=5, num_return_sequences=6000,
                                    speculate="ngram:2", **SAMPLING)[0]
    assert eos_generator.last_stats.speculation.accepted > 0
    assert_pairs_follow(result.sequences, t0, joint)


# --- refusals ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["lookup", "ngram:0", "ngram:9", "ngram:x", "ngram:2:3", 4])
def test_bad_values_are_refused(bad):
    with pytest.raises(SpeculationError):
        parse_speculation(bad)


def test_beams_are_refused(generator):
    with pytest.raises(SpeculationError, match="not with beam search"):
        generator.generate("Hi", max_length=16, num_beams=2, speculate="ngram")


@pytest.mark.parametrize("argv,message", [
    (["--speculate", "ngram:12", "x"], "K must be a whole number from 1 to 8"),
    (["--speculate", "nope", "x"], "unknown speculation"),
])
def test_cli_refuses_in_one_line(capsys, argv, message):
    import bloom

    assert bloom.main(argv) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_cli_prints_the_speculation_in_the_batch_line(capsys, tiny_checkpoint):
    import bloom

    assert bloom.main(["--weights", str(tiny_checkpoint), "--speculate", "ngram:4", "--max_length", "48",
                       REPEATING[0]]) == 0
    out = capsys.readouterr().out
    assert "tokens/verify, acceptance" in out


# --- the graph stand-in --------------------------------------------------------------------------------


@pytest.mark.slow
def test_no_new_graph_after_warm_up_on_the_stand_in(graph_stand_in, make_ckpt, monkeypatch):
    """Verify passes captured like decode steps (HPU graphs; CUDA graphs since the CUDA backend
    captures "verify" too): the tokens are the eager CPU run's, and a second run (the rows
    swapped) captures no graph and compiles no lazy graph."""
    from test_graph_truth import Counts, on_card, reference, sequences

    checkpoint = make_ckpt(hidden_size=64, n_layer=2, n_head=4, seed=7)
    eager = Generator.from_pretrained(checkpoint, device="cpu")
    card = on_card(graph_stand_in, checkpoint, speculate="ngram:4")
    prompts = PROMPTS[:3]
    for search in (dict(), dict(do_sample=True, seed=3, top_k=20)):
        options = dict(max_length=32, bucket_width=8, ignore_eos=True, **search)
        with graph_stand_in.off_card():
            plain = eager.generate(prompts, **options)
        monkeypatch.setitem(speculation.GUESSERS, "ngram", oracle(eager, prompts, [r.token_ids for r in plain]))
        for rows in (prompts, prompts[::-1]):
            got = sequences(card.generate(rows, **options))
            assert got == reference(graph_stand_in, eager, rows, speculate="ngram:4", **options)
            if not search:
                assert got == sequences(plain if rows is prompts else plain[::-1])
        assert card.last_stats.speculation.verifies > 0 and card.backend.signatures_of("verify")
        counts = Counts(graph_stand_in)
        assert sequences(card.generate(prompts[::-1], **options)) == reference(
            graph_stand_in, eager, prompts[::-1], speculate="ngram:4", **options)
        assert counts.unchanged(), (search, counts.captures, graph_stand_in.captures)
