"""Speculation with a draft model (generation/search/draft.py): greedy output token for token the
output without it (and transformers'), with EOS, budgets, stop strings and processors; the target
itself as its draft accepts every guess; the draft's guesses are its own greedy continuation
whatever the rows kept and however long it sat out; sampling keeps the target's distribution;
drafts of another vocabulary, bad values and a draft too big are refused in one line; on the
graph stand-in nothing is captured after warm-up.

Drafts: the target itself (acceptance 1); the target with its products' weights perturbed (a
draft that agrees often, not always: both acceptance and rejection run); its first layers
(``utils/first_layers.py``; random weights' first layers agree rarely); other random weights of the
same vocabulary (guesses that fail).
"""

from __future__ import annotations

import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from generation.generator import Generator
from generation.run.batch import make_batch
from generation.search import draft as draft_module
from generation.search.draft import DraftGuesser, DraftModel
from generation.search.guesses import SpeculationError, parse_speculation
from sampling_reference import SAMPLING, assert_pairs_follow, second_and_third
from utils.first_layers import first_layers

pytestmark = pytest.mark.usefixtures("verify_any_batch")  # batches past the CPU's step-aside

PROMPTS = [
    "It was the best of times",
    "a b c a b c a b c a b",
    "The quick brown fox jumps over the lazy dog and keeps running",
    "Hello, world",
]


def ids_of(results):
    return [[s.token_ids for s in r.sequences] for r in results]


def hf_greedy(model, ids, max_length, eos_token_id=None, **options):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_length=max_length, do_sample=False, num_beams=1, eos_token_id=eos_token_id,
                             pad_token_id=3, **options)
    return out[0, len(ids):].tolist()


def perturbed(src, out, scale=0.05, seed=1):
    """A copy of checkpoint ``src`` whose matrices have noise of ``scale`` times their spread added:
    it agrees with ``src`` on most tokens, not all."""
    shutil.copytree(src, out)
    weights = load_file(out / "model.safetensors")
    gen = torch.Generator().manual_seed(seed)
    weights = {name: w + scale * w.std() * torch.randn(w.shape, generator=gen) if w.dim() == 2 else w
               for name, w in weights.items()}
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def truth(seed7_checkpoint, seed7_reference):
    """transformers' greedy tokens of each of PROMPTS on seed7, to max_length 48."""
    tokenizer = Generator.from_pretrained(seed7_checkpoint, device="cpu").tokenizer
    return [hf_greedy(seed7_reference, tokenizer.encode(prompt), 48) for prompt in PROMPTS]


@pytest.fixture(scope="module")
def drafted(seed7_checkpoint, tmp_path_factory):
    draft = perturbed(seed7_checkpoint, tmp_path_factory.mktemp("draft") / "perturbed")
    return Generator.from_pretrained(seed7_checkpoint, speculate="draft:4", draft_model=draft)


@pytest.fixture(scope="module")
def eos_drafted(eos_checkpoint, tmp_path_factory):
    draft = perturbed(eos_checkpoint, tmp_path_factory.mktemp("eos_draft") / "perturbed")
    return Generator.from_pretrained(eos_checkpoint, speculate="draft:4", draft_model=draft)


@pytest.fixture(scope="module")
def first_two(seed7_checkpoint, tmp_path_factory):
    """Seed7's first two blocks of three."""
    return first_layers(seed7_checkpoint, tmp_path_factory.mktemp("first_two"), 2)


# --- greedy: the same tokens ------------------------------------------------------------------------


@pytest.mark.parametrize("batch,k", [(1, 2), (1, 4), (4, 3), (4, 8)])
def test_greedy_with_a_draft_equals_plain_and_transformers(drafted, truth, batch, k):
    prompts = PROMPTS[:batch]
    plain = ids_of(drafted.generate(prompts, max_length=48, speculate="off"))
    assert [ids[0] for ids in plain] == truth[:batch]
    assert ids_of(drafted.generate(prompts, max_length=48, speculate=f"draft:{k}")) == plain
    stats = drafted.last_stats.speculation
    assert stats.verifies > 0 and 0 < stats.accepted < stats.offered  # guesses kept and guesses rejected


