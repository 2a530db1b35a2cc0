"""A draft model's guesses in the server (``--serve --speculate draft[:K] --draft_model DIR``,
generation/serving/drafting.py): greedy answers equal the server's without speculation and
transformers' ``generate``, through the official openai client against a real server, with
concurrent clients of several prompt lengths, rows joining mid-flight, prefix-cache hits,
``max_tokens`` and stop strings.

A draft's mistakes never change a greedy answer (the target verifies every guess), so what the
draft's own state does (its cache in the engine's slots, the catch-up, the roll-back, a slot
reused by a new row) is checked through acceptance: the target as its own draft must have every
guess it offers accepted, whatever joins, leaves, moves or sits passes out. A perturbed copy of
the target (accepts often, not always) runs both acceptance and rejection; other random weights
(acceptance near 0) take the rows' budgets down to 0 and back.
"""

from __future__ import annotations

import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from generation import Generator
from generation.search.guesses import parse_speculation
from test_speculation_draft import perturbed
from test_speculation_serving import JOINING_PARAMS, MODEL, PROMPTS, REQUESTS, joining_answers, metric, same, \
    transformers_text

CONFIG = dict(max_batch=4, max_length=96, bucket_width=16, prefill_chunk=16, metrics=True)


@pytest.fixture(scope="module")
def verify_every_batch():
    """Verify passes for every batch bucket here (on the CPU a bucket x (K + 1) past 16 steps aside)."""
    from generation.search import guesses

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(guesses, "CPU_VERIFY_ROWS", 1 << 20)
        yield


@pytest.fixture(scope="module")
def near_draft(seed7_checkpoint, tmp_path_factory):
    return perturbed(seed7_checkpoint, tmp_path_factory.mktemp("near") / "perturbed")


@pytest.fixture(scope="module")
def drafting(serve, seed7_checkpoint, near_draft, verify_every_batch):
    generator = Generator.from_pretrained(seed7_checkpoint, device="cpu", speculate="draft:4", draft_model=near_draft)
    with serve(generator, MODEL, speculation=parse_speculation("draft:4"), **CONFIG) as running:
        yield running


@pytest.fixture(scope="module")
def itself(serve, seed7_checkpoint, verify_every_batch):
    """The target as its own draft, with a prefix cache: every guess must be accepted."""
    generator = Generator.from_pretrained(seed7_checkpoint, device="cpu", speculate="draft:4",
                                          draft_model=seed7_checkpoint, prefix_cache="16MB")
    with serve(generator, MODEL, speculation=parse_speculation("draft:4"), **CONFIG) as running:
        yield running


@pytest.fixture(scope="module")
def plain(serve, seed7_checkpoint):
    with serve(Generator.from_pretrained(seed7_checkpoint, device="cpu"), MODEL, **CONFIG) as running:
        yield running


def counters(running) -> dict:
    return {name: metric(running, f"bloom_speculation_{name}_total")
            for name in ("verify_passes", "guesses_offered", "guesses_accepted")}


def grown(running, before: dict) -> dict:
    after = counters(running)
    return {name: after[name] - before[name] for name in after}


def ask(running, request: dict) -> list:
    body = dict(request)
    extra = {k: body.pop(k) for k in ("repetition_penalty", "guided_regex") if k in body}
    r = running.client().completions.create(model=MODEL, temperature=0, extra_body=extra or None, **body)
    return [(c.text, c.finish_reason, c.logprobs and c.logprobs.token_logprobs) for c in r.choices]


def staggered(running, requests: list[dict], delays: list[float]) -> list:
    """The requests at once from their own clients, each sent ``delays[i]`` seconds late (so
    that some join rows already running)."""
    def one(pair):
        request, delay = pair
        time.sleep(delay)
        return ask(running, request)

    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(one, zip(requests, delays)))


def test_greedy_completions_equal_plain_serving_and_transformers(drafting, plain, seed7_reference):
    before = counters(drafting)
    for prompt in PROMPTS:
        got = drafting.client().completions.create(model=MODEL, prompt=prompt, max_tokens=40,
                                                   temperature=0).choices[0].text
        assert got == plain.client().completions.create(model=MODEL, prompt=prompt, max_tokens=40,
                                                        temperature=0).choices[0].text
        assert got == transformers_text(seed7_reference, drafting.generator.tokenizer, prompt, 40)
    seen = grown(drafting, before)
    assert seen["verify_passes"] > 0
    assert 0 < seen["guesses_accepted"] < seen["guesses_offered"]  # guesses kept and guesses rejected


