"""Speculative decoding in the server (``--serve --speculate ngram[:K]``, generation/serving/speculating.py),
through the official openai client against a real server: greedy answers equal the same server's
without speculation and transformers' ``generate``, alone and among concurrent clients with stop
strings, budgets and penalties; streams equal whole answers; seeded sampling repeats; /metrics
counts the verify passes and the guesses they accepted."""

from __future__ import annotations

import http.client
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from generation import Generator
from generation.search.guesses import parse_speculation
from generation.serving.params import SamplingParams
from test_graph_truth import Counts, checkpoint, eager, new_lazy_graphs, on_card  # noqa: F401

MODEL = "bloom-tiny"
# The first repeats itself: its greedy continuation copies it, so guesses are accepted.
PROMPTS = ["one two three four one two three four one two three four one two",
           "It was the best of times, it was the worst of times,", "Hello there", "a b c d e f g"]
CONFIG = dict(max_batch=8, max_length=96, bucket_width=8, metrics=True)  # windows end often: verify passes cross them


@pytest.fixture(scope="module")
def speculating(serve, seed7_checkpoint):
    with serve(Generator.from_pretrained(seed7_checkpoint, device="cpu"), MODEL,
               speculation=parse_speculation("ngram:4"), **CONFIG) as running:
        yield running


@pytest.fixture(scope="module")
def plain(serve, seed7_checkpoint):
    with serve(Generator.from_pretrained(seed7_checkpoint, device="cpu"), MODEL, **CONFIG) as running:
        yield running


def metric(running, name: str) -> float:
    connection = http.client.HTTPConnection("127.0.0.1", running.port, timeout=10)
    connection.request("GET", "/metrics")
    text = connection.getresponse().read().decode()
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def complete(running, prompt: str, **options) -> str:
    r = running.client().completions.create(model=MODEL, prompt=prompt, **options)
    return r.choices[0].text


def transformers_text(reference, tokenizer, prompt: str, max_new_tokens: int) -> str:
    ids = tokenizer.encode(prompt)
    with torch.no_grad():
        out = reference.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=2, pad_token_id=3)
    new = out[0, len(ids):].tolist()
    return tokenizer.decode(new[: new.index(2)] if 2 in new else new)


def test_greedy_completions_equal_plain_serving_and_transformers(speculating, plain, seed7_reference):
    accepted = metric(speculating, "bloom_speculation_guesses_accepted_total")
    passes = metric(speculating, "bloom_speculation_verify_passes_total")
    for prompt in PROMPTS:
        got = complete(speculating, prompt, max_tokens=40, temperature=0)
        assert got == complete(plain, prompt, max_tokens=40, temperature=0)
        assert got == transformers_text(seed7_reference, speculating.generator.tokenizer, prompt, 40)
    assert metric(speculating, "bloom_speculation_verify_passes_total") > passes
    assert metric(speculating, "bloom_speculation_guesses_accepted_total") > accepted
    assert metric(speculating, "bloom_speculation_guesses_offered_total") >= metric(
        speculating, "bloom_speculation_guesses_accepted_total")


def test_chat_completions_equal_plain_serving(speculating, plain):
    messages = [{"role": "system", "content": "Repeat after me."},
                {"role": "user", "content": "one two three four one two three four one two three"}]

    def chat(running):
        r = running.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0)
        return r.choices[0].message.content, r.choices[0].finish_reason

    assert chat(speculating) == chat(plain)


# Mixed requests at once: lengths, budgets, stop strings, penalties (each applied at every verified
# position), greedy n > 1.
REQUESTS = [
    dict(prompt=PROMPTS[0], max_tokens=40),
    dict(prompt=PROMPTS[0], max_tokens=33, repetition_penalty=1.3),
    dict(prompt=PROMPTS[0], max_tokens=37, presence_penalty=0.5, frequency_penalty=0.7),
    dict(prompt=PROMPTS[1], max_tokens=7),
    dict(prompt=PROMPTS[0] + " three four", max_tokens=40, stop=[" four one"]),
    dict(prompt=PROMPTS[2], max_tokens=25, n=2),
    # Rows that do not speculate, beside those that do: a grammar, log-probs.
    dict(prompt=PROMPTS[0], max_tokens=20, guided_regex="(one|two|three|four)( (one|two|three|four)){2,6}"),
    dict(prompt=PROMPTS[0], max_tokens=12, logprobs=2),
]