@pytest.mark.parametrize("options", [
    dict(ignore_eos=False),
    dict(ignore_eos=False, repetition_penalty=1.3, min_new_tokens=6),
    dict(ignore_eos=False, no_repeat_ngram_size=2),
    dict(ignore_eos=False, max_new_tokens=7),
    dict(ignore_eos=False, bucket_width=8),
], ids=["eos", "penalty+min_tokens", "no_repeat", "max_new_tokens", "buckets"])
def test_eos_budgets_and_processors(eos_drafted, eos_reference, options):
    options = dict(max_length=36, **options)
    plain = ids_of(eos_drafted.generate(PROMPTS, speculate="off", **options))
    if len(options) == 2:
        assert any(ids[0][-1] == 2 for ids in plain)  # EOS really ended some rows
    hf = {k: v for k, v in options.items() if k in ("repetition_penalty", "no_repeat_ngram_size", "max_new_tokens",
                                                     "min_new_tokens")}
    for ids, prompt in zip(plain, PROMPTS):
        assert ids[0] == hf_greedy(eos_reference, eos_drafted.tokenizer.encode(prompt), 36, eos_token_id=2, **hf)
    assert ids_of(eos_drafted.generate(PROMPTS, **options)) == plain
    assert eos_drafted.last_stats.speculation.accepted > 0