def test_beams_beside_a_draft_run_without_speculation(drafting, plain):
    """A request the batch runner's path answers (beam search) on a server whose generator was
    loaded with its draft: answered, as the plain server answers it."""
    def beams(running):
        return running.client().completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=8, best_of=2,
                                                   extra_body={"use_beam_search": True}).choices[0].text

    assert beams(drafting) == beams(plain)


# Prompts of 3 to 40 tokens, budgets, a stop string, penalties, greedy n = 2, rows that do not
# guess (a grammar) and log-probs; the later ones sent while the first run.
LONG = " ".join([PROMPTS[1], PROMPTS[0], PROMPTS[3]])
MIXED = REQUESTS + [dict(prompt=LONG, max_tokens=30), dict(prompt="Hi", max_tokens=50, stop=["\n\n"])]
DELAYS = [0, 0, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6]
# Without penalties (a penalised row's choice is not the raw argmax that a draft proposes).
UNPENALISED = [r for r in MIXED if not {"repetition_penalty", "presence_penalty", "frequency_penalty"} & set(r)]


def test_concurrent_clients_joining_mid_flight_equal_plain_serving(drafting, plain):
    want = [ask(plain, r) for r in MIXED]  # each alone
    chunked = drafting.engine.stats["prompts_chunked"]
    before = counters(drafting)
    same(staggered(drafting, MIXED, DELAYS), want)
    same(staggered(drafting, MIXED[::-1], DELAYS), want[::-1])
    assert drafting.engine.stats["prompts_chunked"] > chunked  # some joined rows already running
    assert grown(drafting, before)["guesses_accepted"] > 0


def test_the_target_as_its_own_draft_accepts_every_guess(itself, plain):
    """Acceptance 1 over concurrent clients, joins mid-flight, slots given back and taken again,
    rows moved by compaction and a prefix-cache hit (the draft has no pool: it feeds the prompt
    itself); more than one token a verify pass; and the answers are plain serving's."""
    want = [ask(plain, r) for r in UNPENALISED]
    before = counters(itself)
    for order in (slice(None), slice(None, None, -1)):
        same(staggered(itself, UNPENALISED[order], DELAYS), want[order])
    # A prompt the pool holds (the long one again, then longer), alone and while a row runs.
    hits = itself.generator.runner.prefix.stats.hits
    again = [dict(prompt=LONG, max_tokens=30), dict(prompt=LONG + " one two", max_tokens=20)]
    same(staggered(itself, again, [0, 0.1]), [ask(plain, r) for r in again])
    assert itself.generator.runner.prefix.stats.hits > hits
    seen = grown(itself, before)
    assert seen["guesses_offered"] > 50 and seen["guesses_accepted"] == seen["guesses_offered"]
    assert (seen["verify_passes"] + seen["guesses_accepted"]) / seen["verify_passes"] > 2  # tokens a verify


def test_a_random_draft_gives_the_same_answers_at_low_acceptance(serve, seed7_checkpoint, make_ckpt, plain,
                                                                verify_every_batch):
    other = make_ckpt(hidden_size=32, n_layer=1, n_head=2, seed=99)
    generator = Generator.from_pretrained(seed7_checkpoint, device="cpu", speculate="draft:4", draft_model=other)
    with serve(generator, MODEL, speculation=parse_speculation("draft:4"), **CONFIG) as running:
        requests = [dict(prompt=p, max_tokens=60) for p in PROMPTS]
        same(staggered(running, requests, [0, 0.05, 0.1, 0.2]), [ask(plain, r) for r in requests])
        seen = counters(running)
    assert seen["guesses_offered"] > 0 and seen["guesses_accepted"] < 0.3 * seen["guesses_offered"]


# --- the engine, step by step ----------------------------------------------------------------------


def engine_answers(generator, speculate, script, config=None):
    """Run ``script`` on an Engine: a list of (steps to run first, prompt, SamplingParams); returns
    each request's token ids and the engine's stats."""
    from generation.serving.engine import Engine, EngineConfig

    engine = Engine(generator, EngineConfig(**(config or dict(max_batch=4, max_length=96, bucket_width=16,
                                                              prefill_chunk=16)),
                                            speculation=parse_speculation(speculate)))
    handles = []
    for steps, prompt, params in script:
        for _ in range(steps):
            engine.step()
        handles.append(engine.submit(engine.tokenizer.encode(prompt), params))
    while engine.step() or engine.queue_length:
        pass
    return [[s.token_ids for s in h.result(1)] for h in handles], engine.stats


