"""Structured output on the graph stand-in (tests/graph_stand_in), as HPU (lazy mode) and as CUDA:
constrained rows beside unconstrained ones replay the captured steps, give the eager CPU's tokens,
and a second identical load captures no graph and (HPU) compiles no lazy graph: a grammar is data
(a mask in the token choice), not a shape."""

from __future__ import annotations

from generation.request.grammar import grammar_from_fields
from test_graph_truth import PROMPTS, Counts, checkpoint, eager, new_lazy_graphs, on_card, reference, sequences  # noqa: F401
from test_structured import BOUNDED, REGEXES

GRAMMARS = [None, grammar_from_fields(guided_json=BOUNDED[0]), None, grammar_from_fields(guided_regex=REGEXES[0])]


def test_generate_with_constrained_rows_equals_the_eager_run(graph_stand_in, checkpoint, eager):
    generator = on_card(graph_stand_in, checkpoint)
    for search in ({}, {"do_sample": True, "seed": 3, "top_k": 20}):
        options = dict(max_length=48, bucket_width=16, ignore_eos=False, max_new_tokens=20, grammar_each=GRAMMARS,
                       **search)
        want = reference(graph_stand_in, eager, PROMPTS, **options)
        # The first call captures its steps (lazy graphs around a capture differ from those around
        # a replay); the second replays them; a third adds nothing.
        for _ in range(2):
            assert sequences(generator.generate(PROMPTS, **options)) == want
        counts = Counts(graph_stand_in)
        assert sequences(generator.generate(PROMPTS, **options)) == want
        assert counts.unchanged(), new_lazy_graphs(graph_stand_in, counts)


def test_engine_with_constrained_rows_equals_the_eager_engine(graph_stand_in, checkpoint, eager):
    from generation.serving.engine import Engine, EngineConfig
    from generation.serving.params import SamplingParams

    config = EngineConfig(max_batch=8, max_length=48, bucket_width=16, max_prefill=2)
    params = [SamplingParams(max_tokens=12, grammar=g) if i < 4 else
              SamplingParams(max_tokens=12, temperature=0.8, seed=i, grammar=g, n=2)
              for i, g in enumerate(GRAMMARS * 2)]
    prompts = PROMPTS * 2

    def answers(generator, engine=None) -> tuple[list, Engine]:
        if engine is None:
            engine = Engine(generator, config)
            engine.warm_up()
        handles = [engine.submit(engine.tokenizer.encode(p), s) for p, s in zip(prompts, params)]
        while engine.step() or engine.queue_length:
            pass
        return [[s.token_ids for s in h.result(1)] for h in handles], engine

    card = on_card(graph_stand_in, checkpoint)
    with graph_stand_in.off_card():
        want, _ = answers(eager)
    got, engine = answers(card)
    assert got == want
    counts = Counts(graph_stand_in)
    again, _ = answers(card, engine)
    assert again == want
    assert counts.unchanged(), new_lazy_graphs(graph_stand_in, counts)