def answers(running, requests) -> list:
    def one(request):
        body = dict(request)
        extra = {k: body.pop(k) for k in ("repetition_penalty", "guided_regex") if k in body}
        r = running.client().completions.create(model=MODEL, temperature=0, extra_body=extra or None, **body)
        return [(c.text, c.finish_reason, c.logprobs and c.logprobs.token_logprobs) for c in r.choices]

    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(one, requests))


def same(have: list, want: list) -> None:
    """Texts and finish reasons equal; log-probs within float noise (other rows in the batch)."""
    for mine, theirs in zip(have, want, strict=True):
        assert [c[:2] for c in mine] == [c[:2] for c in theirs]
        for (_, _, lp), (_, _, their_lp) in zip(mine, theirs):
            assert (lp is None) == (their_lp is None) and (lp is None or lp == pytest.approx(their_lp, abs=1e-4))


def test_concurrent_clients_equal_plain_serving(speculating, plain):
    want = [answers(plain, [r])[0] for r in REQUESTS]  # each alone
    same(answers(speculating, REQUESTS), want)
    same(answers(speculating, REQUESTS[::-1]), want[::-1])


def test_streaming_equals_whole_answers(speculating):
    for request in (REQUESTS[0], REQUESTS[4]):
        whole = answers(speculating, [request])[0][0]
        chunks = list(speculating.client().completions.create(model=MODEL, temperature=0, stream=True, **request))
        text = "".join(c.choices[0].text for c in chunks)
        reason = next(c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason)
        assert (text, reason) == whole[:2]


def test_seeded_sampling_repeats(speculating):
    options = dict(max_tokens=30, temperature=0.9, top_p=0.95, seed=11)
    first = complete(speculating, PROMPTS[0], **options)
    assert first and complete(speculating, PROMPTS[0], **options) == first
    # Alongside other rows, the same text (a row's draws and accept tests are its own).
    with ThreadPoolExecutor(3) as pool:
        texts = list(pool.map(lambda p: complete(speculating, p, **options), [PROMPTS[0], PROMPTS[1], PROMPTS[0]]))
    assert texts[0] == texts[2] == first