@pytest.fixture(scope="module")
def self_drafted(seed7_checkpoint):
    return Generator.from_pretrained(seed7_checkpoint, device="cpu", speculate="draft:4", draft_model=seed7_checkpoint,
                                     prefix_cache="16MB")


def test_rows_join_leave_and_reuse_slots_with_every_guess_accepted(self_drafted, verify_every_batch):
    """Rows joining in segments (prompts of 40 tokens: longer than one step's catch-up of 16),
    finishing at their budgets and at a stop string, new rows taking their slots (and the prefix
    cache's blocks): the same tokens as without speculation, every guess accepted."""
    from generation.serving.params import SamplingParams

    script = [(0, PROMPTS[1], SamplingParams(max_tokens=50)),
              (3, LONG, SamplingParams(max_tokens=12)),
              (2, PROMPTS[2], SamplingParams(max_tokens=5)),
              (1, PROMPTS[0], SamplingParams(max_tokens=30, stop=[" four one"])),
              (6, LONG, SamplingParams(max_tokens=20)),  # a prefix-cache hit, in a slot given back
              (2, PROMPTS[3], SamplingParams(max_tokens=25, n=2)),
              (4, PROMPTS[2] + " " + LONG, SamplingParams(max_tokens=15))]
    got, stats = engine_answers(self_drafted, "draft:4", script)
    want, _ = engine_answers(self_drafted, None, script)
    assert got == want
    assert stats["prompts_chunked"] >= 4 and stats["joined_after_a_hit"] > 0 and stats["row_moves"] > 0
    assert stats["guesses_offered"] > 50 and stats["guesses_accepted"] == stats["guesses_offered"], stats


def test_a_row_moved_to_a_lower_slot_takes_its_draft_row_along(self_drafted, verify_every_batch):
    """Two rows prefilled together, the first ending early: the second, still guessing, moves to
    slot 0 (and the batch bucket shrinks) with its draft row, every guess still accepted."""
    from generation.serving.params import SamplingParams

    script = [(0, PROMPTS[2], SamplingParams(max_tokens=4)), (0, PROMPTS[1], SamplingParams(max_tokens=50))]
    config = dict(max_batch=2, max_length=96, bucket_width=16, prefill_chunk=16)
    got, stats = engine_answers(self_drafted, "draft:4", script, config)
    assert got == engine_answers(self_drafted, None, script, config)[0]
    assert stats["prefills"] == 1 and stats["row_moves"] == 1 and stats["bucket_changes"] == 1, stats
    assert stats["guesses_accepted"] == stats["guesses_offered"] > 20, stats


def test_a_large_batch_steps_aside_and_the_draft_catches_up_after(self_drafted, monkeypatch):
    """On the CPU four greedy rows at k = 4 decode without guesses (the draft sits those steps
    out); as rows finish the batch bucket shrinks, the rest verify again, and the draft catches
    up on everything it missed (many tokens, in segments): every guess accepted, the same tokens."""
    from generation.search import guesses
    from generation.serving.params import SamplingParams

    monkeypatch.setattr(guesses, "CPU_VERIFY_ROWS", 16)  # the CPU's rule (another test here lifts it for its module)
    script = [(0, p, SamplingParams(max_tokens=n)) for p, n in zip(PROMPTS, (60, 6, 8, 10))]
    config = dict(max_batch=4, max_length=96, bucket_width=16, prefill_chunk=16, burst_wait_ms=0)
    got, stats = engine_answers(self_drafted, "draft:4", script, config)
    want, _ = engine_answers(self_drafted, None, script, config)
    assert got == want
    assert stats["decodes_stepped_aside"] > 0 and stats["verify_passes"] > 0
    assert stats["guesses_accepted"] == stats["guesses_offered"] > 20, stats


def test_an_engine_without_the_draft_loaded_is_refused(seed7_checkpoint):
    from generation.serving.engine import Engine, EngineConfig

    with pytest.raises(ValueError, match="needs the generator loaded with its draft model"):
        Engine(Generator.from_pretrained(seed7_checkpoint, device="cpu"),
               EngineConfig(speculation=parse_speculation("draft:4")))


# --- the command line ------------------------------------------------------------------------------