def test_stop_strings_and_budgets_per_row(eos_drafted):
    budgets = [20, 3, 11, 25]
    plain = eos_drafted.generate(PROMPTS, max_length=40, ignore_eos=True, max_new_tokens_each=budgets, speculate="off")
    stop = plain[0].text[len(plain[0].text) // 2:][:4]
    assert stop.strip()
    options = dict(max_length=40, ignore_eos=True, max_new_tokens_each=budgets, stop=stop)
    want = eos_drafted.generate(PROMPTS, speculate="off", **options)
    assert want[0].finish_reason == "stop"
    got = eos_drafted.generate(PROMPTS, **options)
    assert [(r.token_ids, r.text, r.finish_reason) for r in got] == [(r.token_ids, r.text, r.finish_reason) for r in want]
    assert [len(r.token_ids) for r in got][1:3] == [3, 11]


def test_a_draft_of_the_targets_first_layers(seed7_checkpoint, truth, first_two):
    generator = Generator.from_pretrained(seed7_checkpoint, speculate="draft:4", draft_model=first_two)
    assert generator.draft.runner.model.config.n_layer == 2
    assert [ids[0] for ids in ids_of(generator.generate(PROMPTS, max_length=48))] == truth
    assert generator.last_stats.speculation.verifies > 0


def test_the_target_as_its_own_draft_accepts_every_guess(seed7_checkpoint):
    generator = Generator.from_pretrained(seed7_checkpoint, speculate="draft:4", draft_model=seed7_checkpoint)
    plain = ids_of(generator.generate(PROMPTS, max_length=48, speculate="off"))
    assert ids_of(generator.generate(PROMPTS, max_length=48)) == plain
    stats = generator.last_stats.speculation
    assert stats.offered > 20 and stats.accepted == stats.offered
    assert stats.tokens_per_verify > 4  # k accepted + 1 a pass, but where the budget cuts


def test_a_draft_that_always_fails_steps_aside(seed7_checkpoint, make_ckpt):
    """Other random weights of the same vocabulary: its guesses fail, adaptive k takes the rows to
    0 guesses (the draft then sits passes out and catches up on the tokens it missed at each
    probe), and the tokens are the plain loop's."""
    other = make_ckpt(hidden_size=32, n_layer=1, n_head=2, seed=99)
    generator = Generator.from_pretrained(seed7_checkpoint, speculate="draft:4", draft_model=other)
    plain = ids_of(generator.generate(PROMPTS[:2], max_length=80, speculate="off"))
    assert ids_of(generator.generate(PROMPTS[:2], max_length=80)) == plain
    stats = generator.last_stats.speculation
    assert stats.decodes > 2 * stats.verifies and stats.acceptance < 0.3


def hf_continuation(model, ids, n):
    """transformers' n greedy tokens after ``ids``, one forward of the whole row each."""
    ids = list(ids)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[-n:] if n else []


@pytest.mark.parametrize("which", ["itself", "first_two"])
def test_guesses_are_the_drafts_greedy_continuation_whatever_the_rows_kept(seed7_checkpoint, seed7_reference,
                                                                           truth, first_two, which):
    """The guess source alone, driven by hand: rows move on by 1 to 6 tokens of the target's
    greedy text between calls (the draft's proposals kept, in part or not at all: the text is not
    the draft's), some calls want no guess (the draft sits them out, up to 9 tokens behind), and
    every guess is still transformers' greedy continuation of the row on the draft's weights."""
    folder = seed7_checkpoint if which == "itself" else first_two
    reference = seed7_reference if which == "itself" else transformers.BloomForCausalLM.from_pretrained(folder).eval()
    draft = Generator.from_pretrained(folder)
    batch = make_batch(draft.tokenizer, PROMPTS, draft.options(max_length=48), draft.device)
    rows = [ids + new for ids, new in zip(batch.prompt_ids, truth)]  # 48 tokens each
    sequence = torch.tensor(rows)
    guesser = DraftModel(draft.runner, folder).guesser()
    guesser.begin(batch)
    used = batch.lengths + 1  # the target's first token
    moves = [[1, 2, 3, 1], [2, 1, 5, 4], [6, 1, 1, 2], [1, 1, 1, 1], [3, 3, 2, 6], [5, 4, 1, 1]]
    wanted = [[4, 4, 4, 4], [2, 0, 3, 1], [0, 0, 0, 0], [0, 0, 0, 0], [1, 4, 0, 2], [4, 3, 4, 4]]
    checked = agreed = 0
    for move, want in zip(moves + moves, wanted + wanted[::-1]):
        guesses, counts = guesser(sequence, used, 8, torch.tensor(want))
        assert counts.tolist() == [max(want)] * 4
        for b, n in enumerate(counts.tolist()):
            n = min(n, len(rows[b]) - used[b])  # (guesses past the cache are cut by the loop)
            expected = hf_continuation(reference, rows[b][: used[b]], n)
            assert guesses[b, :n].tolist() == expected, (b, used[b], want)
            checked += n
            agreed += expected[:1] == rows[b][used[b]: used[b] + 1]
        used = (used + torch.tensor(move)).clamp(max=len(rows[0]) - 1)  # a running row's next slot is in the cache
    assert checked > 80
    if which == "first_two":
        assert agreed < 20  # the text mostly left the draft's proposals


# --- sampling ---------------------------------------------------------------------------------------


def test_sampling_is_seeded(eos_drafted):
    options = dict(max_length=30, seed=11, **SAMPLING)
    first = ids_of(eos_drafted.generate(PROMPTS, **options))
    assert eos_drafted.last_stats.speculation.accepted > 0
    assert ids_of(eos_drafted.generate(PROMPTS, **options)) == first
    assert ids_of(eos_drafted.generate(PROMPTS, **dict(options, seed=12))) != first


@pytest.mark.slow
def test_rejection_sampling_with_a_draft_keeps_the_targets_distribution(eos_checkpoint, eos_reference):
    """Chi-square: the second and third tokens (t1, t2) of many seeded rows, after the most common
    first token t0, against transformers' exact joint p(t1 | t0) p(t2 | t0, t1). The draft is the
    target itself: its greedy guesses are the likeliest t1 and its likeliest t2, accepted often
    but not always, so both acceptance and the residual draw decide the tokens."""
    generator = Generator.from_pretrained(eos_checkpoint, speculate="draft:2", draft_model=eos_checkpoint)
    prompt = PROMPTS[0]
    t0, p1, joint = second_and_third(eos_reference, generator.tokenizer.encode(prompt))
    assert 0.2 < p1.max() < 0.9  # a guess that is neither always nor never accepted
    result = generator.generate(prompt, max_new_tokens=4, max_length=32, seed=5, num_return_sequences=6000,
                                **SAMPLING)[0]
    stats = generator.last_stats.speculation
    assert 0 < stats.accepted < stats.offered
    assert_pairs_follow(result.sequences, t0, joint)


# --- refusals ----------------------------------------------------------------------------------------


def test_draft_values_parse():
    assert str(parse_speculation("draft")) == "draft:4"
    assert str(parse_speculation("Draft:7")) == "draft:7"
    for bad in ("draft:0", "draft:9", "draft:x", "drafts"):
        with pytest.raises(SpeculationError):
            parse_speculation(bad)


def test_a_draft_of_another_vocabulary_is_refused_before_loading(monkeypatch, seed7_checkpoint, tiny_checkpoint,
                                                                 make_ckpt):
    import generation.generator as generator_module

    def no_load(*args, **kwargs):
        raise AssertionError("a weight was loaded")

    monkeypatch.setattr(generator_module, "load_model", no_load)
    with pytest.raises(SpeculationError, match="vocab_size 2048, the target 1024"):
        Generator.from_pretrained(seed7_checkpoint, speculate="draft", draft_model=tiny_checkpoint)
    # The same vocab_size, another tokenizer (the test tokenizer's 1000 tokens against the default's 2000).
    other = make_ckpt(vocab_size=2048, hidden_size=32, n_layer=1, n_head=2, seed=3)
    with pytest.raises(SpeculationError, match="tokenizer.json is not the target's"):
        Generator.from_pretrained(tiny_checkpoint, speculate="draft", draft_model=other)
    with pytest.raises(SpeculationError, match="draft model: weights folder .* does not exist"):
        Generator.from_pretrained(seed7_checkpoint, speculate="draft", draft_model="/nonexistent/draft")


@pytest.mark.parametrize("kwargs,message", [
    (dict(speculate="draft:2"), "needs a draft model: draft_model=DIR"),
    (dict(draft_model="x"), "draft_model goes with speculate='draft"),
    (dict(speculate="ngram", draft_model="x"), "draft_model goes with speculate='draft"),
])
def test_draft_and_draft_model_go_together(seed7_checkpoint, kwargs, message):
    with pytest.raises(SpeculationError, match=message):
        Generator.from_pretrained(seed7_checkpoint, **kwargs)


def test_a_draft_too_big_is_refused_before_it_loads(monkeypatch, seed7_checkpoint):
    monkeypatch.setattr(draft_module, "agreed_free_bytes", lambda device, parallel=None: 1000)
    with pytest.raises(ValueError, match="the draft model .* needs about .* for its weights .* but 1000 B is free"):
        Generator.from_pretrained(seed7_checkpoint, speculate="draft", draft_model=seed7_checkpoint)


def test_a_calls_memory_check_counts_the_drafts_cache(monkeypatch, seed7_checkpoint):
    """Free memory for the target's cache of a call and half as much again: enough without the
    draft, not with the draft's own cache (the target itself as the draft: as big again)."""
    import generation.request.validate as validate
    from generation.request.memory import MemoryCheckError, estimate_bytes

    generator = Generator.from_pretrained(seed7_checkpoint, speculate="draft", draft_model=seed7_checkpoint)
    opts = generator.options(max_length=4096)
    longest = max(len(generator.tokenizer.encode(p)) for p in PROMPTS)
    alone = estimate_bytes(generator.model.config, generator.dtype, len(PROMPTS), 4096, longest)
    monkeypatch.setattr(validate, "agreed_free_bytes", lambda device, parallel=None: alone * 3 // 2)
    generator.check_fits(PROMPTS, opts, parse_speculation("ngram"))
    with pytest.raises(MemoryCheckError):
        generator.check_fits(PROMPTS, opts, parse_speculation("draft"))
    with pytest.raises(MemoryCheckError):
        generator.generate(PROMPTS, max_length=4096)  # the generator's own speculation: the draft


def test_beams_and_a_generator_without_a_draft_are_refused(drafted, seed7_checkpoint):
    with pytest.raises(SpeculationError, match="not with beam search"):
        drafted.generate("Hi", max_length=16, num_beams=2)
    plain = Generator.from_pretrained(seed7_checkpoint)
    with pytest.raises(SpeculationError, match="needs the draft model loaded with the generator"):
        plain.generate("Hi", max_length=16, speculate="draft")


@pytest.mark.parametrize("argv,message", [
    (["--speculate", "draft", "x"], "--speculate draft needs --draft_model DIR"),
    (["--draft_model", "d", "x"], "--draft_model goes with --speculate draft"),
    (["--speculate", "ngram", "--draft_model", "d", "x"], "--draft_model goes with --speculate draft"),
    (["--speculate", "draft:9", "--draft_model", "d", "x"], "K must be a whole number from 1 to 8"),
    (["--speculate", "draft", "--serve"], "--speculate draft needs --draft_model DIR"),
])
def test_cli_refuses_in_one_line(capsys, argv, message):
    import bloom

    assert bloom.main(argv) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_cli_runs_with_a_draft(capsys, seed7_checkpoint, first_two):
    import bloom

    assert bloom.main(["--weights", str(seed7_checkpoint), "--speculate", "draft:3", "--draft_model", str(first_two),
                       "--max_length", "40", PROMPTS[0]]) == 0
    out = capsys.readouterr().out
    assert "tokens/verify, acceptance" in out


def test_first_layers_refuses_a_count_out_of_range(seed7_checkpoint, tmp_path, capsys):
    from utils import first_layers as tool

    assert tool.main([str(seed7_checkpoint), str(tmp_path / "out"), "--layers", "4"]) == 1
    err = capsys.readouterr().err
    assert err.strip() == f"error: layers must be from 1 to 3 (the blocks of {seed7_checkpoint}), got 4"
    assert not (tmp_path / "out").exists()


def test_requests_and_chat_with_a_draft(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    """``--requests`` and ``--chat`` take the draft through the same generator: the results and
    replies of the embedded default, its first two blocks as the draft, are those without
    speculation (request lines with stop strings, log-probs, echo and a JSON schema)."""
    import io
    import json
    import sys

    import bloom
    from test_speculation_paths import write_requests

    draft = first_layers(tiny_checkpoint, tmp_path / "draft", 2)
    requests = write_requests(tmp_path / "requests.jsonl")
    records, shown = {}, {}
    for name, extra in (("plain", []), ("draft", ["--speculate", "draft:3", "--draft_model", str(draft)])):
        results = tmp_path / f"{name}.jsonl"
        assert bloom.main(["--weights", str(tiny_checkpoint), "--requests", str(requests), "--results", str(results),
                           *extra]) == 0
        summary = capsys.readouterr().err.strip().splitlines()[-1]
        assert ("tokens/verify, acceptance" in summary) == bool(extra)
        records[name] = [json.loads(line) for line in results.read_text().splitlines()]
        for record in records[name]:
            del record["result"]["request_time"]
        monkeypatch.setattr(sys, "stdin", io.StringIO("In the beginning God created the heaven\nAnd God said\n/raw_prompt\n"))
        assert bloom.main(["--chat", "--weights", str(tiny_checkpoint), "--sample", "f", "--max_tokens", "30",
                           "--max_length", "256", *extra]) == 0
        shown[name] = capsys.readouterr().out
    assert records["draft"] == records["plain"] and len(records["plain"]) == 4
    assert shown["draft"] == shown["plain"] and shown["plain"].count("<bot>:") >= 2


@pytest.mark.slow
def test_two_ranks_with_a_draft_give_one_process_tokens(tiny_checkpoint, tmp_path):
    """``deepspeed --num_gpus 2 bloom.py --speculate draft:4 --draft_model DIR``: every rank runs its
    slice of the draft (the default's first two blocks) and accepts alike; the tokens of one
    process without speculation."""
    import json
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    draft = first_layers(tiny_checkpoint, tmp_path / "draft", 2)
    prompts = ["And God said unto Moses", "In the beginning God created the heaven and the earth. And the earth"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "out.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)}
    command = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(port),
               str(root / "bloom.py"), "--weights", str(tiny_checkpoint), "--device", "cpu", "--speculate", "draft:4",
               "--draft_model", str(draft), "--max_length", "64", "--output_file", str(out), *prompts]
    done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=400)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-6000:]
    want = ids_of(Generator.from_pretrained(tiny_checkpoint).generate(prompts, max_length=64))
    assert [[r["token_ids"]] for r in json.loads(out.read_text())] == want
    assert "tokens/verify, acceptance" in log


# --- the graph stand-in --------------------------------------------------------------------------------


@pytest.mark.slow
def test_no_new_graph_after_warm_up_with_a_draft_on_the_stand_in(graph_stand_in, make_ckpt, tmp_path):
    """The draft's steps (prefill, catch-up passes, decode) captured like the target's: the tokens
    are the eager CPU run's, and a second run (the rows swapped) captures no graph and compiles no
    lazy graph."""
    from test_graph_truth import Counts, on_card, reference, sequences

    checkpoint = make_ckpt(hidden_size=64, n_layer=2, n_head=4, seed=7)
    draft = perturbed(checkpoint, tmp_path / "draft")  # both catch-ups: after a rejection and after full acceptance
    eager = Generator.from_pretrained(checkpoint, device="cpu", speculate="draft:4", draft_model=draft)
    card = on_card(graph_stand_in, checkpoint, speculate="draft:4", draft_model=draft)
    prompts = PROMPTS[:3]
    for search in (dict(), dict(do_sample=True, seed=3, top_k=20)):
        options = dict(max_length=32, bucket_width=8, ignore_eos=True, **search)
        for rows in (prompts, prompts[::-1]):
            got = sequences(card.generate(rows, **options))
            assert got == reference(graph_stand_in, eager, rows, **options)
            if not search:
                assert got == reference(graph_stand_in, eager, rows, speculate="off", **options)
        assert card.last_stats.speculation.verifies > 0 and all(card.draft.runner.backend.signatures_of(step) for step in ("decode", "verify"))
        counts = Counts(graph_stand_in)
        again = sequences(card.generate(prompts[::-1], **options))
        assert counts.unchanged(), (search, counts.captures, graph_stand_in.captures)
        assert again == reference(graph_stand_in, eager, prompts[::-1], **options)