def test_cli_refuses_a_bad_speculate_value_for_the_server():
    proc = subprocess.run([sys.executable, "bloom.py", "--serve", "--speculate", "ngram:99"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "K must be a whole number" in proc.stderr.strip().splitlines()[-1]


# --- the choice at every verified position (speculating.choose_verified) ---------------------------


def row_options(rows: int, vocab: int, width: int, settings: list[dict], seed: int = 0):
    from generation.serving.params import SamplingParams
    from generation.serving.row_options import RowOptions

    opts = RowOptions(rows, vocab, width, "cpu", 3)
    generator = torch.Generator().manual_seed(seed)
    for slot in range(rows):
        params = SamplingParams(**settings[slot % len(settings)])
        prompt = torch.randint(0, vocab, (4,), generator=generator).tolist()
        opts.set_row(slot, params, key=1000 + slot, prompt=prompt)
    return opts


PENALTIES = [dict(repetition_penalty=1.5), dict(presence_penalty=0.8, frequency_penalty=0.6), {},
             dict(repetition_penalty=0.7, frequency_penalty=-0.5)]


def test_greedy_positions_see_the_guesses_before_them_as_chosen():
    """Guesses equal to what the plain step chooses one token at a time (penalties updated after
    each) are all accepted, and every position's token is the plain step's."""
    from generation.search.choose import RowFlags, choose_rows
    from generation.serving.params import SamplingParams
    from generation.serving.speculating import choose_verified

    b, s, vocab, width = 8, 5, 16, 16
    params = [SamplingParams(**PENALTIES[i % len(PENALTIES)]) for i in range(b)]
    flags = RowFlags(params)
    logits = torch.randn(b, s, vocab, generator=torch.Generator().manual_seed(1))
    used, steps = torch.full((b,), 4), torch.zeros(b, dtype=torch.long)
    plain = row_options(b, vocab, width, PENALTIES)
    want = []
    for j in range(s):  # the plain step, one position at a time
        token = choose_rows(logits[:, j], plain, b, used + j, steps + j, flags)
        plain.record(b, used + j, token, flags.repetition, flags.openai_penalties)
        want.append(token)
    want = torch.stack(want, dim=1)  # [b, S]
    # The penalties matter here: without them the same logits choose other tokens.
    assert not torch.equal(want, logits.argmax(dim=-1))
    tokens, accepted = choose_verified(logits, row_options(b, vocab, width, PENALTIES), b, used, steps,
                                       want[:, :-1], torch.full((b,), s - 1), flags)
    assert accepted.tolist() == [s - 1] * b
    assert torch.equal(tokens, want)


def test_a_position_without_a_guess_chooses_as_the_plain_step():
    """Sampled and greedy rows (temperature, top-k, top-p, penalties) offering no guess choose at
    position 0 exactly the plain step's token: the same processors and the same draw."""
    from generation.search.choose import RowFlags, choose_rows
    from generation.serving.params import SamplingParams
    from generation.serving.speculating import choose_verified

    settings = [dict(temperature=0.8, top_k=5, seed=1), dict(temperature=1.2, top_p=0.7, seed=2), {},
                dict(temperature=0.5, repetition_penalty=1.3, presence_penalty=0.5, seed=3)]
    b, s, vocab = 16, 3, 32
    flags = RowFlags([SamplingParams(**settings[i % 4]) for i in range(b)])
    logits = torch.randn(b, s, vocab, generator=torch.Generator().manual_seed(2))
    used, steps = torch.full((b,), 4), torch.arange(b)
    want = choose_rows(logits[:, 0], row_options(b, vocab, 16, settings), b, used, steps, flags)
    tokens, accepted = choose_verified(logits, row_options(b, vocab, 16, settings), b, used, steps,
                                       torch.zeros(b, s - 1, dtype=torch.long), torch.zeros(b, dtype=torch.long), flags)
    assert accepted.tolist() == [0] * b
    assert torch.equal(tokens[:, 0], want)


def test_a_sampled_position_after_an_accepted_guess_draws_as_the_plain_step_there():
    """Position 1 (the bonus position) of sampled rows whose one guess is certain (probability 1):
    the token there is the plain step's draw at the next step, over the history with the guess in it."""
    from generation.search.choose import RowFlags, choose_rows
    from generation.serving.params import SamplingParams
    from generation.serving.speculating import choose_verified

    settings = [dict(temperature=0.9, top_k=5, seed=4, repetition_penalty=1.4), dict(temperature=1.1, top_k=3, seed=8)]
    b, vocab = 12, 32
    flags = RowFlags([SamplingParams(**settings[i % 2]) for i in range(b)])
    logits = torch.randn(b, 2, vocab, generator=torch.Generator().manual_seed(3))
    certain = logits[:, 0].argmin(dim=-1)
    logits[:, 0].scatter_(1, certain[:, None], 1000.0)
    used, steps = torch.full((b,), 4), torch.arange(b) + 2
    plain = row_options(b, vocab, 16, settings)
    plain.record(b, used, certain, flags.repetition, flags.openai_penalties)
    want = choose_rows(logits[:, 1], plain, b, used + 1, steps + 1, flags)
    tokens, accepted = choose_verified(logits, row_options(b, vocab, 16, settings), b, used, steps,
                                       certain[:, None],
                                       torch.ones(b, dtype=torch.long), flags)
    assert torch.equal(tokens[:, 0], certain) and accepted.tolist() == [1] * b
    assert torch.equal(tokens[:, 1], want)


def test_sampled_first_tokens_keep_the_target_distribution():
    """Rejection with a point-mass draft: over many keys, the token kept at position 0 follows the
    processed target distribution (temperature, top-k) whatever the guess (chi-square)."""
    from generation.search.choose import RowFlags
    from generation.serving.params import SamplingParams
    from generation.serving.speculating import choose_verified

    rows, vocab, setting = 4000, 6, dict(temperature=0.7, top_k=4, seed=5)
    flags = RowFlags([SamplingParams(**setting)])
    base = torch.tensor([1.0, 0.2, -0.5, 0.8, -2.0, 0.0])
    logits = base.expand(rows, 2, vocab).clone()
    target = torch.softmax(torch.where(base >= base.topk(4).values[-1], base / 0.7, -float("inf")), dim=0)
    for guess in (0, 2, 4):  # likely, unlikely, outside the top-k
        tokens, accepted = choose_verified(logits, row_options(rows, vocab, 8, [setting]), rows,
                                           torch.full((rows,), 4), torch.zeros(rows, dtype=torch.long),
                                           torch.full((rows, 1), guess), torch.ones(rows, dtype=torch.long), flags)
        seen = torch.bincount(tokens[:, 0], minlength=vocab).double()
        expected = target.double() * rows
        kept = expected > 0
        assert seen[~kept].sum() == 0
        chi2 = (((seen - expected)[kept]) ** 2 / expected[kept]).sum().item()
        assert chi2 < 16.3, (guess, seen.tolist(), expected.tolist())  # 3 degrees of freedom, p = 0.001
        assert torch.equal(accepted == 1, tokens[:, 0] == guess)


# --- on the graph stand-in (tests/graph_stand_in) ------------------------------------------------


# The first two rows long enough to be running, guessing, while the others join (a sampled row
# does not guess in the server).
JOINING_PARAMS = [SamplingParams(max_tokens=40), SamplingParams(max_tokens=40, repetition_penalty=1.2),
                  SamplingParams(max_tokens=20, temperature=0.8, seed=3), SamplingParams(max_tokens=9, stop=["d e"]),
                  SamplingParams(max_tokens=20, presence_penalty=0.4)]


def joining_answers(generator, speculate, prompts: list[str], engine=None):
    """Each prompt's tokens from an engine (a fresh, warmed-up one unless given) with
    ``JOINING_PARAMS``: two rows run until a verify pass has guessed, then the others join, in
    segments inside verify passes. Returns (token ids per prompt, the engine)."""
    from generation.serving.engine import Engine, EngineConfig

    if engine is None:
        engine = Engine(generator, EngineConfig(max_batch=4, max_length=64, bucket_width=32, max_prefill=2,
                                                prefill_chunk=16, burst_wait_ms=0,
                                                speculation=parse_speculation(speculate)))
        engine.warm_up()
    handles = [engine.submit(engine.tokenizer.encode(p), s) for p, s in zip(prompts[:2], JOINING_PARAMS)]
    verified = engine.stats["verify_passes"]
    for _ in range(40):
        if engine.stats["verify_passes"] > verified:
            break
        engine.step()
    handles += [engine.submit(engine.tokenizer.encode(p), s) for p, s in zip(prompts[2:], JOINING_PARAMS[2:])]
    while engine.step() or engine.queue_length:
        pass
    return [h.result(1)[0].token_ids for h in handles], engine


@pytest.mark.slow
def test_speculating_engine_on_the_stand_in_equals_the_eager_engine_and_adds_no_graph(graph_stand_in, checkpoint, eager, verify_any_batch):
    """The engine with speculation on the stand-in (HPU and CUDA personalities): its verify passes,
    with and without joining prompts' segments in them, replay graphs captured at warm-up (a second load captures nothing and, on the HPU, compiles no
    lazy graph), greedy rows give the eager engine's tokens without speculation, sampled rows (which
    do not guess) the eager engine's with it."""
    prompts = PROMPTS + ["Hi"]
    card = on_card(graph_stand_in, checkpoint)  # before anything runs off the card (the bridge's environment)
    with graph_stand_in.off_card():
        plain, _ = joining_answers(eager, None, prompts)
        sampled, _ = joining_answers(eager, "ngram:4", prompts)
    got, engine = joining_answers(card, "ngram:4", prompts)
    want = [s if p.sampling else t for t, s, p in zip(plain, sampled, JOINING_PARAMS)]
    assert got == want
    assert engine.stats["verify_passes"] > 0 and engine.stats["guesses_accepted"] > 0, engine.stats
    assert engine.stats["verify_mixed_steps"] > 0
    counts = Counts(graph_stand_in)
    again, _ = joining_answers(card, "ngram:4", prompts, engine)
    assert again == want
    assert counts.unchanged(), new_lazy_graphs(graph_stand_in, counts)


@pytest.fixture
def verify_any_batch(monkeypatch):
    """Verify passes for batches of any size (the tests of what a pass computes with several rows);
    on the CPU a batch past ``guesses.CPU_VERIFY_ROWS`` rows x positions steps aside."""
    from generation.search import guesses

    monkeypatch.setattr(guesses, "CPU_VERIFY_ROWS", 1 << 20)


def test_a_large_batch_steps_aside_and_sampled_rows_never_guess(seed7_checkpoint):
    """On the CPU four greedy rows at k = 4 (20 rows x positions, past the 16 the few-rows kernels
    take in one pass over the weights) decode instead of verifying, one row alone verifies, and a
    sampled row never guesses: the same tokens as the engine without speculation."""
    from generation.generator import Generator
    from generation.search.guesses import parse_speculation
    from generation.serving.engine import Engine, EngineConfig
    from generation.serving.params import SamplingParams

    generator = Generator.from_pretrained(seed7_checkpoint)
    prompts = [" ".join(["the cat sat on the mat"] * 3), "a b c a b c a b c", "one two one two one two", PROMPTS[0]]

    def run(speculate, prompts, params):
        engine = Engine(generator, EngineConfig(max_batch=4, max_length=96, bucket_width=32,
                                                speculation=parse_speculation(speculate)))
        handles = [engine.submit(generator.tokenizer.encode(p), params) for p in prompts]
        while engine.step():
            pass
        return [[s.token_ids for s in h.result(1)] for h in handles], engine.stats

    greedy = SamplingParams(max_tokens=12)
    plain, _ = run(None, prompts, greedy)
    together, stats = run("ngram:4", prompts, greedy)
    assert together == plain and stats["verify_passes"] == 0 and stats["decodes_stepped_aside"] > 0
    alone, stats = run("ngram:4", prompts[:1], greedy)
    assert alone == plain[:1] and stats["verify_passes"] > 0
    sampled = SamplingParams(max_tokens=12, temperature=0.8, seed=5)
    alone, stats = run("ngram:4", prompts[:1], sampled)
    assert alone == run(None, prompts[:1], sampled)[0] and stats["verify_passes"] == 0


def test_verify_passes_across_window_ends_op_by_op(seed7_checkpoint, verify_any_batch):
    """The model op by op (``--cpu_path plain``, where a pass attends only its window: the CPU's
    one-call attention reads up to each position whatever the window), windows of 8 slots: verify
    passes whose guesses cross a window's end give the tokens of the engine without speculation."""
    from bloom_hpu.runtime.cpu import CpuOptions
    from generation.serving.engine import Engine, EngineConfig
    from generation.serving.params import SamplingParams

    generator = Generator.from_pretrained(seed7_checkpoint, device="cpu", cpu=CpuOptions(path="plain"))
    prompts = [PROMPTS[0], PROMPTS[1]]

    def answers(speculate):
        engine = Engine(generator, EngineConfig(max_batch=4, max_length=64, bucket_width=8,
                                                speculation=parse_speculation(speculate)))  # eager: no warm-up needed
        handles = [engine.submit(engine.tokenizer.encode(p), SamplingParams(max_tokens=32)) for p in prompts]
        while engine.step() or engine.queue_length:
            pass
        return [h.result(1)[0].token_ids for h in handles], engine.stats

    got, stats = answers("ngram:8")
    assert stats["guesses_accepted"] > 0
    assert got == answers(None)[0]


def test_serve_bench_compares_speculation_on_and_off(tmp_path, capsys):
    """bench/serve_bench.py's ``ours+ngram:K`` variant: its ratios against ours at the same level
    and its verify passes; no step shape after warm-up. (No timing assertions: the benchmark's job.)"""
    import json

    from bench import serve_bench

    out = tmp_path / "serve.json"
    argv = ["--clients", "2", "--requests", "4", "--max_tokens", "8", "--max_batch", "4", "--max_length", "32",
            "--bucket_width", "16", "--prompt_len", "2,12", "--variants", "ours,ours+ngram:4", "--json", str(out)]
    assert serve_bench.main(argv) == 0
    assert "ours+ngram:4 at 2 clients: " in capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    assert [r["variant"] for r in rows] == ["ours", "ours+ngram:4"]
    assert rows[0]["verify_passes"] == 0 and rows[1]["verify_passes"] > 0
    assert all(r["new_shapes"] == 0 and r["tokens"] > 0 for r in rows)


# --- under tensor parallelism ------------------------------------------------------------------------

TP_SERVE = ["--serve", "--max_batch", "4", "--max_length", "64", "--bucket_width", "16", "--max_prefill", "2"]
TP_REQUESTS = [dict(prompt=PROMPTS[0], max_tokens=30), dict(prompt=PROMPTS[1], max_tokens=20, stop=[" times"]),
               dict(prompt=PROMPTS[0], max_tokens=25, frequency_penalty=0.5),
               dict(prompt=PROMPTS[0], max_tokens=20, temperature=0.8, seed=4)]


def launched_answers(folder, runs, requests, tmp_path):
    """Each run (name, its flags beside TP_SERVE, its ranks) launched as a server in turn, the
    ``requests`` (greedy unless one says otherwise) sent at once: ({name: the answers' texts}, the
    guesses accepted by the run named "two"). Each run's log is ``tmp_path / f"{name}.log"``."""
    from test_serving_tp import launch, stop

    def ask(port):
        client = openai_client(port)
        with ThreadPoolExecutor(len(requests)) as pool:
            return list(pool.map(lambda r: client.completions.create(
                model=folder.name, **({"temperature": 0} | r)).choices[0].text, requests))

    answers_of, accepted = {}, None
    for name, flags, ranks in runs:
        proc, port = launch(folder, TP_SERVE + flags, ranks, tmp_path / f"{name}.log")
        try:
            answers_of[name] = ask(port)
            if name == "two":
                accepted = metric(type("Running", (), {"port": port}), "bloom_speculation_guesses_accepted_total")
        finally:
            stop(proc)
    return answers_of, accepted


@pytest.mark.slow
def test_two_ranks_speculate_as_one_process(seed7_checkpoint, tmp_path):
    """``--serve --speculate ngram:4`` on 2 ranks (the follower replays each verify pass): greedy
    answers equal one process's without speculation, the seeded sample one process's with it, and
    its verify passes accepted guesses."""
    answers_of, accepted = launched_answers(seed7_checkpoint, (("plain", [], 1), ("one", ["--speculate", "ngram:4"], 1),
                                                               ("two", ["--speculate", "ngram:4"], 2)),
                                            TP_REQUESTS, tmp_path)
    assert "num_local_procs=2" in (tmp_path / "two.log").read_text()
    assert " verify) in " in (tmp_path / "one.log").read_text()  # the warm-up ran the verify shapes
    assert answers_of["two"][:3] == answers_of["plain"][:3] == answers_of["one"][:3]
    assert answers_of["two"][3] == answers_of["one"][3]
    assert accepted > 0


def openai_client(port: int):
    import openai

    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)


def test_lora_rows_and_prefix_hits_speculate_as_without(seed7_checkpoint, verify_any_batch, tmp_path):
    """A served LoRA adapter's rows beside the base model's (each row's adapter applies at every
    verified position), and prompts the prefix cache has seen: the same tokens as the engine without
    speculation."""
    from lora_adapters import make_adapter

    from generation.serving.engine import Engine, EngineConfig
    from generation.serving.params import SamplingParams

    adapter = make_adapter(seed7_checkpoint, tmp_path / "adapter", seed=2, r=4, lora_alpha=8,
                           target_modules=["query_key_value", "dense_4h_to_h"])
    generator = Generator.from_pretrained(seed7_checkpoint, device="cpu", lora={"tuned": adapter},
                                          prefix_cache="16MB")
    requests = [(PROMPTS[0], 0), (PROMPTS[0], 1), (PROMPTS[1] + " " + PROMPTS[0], 1)]

    def answers(speculate):
        engine = Engine(generator, EngineConfig(max_batch=4, max_length=64, bucket_width=32,
                                                speculation=parse_speculation(speculate)))
        texts = []
        for _ in range(2):  # the second time, the prompts' blocks come from the prefix cache
            handles = [engine.submit(engine.tokenizer.encode(p), SamplingParams(max_tokens=20, adapter=a))
                       for p, a in requests]
            while engine.step() or engine.queue_length:
                pass
            texts.append([h.result(1)[0].token_ids for h in handles])
        return texts, engine.stats

    got, stats = answers("ngram:4")
    want, _ = answers(None)
    assert stats["guesses_accepted"] > 0 and generator.runner.prefix.stats.hits > 0
    assert got == want
    assert want[0][0] != want[0][1]  # the adapter changes the answer


def test_prompts_join_inside_verify_passes(seed7_checkpoint, verify_any_batch):
    """Prompts that arrive while rows run join in segments carried by the verify pass itself
    (``verify_mixed``): every row, the running and the joining, gives the tokens of the engine
    without speculation, op by op (where a pass attends only its window) and on the CPU's path."""
    from bloom_hpu.runtime.cpu import CpuOptions
    from generation.serving.engine import Engine, EngineConfig
    from generation.serving.params import SamplingParams

    later = [PROMPTS[1] + " " + PROMPTS[0], PROMPTS[0] + " " + PROMPTS[2], PROMPTS[3]]

    def answers(generator, speculate):
        engine = Engine(generator, EngineConfig(max_batch=4, max_length=96, bucket_width=16, prefill_chunk=16,
                                                speculation=parse_speculation(speculate)))
        first = engine.submit(engine.tokenizer.encode(PROMPTS[0]), SamplingParams(max_tokens=40))
        for _ in range(4):
            engine.step()
        handles = [first] + [engine.submit(engine.tokenizer.encode(p), SamplingParams(max_tokens=30, **options))
                             for p, options in zip(later, ({}, {"repetition_penalty": 1.2}, {}))]
        while engine.step() or engine.queue_length:
            pass
        return [h.result(1)[0].token_ids for h in handles], engine.stats

    for cpu in (CpuOptions(path="plain"), CpuOptions()):
        generator = Generator.from_pretrained(seed7_checkpoint, device="cpu", cpu=cpu)
        got, stats = answers(generator, "ngram:4")
        assert stats["verify_mixed_steps"] > 0 and stats["guesses_accepted"] > 0
        assert got == answers(generator, None)[0]


def test_a_row_whose_guesses_fail_stops_guessing_and_is_probed_later():
    """Each row's budget (``speculating.adapt`` over ``speculation.AdaptiveK``): halved down to 0
    while its guesses fail, offered K again as a probe 16 passes later, back to 0 when the probe
    fails; a row that accepts everything keeps K; a free slot changes nothing."""
    from types import SimpleNamespace

    from generation.serving.speculating import Budget, adapt

    failing, lucky = SimpleNamespace(guess_budget=Budget(4)), SimpleNamespace(guess_budget=Budget(4))
    rows = [failing, None, lucky]
    seen = []
    for _ in range(3):
        k = failing.guess_budget.k
        adapt(rows, [k, 0, 4], [0, 0, 4])
        seen.append(failing.guess_budget.k)
    assert seen == [2, 1, 0] and lucky.guess_budget.k == 4
    for _ in range(16):
        adapt(rows, [0, 0, 4], [0, 0, 4])
    assert failing.guess_budget.k == 4 and failing.guess_budget.probing  # the probe
    adapt(rows, [4, 0, 4], [0, 0, 4])
    assert failing.guess_budget.k == 0 and lucky.guess_budget.k == 4


def test_log_probs_at_verified_positions_are_the_targets(speculating, plain):
    """A row asking for log-probs speculates too: each token's log-prob and top alternatives come
    from the verify pass's logits at its position, equal (within float noise) to the plain step's."""
    request = dict(prompt=PROMPTS[0], max_tokens=30, temperature=0, logprobs=3)
    accepted = metric(speculating, "bloom_speculation_guesses_accepted_total")
    mine = speculating.client().completions.create(model=MODEL, **request).choices[0]
    assert metric(speculating, "bloom_speculation_guesses_accepted_total") > accepted
    theirs = plain.client().completions.create(model=MODEL, **request).choices[0]
    assert mine.text == theirs.text and mine.logprobs.tokens == theirs.logprobs.tokens
    assert mine.logprobs.token_logprobs == pytest.approx(theirs.logprobs.token_logprobs, abs=1e-4)
    for top_mine, top_theirs in zip(mine.logprobs.top_logprobs, theirs.logprobs.top_logprobs, strict=True):
        assert top_mine.keys() == top_theirs.keys()
        assert list(top_mine.values()) == pytest.approx([top_theirs[k] for k in top_mine], abs=1e-4)