@pytest.mark.slow
def test_cli_serves_with_a_draft(tiny_checkpoint, tmp_path):
    """``./bloom.py --serve --speculate draft:3 --draft_model DIR``: the warm-up line names the
    draft's shapes, greedy answers equal the server's without speculation, and /metrics counts the
    draft's accepted guesses; ``draft`` without ``--draft_model`` is still refused in one line."""
    from test_serving_tp import launch, stop
    from utils.first_layers import first_layers

    draft = first_layers(tiny_checkpoint, tmp_path / "draft", 2)
    serve = ["--serve", "--max_batch", "2", "--max_length", "64", "--bucket_width", "32", "--max_prefill", "2"]
    prompts = ["In the beginning God created the heaven and the earth", "And God said", "And it was so"]
    texts = {}
    for name, flags in (("plain", []), ("draft", ["--speculate", "draft:3", "--draft_model", str(draft)])):
        proc, port = launch(tiny_checkpoint, serve + flags, 1, tmp_path / f"{name}.log")
        try:
            client = __import__("openai").OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                                                 max_retries=0, timeout=120)
            with ThreadPoolExecutor(len(prompts)) as pool:
                texts[name] = list(pool.map(lambda p: client.completions.create(
                    model=tiny_checkpoint.name, prompt=p, max_tokens=24, temperature=0).choices[0].text, prompts))
            if name == "draft":
                offered = metric(type("Running", (), {"port": port}), "bloom_speculation_guesses_offered_total")
        finally:
            stop(proc)
    assert texts["draft"] == texts["plain"]
    assert offered > 0
    assert " draft) in " in (tmp_path / "draft.log").read_text()
    proc = subprocess.run([sys.executable, "bloom.py", "--serve", "--speculate", "draft"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "--speculate draft needs --draft_model DIR" in proc.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_two_ranks_serve_with_a_draft_as_one_process(seed7_checkpoint, tmp_path):
    """``--serve --speculate draft:4 --draft_model DIR`` on 2 ranks: the follower makes every draft
    step too (``draft_step``, each rank its slice of the draft); greedy answers equal one process's
    without speculation, and its guesses were accepted."""
    from test_speculation_serving import TP_REQUESTS, launched_answers

    draft = perturbed(seed7_checkpoint, tmp_path / "draft")
    answers_of, accepted = launched_answers(
        seed7_checkpoint, (("plain", [], 1), ("two", ["--speculate", "draft:4", "--draft_model", str(draft)], 2)),
        TP_REQUESTS[:3], tmp_path)
    log = (tmp_path / "two.log").read_text()
    assert "num_local_procs=2" in log and " draft) in " in log
    assert answers_of["two"] == answers_of["plain"]
    assert accepted > 0


# --- on the graph stand-in (tests/graph_stand_in) ------------------------------------------------


@pytest.mark.slow
def test_drafting_engine_on_the_stand_in_equals_the_eager_engine_and_adds_no_graph(graph_stand_in, make_ckpt,
                                                                                  tmp_path, verify_every_batch):
    """The engine with a draft on the stand-in (HPU and CUDA personalities): the draft's catch-up
    and guess steps, and the target's verify passes (with joining prompts' segments in them),
    replay graphs captured at warm-up; a second load captures nothing and, on the HPU, compiles no
    lazy graph; greedy rows give the eager engine's tokens without speculation."""
    from test_graph_truth import Counts, new_lazy_graphs, on_card

    checkpoint = make_ckpt(hidden_size=64, n_layer=2, n_head=4, seed=7)
    draft = perturbed(checkpoint, tmp_path / "draft")  # accepts and rejects: both catch-ups
    prompts = PROMPTS + [LONG]
    card = on_card(graph_stand_in, checkpoint, speculate="draft:4", draft_model=draft)
    with graph_stand_in.off_card():
        eager = Generator.from_pretrained(checkpoint, device="cpu")
        plain, _ = joining_answers(eager, None, prompts)
        drafting = Generator.from_pretrained(checkpoint, device="cpu", speculate="draft:4", draft_model=draft)
        sampled, _ = joining_answers(drafting, "draft:4", prompts)
    got, engine = joining_answers(card, "draft:4", prompts)
    want = [s if p.sampling else t for t, s, p in zip(plain, sampled, JOINING_PARAMS)]
    assert got == want
    assert engine.stats["verify_passes"] > 0 and engine.stats["guesses_accepted"] > 0, engine.stats
    assert engine.stats["guesses_accepted"] < engine.stats["guesses_offered"]
    assert card.draft.runner.backend.signatures_of("mixed") and card.draft.runner.backend.signatures_of("decode")
    counts = Counts(graph_stand_in)
    again, _ = joining_answers(card, "draft:4", prompts, engine)
    assert again == want
    assert counts.unchanged(), new_lazy_graphs(graph_stand_in, counts)
