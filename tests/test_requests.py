"""OpenAI-style request files: every field of the format, against transformers on random weights."""

from __future__ import annotations

import json

import pytest
import torch

import bloom
from generation.jobs.grouping import plan_batches
from generation.run.logprobs import TokenText
from generation.request.parse import RequestError, parse_request

P0, P1, P2 = "Hello world", "The cat sat on the mat and then", "A dog"


def hf_greedy(hf, tokenizer, prompt: str, max_tokens: int) -> tuple[list[int], str]:
    ids = tokenizer.encode(prompt)
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=2,
                          pad_token_id=3)
    new = out[0, len(ids):].tolist()
    if 2 in new:
        new = new[: new.index(2) + 1]
    return new, tokenizer.decode(new)


def hf_logprobs(hf, ids):
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


@pytest.fixture(scope="module")
def job(scoring_setup, tmp_path_factory):
    """A request file with every field and some malformed lines, answered through the CLI."""
    folder, gen, hf = scoring_setup
    _, p1_text = hf_greedy(hf, gen.tokenizer, P1, 12)
    stop = p1_text[len(p1_text) // 2 : len(p1_text) // 2 + 2]
    lines = [
        json.dumps({"prompt": P0, "max_tokens": 6, "temperature": 0, "logprobs": 3, "echo": True, "engine": "bloom"}),
        json.dumps({"prompt": [P1, P2], "max_tokens": 5, "temperature": 0.0, "n": 2, "logprobs": 0, "top_p": 1}),
        "{not json",
        json.dumps({"prompt": P1, "max_tokens": 12, "temperature": 0, "stop": [stop, "\u2603"]}),
        "",
        json.dumps({"prompt": 3}),
        json.dumps({"prompt": P2, "max_tokens": 0, "echo": True, "logprobs": 1}),
        json.dumps({"prompt": P0, "n": 2, "best_of": 1}),
        json.dumps({"prompt": P1, "max_tokens": 6, "temperature": 0, "best_of": 1, "logprobs": 2}),
    ]
    folder_out = tmp_path_factory.mktemp("requests")
    requests, results = folder_out / "in.jsonl", folder_out / "out.jsonl"
    requests.write_text("\n".join(lines) + "\n")
    code = bloom.main(["--weights", str(folder), "--requests", str(requests), "--results", str(results),
                       "--budget", "96"])
    records = [json.loads(line) for line in results.read_text().splitlines()]
    errors = [json.loads(line) for line in (folder_out / "out.jsonl.errors.jsonl").read_text().splitlines()]
    return {"code": code, "lines": lines, "records": records, "errors": errors, "stop": stop}


def record_for(job, line_number):
    request = json.loads(job["lines"][line_number - 1])
    found = [r for r in job["records"] if r["request"] == request]
    assert len(found) == 1
    return found[0]


def test_malformed_lines_are_reported_with_their_numbers_and_the_rest_carries_on(job, capsys):
    assert job["code"] == 1  # some lines failed
    assert [e["line"] for e in job["errors"]] == [3, 6, 8]
    assert "JSON" in job["errors"][0]["error"] and "prompt" in job["errors"][1]["error"]
    assert "best_of" in job["errors"][2]["error"]
    assert len(job["records"]) == 5  # every valid request answered once


def test_greedy_text_logprobs_top_logprobs_offsets_and_usage(job, scoring_setup):
    _, gen, hf = scoring_setup
    rec = record_for(job, 1)
    result = rec["result"]
    assert set(result) == {"choices", "usage", "request_time"}
    assert set(result["request_time"]) == {"batch_time", "batch_size"} and result["request_time"]["batch_size"] >= 1
    (choice,) = result["choices"]
    assert set(choice) == {"text", "index", "logprobs", "finish_reason"} and choice["index"] == 0
    new_ids, text = hf_greedy(hf, gen.tokenizer, P0, 6)
    assert choice["text"] == P0 + text  # echo
    assert choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    prompt_ids = gen.tokenizer.encode(P0)
    ids = prompt_ids + new_ids
    assert len(lp["tokens"]) == len(ids)
    assert "".join(lp["tokens"]) == choice["text"]
    for token, offset in zip(lp["tokens"], lp["text_offset"]):
        assert choice["text"][offset : offset + len(token)] == token
    ref = hf_logprobs(hf, ids)
    text_of = TokenText(gen.tokenizer)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # nothing predicts token 0
    for t in range(1, len(ids)):
        assert lp["token_logprobs"][t] == pytest.approx(ref[t - 1, ids[t]].item(), abs=1e-4)
        vals, idx = ref[t - 1].topk(3)
        expected = {text_of.label(i): v for i, v in zip(idx.tolist(), vals.tolist())}
        assert len(expected) == 3  # labels tell tokens apart
        top = lp["top_logprobs"][t]
        for key, value in expected.items():
            assert top[key] == pytest.approx(value, abs=1e-4)
        assert text_of.label(ids[t]) in top  # the chosen token is always listed
        assert len(top) <= 4
    # The CLI's prefix cache (on by default) says how many prompt tokens it served, as OpenAI does.
    assert result["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": len(new_ids),
                               "total_tokens": len(prompt_ids) + len(new_ids),
                               "prompt_tokens_details": {"cached_tokens": result["usage"]["prompt_tokens_details"]
                                                         ["cached_tokens"]}}
    assert 0 <= result["usage"]["prompt_tokens_details"]["cached_tokens"] < len(prompt_ids)


def test_prompt_list_and_n_give_prompts_times_n_choices(job, scoring_setup):
    _, gen, hf = scoring_setup
    result = record_for(job, 2)["result"]
    choices = result["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    completion = 0
    for i, prompt in enumerate([P1, P2]):
        new_ids, text = hf_greedy(hf, gen.tokenizer, prompt, 5)
        completion += 2 * len(new_ids)
        for c in choices[2 * i : 2 * i + 2]:
            assert c["text"] == text
            # logprobs 0: the chosen token's log-prob only, no alternatives.
            ref = hf_logprobs(hf, gen.tokenizer.encode(prompt) + new_ids)
            n = len(gen.tokenizer.encode(prompt))
            assert c["logprobs"]["token_logprobs"] == pytest.approx(
                [ref[n - 1 + k, t].item() for k, t in enumerate(new_ids)], abs=1e-4)
            assert all(len(top) == 1 for top in c["logprobs"]["top_logprobs"])
            assert c["logprobs"]["text_offset"][0] == 0
    assert result["usage"]["completion_tokens"] == completion
    assert result["usage"]["prompt_tokens"] == len(gen.tokenizer.encode(P1)) + len(gen.tokenizer.encode(P2))


def test_stop_ends_the_choice_without_the_stop_string(job, scoring_setup):
    _, gen, hf = scoring_setup
    (choice,) = record_for(job, 4)["result"]["choices"]
    _, text = hf_greedy(hf, gen.tokenizer, P1, 12)
    assert choice["text"] == text[: text.find(job["stop"])]
    assert choice["finish_reason"] == "stop"
    assert choice["logprobs"] is None  # not asked


def test_echo_with_zero_max_tokens_scores_the_prompt(job, scoring_setup):
    _, gen, hf = scoring_setup
    (choice,) = record_for(job, 7)["result"]["choices"]
    ids = gen.tokenizer.encode(P2)
    assert choice["text"] == P2
    ref = hf_logprobs(hf, ids)
    assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx(
        [ref[t - 1, ids[t]].item() for t in range(1, len(ids))], abs=1e-4)
    assert "".join(choice["logprobs"]["tokens"]) == P2


def test_rerun_answers_nothing_twice(job, scoring_setup, tmp_path):
    folder = scoring_setup[0]
    requests = tmp_path / "in.jsonl"
    requests.write_text("\n".join(job["lines"]) + "\n")
    results = tmp_path / "out.jsonl"
    results.write_text("".join(json.dumps(r) + "\n" for r in job["records"]))
    assert bloom.main(["--weights", str(folder), "--requests", str(requests), "--results", str(results)]) == 1
    assert len(results.read_text().splitlines()) == len(job["records"])


@pytest.mark.parametrize("line, message", [
    ('[1, 2]', "JSON object"),
    ('{"prompt": ""}', "empty"),
    ('{"prompt": []}', "prompt"),
    ('{"prompt": "x", "max_tokens": -1}', "max_tokens"),
    ('{"prompt": "x", "max_tokens": 1.5}', "max_tokens"),
    ('{"prompt": "x", "max_tokens": 0}', "echo"),
    ('{"prompt": "x", "logprobs": 6}', "logprobs"),
    ('{"prompt": "x", "temperature": -1}', "temperature"),
    ('{"prompt": "x", "top_p": 0}', "top_p"),
    ('{"prompt": "x", "echo": "yes"}', "echo"),
    ('{"prompt": "x", "stop": [""]}', "stop"),
    ('{"prompt": "x", "seed": -3}', "seed"),
    ('{"prompt": "x", "top_k": -1}', "top_k"),
    ('{"prompt": "x", "presence_penalty": 1}', "presence_penalty"),
    ('{"prompt": "x", "colour": "red"}', "colour"),
    ('{"prompt": "x", "num_beams": 2, "n": 3}', "num_beams"),
    ('{"prompt": "x", "temperature": 1' + "0" * 400 + "}", "temperature"),  # an int no float holds
    ('{"prompt": "x", "repetition_penalty": 1' + "0" * 400 + "}", "repetition_penalty"),
])
def test_bad_requests_get_a_message_naming_the_field(line, message):
    with pytest.raises(RequestError, match=message):
        parse_request(line, 1)


def test_temperature_maps_to_greedy_or_sampling():
    greedy = parse_request('{"prompt": "x", "temperature": 0, "n": 3}', 1)
    assert not greedy.sampling and greedy.n == 3 and greedy.rows_per_prompt == 1
    sampled = parse_request('{"prompt": "x", "n": 2, "best_of": 4, "top_p": 0.9, "seed": 5}', 1)  # default T=1
    o = sampled.options
    assert (o.do_sample, o.temperature, o.top_p, o.num_return_sequences, o.seed) == (True, 1.0, 0.9, 4, 5)
    assert sampled.rows_per_prompt == 4
    beams = parse_request('{"prompt": "x", "num_beams": 3, "n": 2}', 1)
    assert not beams.sampling and beams.options.num_beams == 3 and beams.rows_per_prompt == 3


def test_batches_share_options_and_stay_within_the_budget():
    lines = [
        '{"prompt": "a", "temperature": 0, "max_tokens": 8}',
        '{"prompt": "b", "temperature": 0.5, "max_tokens": 8}',
        '{"prompt": ["c", "d"], "temperature": 0, "max_tokens": 8}',
        '{"prompt": "e", "temperature": 0, "max_tokens": 8, "stop": "x", "logprobs": 2}',  # same search
        '{"prompt": "f", "temperature": 0, "max_tokens": 4}',
        '{"prompt": "g", "temperature": 0, "max_tokens": 8}',
    ]
    requests = [parse_request(text, i + 1) for i, text in enumerate(lines)]
    lengths = {r.line: [3] * len(r.prompts) for r in requests}
    budget = 3 * 32  # three rows of length 32 (3 prompt tokens + 8 new, padded to 32)
    batches = plan_batches(requests, lengths, budget)
    assert sorted(r.line for b in batches for r in b.requests) == [1, 2, 3, 4, 5, 6]
    for b in batches:
        assert len({r.group for r in b.requests}) == 1
        assert b.rows * b.length <= budget
        assert b.length % 32 == 0
    together = [sorted(r.line for r in b.requests) for b in batches]
    assert [1, 3] in together  # 3 rows: fills the budget; 4, 5 and 6 follow in the next batch
    assert [4, 5, 6] in together  # 5 wants 4 tokens, the others 8: one batch, each row its own budget
    mixed = next(b for b in batches if len(b.requests) == 3)
    assert mixed.max_tokens == 8 and mixed.options().max_new_tokens == 8 and mixed.length == 32
    # A request bigger than the budget alone still runs, in a batch of its own.
    (alone,) = plan_batches([requests[2]], lengths, 10)
    assert alone.requests == [requests[2]]


def test_batches_of_a_group_share_one_static_shape(scoring_setup, tmp_path):
    from generation.generator import Generator
    from generation.jobs.runner import run_requests

    folder = scoring_setup[0]
    gen = Generator.from_pretrained(folder, device="cpu")  # fresh: its own shape signatures
    prompts = ["a", "a b c d e", "hello", "one two three", "x y", "The cat sat on the mat", "z"]
    requests = tmp_path / "in.jsonl"
    requests.write_text("".join(json.dumps({"prompt": p, "max_tokens": 4, "temperature": 0}) + "\n" for p in prompts))
    summary = run_requests(gen, requests, tmp_path / "out.jsonl", budget=4 * 32, progress=False)
    assert summary.answered == 7
    # Batches of 4 and 3 prompts; the 3 are padded to 4 rows: one prefill and one decode shape.
    assert len(gen.backend.signatures_of("decode")) == 1
    assert len(gen.backend.signatures_of("prefill")) == 1


def test_a_request_job_with_stderr_not_a_terminal_prints_plain_progress_lines(scoring_setup, tmp_path, capsys,
                                                                            monkeypatch):
    from generation.run import progress

    monkeypatch.setattr(progress, "LINE_EVERY", 0.0)  # a line after every batch instead of every 30 s
    folder = scoring_setup[0]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"prompt": p, "max_tokens": 3, "temperature": 0}) + "\n"
                                               for p in (P0, P1, P2)))
    argv = ["--weights", str(folder), "--requests", str(tmp_path / "in.jsonl"), "--budget", "32"]
    assert bloom.main(argv + ["--results", str(tmp_path / "out.jsonl")]) == 0
    err = capsys.readouterr().err  # pytest's stderr is not a terminal
    assert "\r" not in err
    lines = [line for line in err.splitlines() if line.startswith("requests: ")]
    assert [line.split()[1] for line in lines] == ["1/3", "2/3", "3/3"]  # one request per batch
    assert "requests/s" in lines[-1] and "tokens/s" in lines[-1]
    # --quiet: no progress at all.
    assert bloom.main(argv + ["--results", str(tmp_path / "again.jsonl"), "--quiet"]) == 0
    assert "requests: " not in capsys.readouterr().err


def test_best_of_keeps_the_n_samples_with_the_highest_logprob_per_token(scoring_setup, tmp_path):
    from generation.jobs.runner import run_requests

    _, gen, hf = scoring_setup
    request = {"prompt": P0, "max_tokens": 6, "temperature": 1.5, "n": 2, "best_of": 4, "seed": 3}
    (tmp_path / "in.jsonl").write_text(json.dumps(request) + "\n")
    run_requests(gen, tmp_path / "in.jsonl", tmp_path / "out.jsonl", progress=False)
    choices = json.loads((tmp_path / "out.jsonl").read_text())["result"]["choices"]
    # The same 4 candidates (sampling is seeded per prompt), ranked with transformers' log-probs.
    candidates = gen.generate(P0, max_new_tokens=6, max_length=32, do_sample=True, temperature=1.5, seed=3,
                              num_return_sequences=4, ignore_eos=False)[0].sequences
    assert len({c.text for c in candidates}) > 2
    prompt_ids = gen.tokenizer.encode(P0)

    def mean_logprob(seq):
        ref = hf_logprobs(hf, prompt_ids + seq.token_ids)
        n = len(prompt_ids)
        return sum(ref[n - 1 + k, t].item() for k, t in enumerate(seq.token_ids)) / len(seq.token_ids)

    best = sorted(candidates, key=mean_logprob, reverse=True)[:2]
    assert [c["text"] for c in choices] == [s.text for s in best]


def test_line_numbers_and_resume_survive_unicode_line_separators(scoring_setup, tmp_path):
    from generation.jobs.runner import run_requests

    _, gen, _ = scoring_setup
    prompt = "one\u2028two\x85three"  # raw in the file: JSON allows them, str.splitlines splits on them
    (tmp_path / "in.jsonl").write_text(
        json.dumps({"prompt": prompt, "max_tokens": 3, "temperature": 0}, ensure_ascii=False) + "\n{oops\n",
        encoding="utf-8")
    first = run_requests(gen, tmp_path / "in.jsonl", tmp_path / "out.jsonl", progress=False)
    errors = [json.loads(line) for line in (tmp_path / "out.jsonl.errors.jsonl").read_text().split("\n") if line]
    assert (first.answered, [e["line"] for e in errors]) == (1, [2])
    again = run_requests(gen, tmp_path / "in.jsonl", tmp_path / "out.jsonl", progress=False)
    assert (again.skipped, again.answered) == (1, 0)


def test_requests_of_different_lengths_share_a_batch_and_stop_at_their_own(scoring_setup, tmp_path):
    from generation.jobs.runner import run_requests

    _, gen, hf = scoring_setup
    wanted = {P0: 3, P1: 9, P2: 5}
    requests = tmp_path / "in.jsonl"
    requests.write_text("".join(json.dumps({"prompt": p, "max_tokens": n, "temperature": 0}) + "\n"
                                for p, n in wanted.items()))
    summary = run_requests(gen, requests, tmp_path / "out.jsonl", budget=4096, progress=False)
    assert summary.answered == 3
    for line in (tmp_path / "out.jsonl").read_text().splitlines():
        record = json.loads(line)
        prompt, result = record["request"]["prompt"], record["result"]
        assert result["request_time"]["batch_size"] == 3  # all three in one generate call
        new_ids, text = hf_greedy(hf, gen.tokenizer, prompt, wanted[prompt])
        (choice,) = result["choices"]
        assert choice["text"] == text
        assert result["usage"]["completion_tokens"] == len(new_ids) <= wanted[prompt]
        assert choice["finish_reason"] == ("stop" if 2 in new_ids else "length")


def test_a_budget_per_prompt_must_fit_the_prompts(scoring_setup):
    from generation.run.batch import InputError

    _, gen, _ = scoring_setup
    with pytest.raises(InputError, match="one budget of at least 1 per prompt"):
        gen.generate([P0, P1], max_new_tokens_each=[3])
    with pytest.raises(InputError, match="one budget of at least 1 per prompt"):
        gen.generate([P0], max_new_tokens_each=[0])


def test_requests_with_different_seeds_share_a_batch_and_sample_as_alone(scoring_setup, tmp_path):
    """Seeds do not split a group: the requests run as one generate call, and each samples what
    Generator.generate samples for its prompt alone with its seed (a seedless one: whatever it
    draws, but it runs in the same batch)."""
    from generation.jobs.runner import run_requests

    _, gen, _ = scoring_setup
    bodies = [{"prompt": P0, "max_tokens": 8, "temperature": 1.3, "seed": 1},
              {"prompt": P1, "max_tokens": 8, "temperature": 1.3, "seed": 2},
              {"prompt": P0, "max_tokens": 8, "temperature": 1.3, "seed": 2},  # the same prompt, another seed
              {"prompt": P2, "max_tokens": 8, "temperature": 1.3, "seed": 1},
              {"prompt": P2, "max_tokens": 8, "temperature": 1.3}]
    requests = tmp_path / "in.jsonl"
    requests.write_text("".join(json.dumps(b) + "\n" for b in bodies))
    assert run_requests(gen, requests, tmp_path / "out.jsonl", budget=4096, progress=False).answered == 5
    records = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert {r["result"]["request_time"]["batch_size"] for r in records} == {5}  # one generate call
    for record in records:
        body = record["request"]
        if "seed" not in body:
            continue
        alone = gen.generate(body["prompt"], max_new_tokens=8, max_length=64, do_sample=True, temperature=1.3,
                             seed=body["seed"], ignore_eos=False)[0]
        assert [c["text"] for c in record["result"]["choices"]] == [s.text for s in alone.sequences]


def test_seed_each_is_checked_and_seeds_each_prompt(scoring_setup):
    from generation.run.batch import InputError

    _, gen, _ = scoring_setup
    options = dict(max_new_tokens=6, do_sample=True, temperature=1.5)
    both = gen.generate([P0, P0], seed_each=[4, 9], **options)
    assert [r.token_ids for r in both] == [gen.generate(P0, seed=s, **options)[0].token_ids for s in (4, 9)]
    # None takes the options' seed.
    assert gen.generate([P0, P1], seed_each=[None, 9], seed=4, **options)[0].token_ids == both[0].token_ids
    with pytest.raises(InputError, match="one seed .* per prompt"):
        gen.generate([P0, P1], seed_each=[1], **options)
    with pytest.raises(InputError, match="each seed must be >= 0"):
        gen.generate([P0], seed_each=[-1], **options)
    with pytest.raises(TypeError, match="seed_each must be a list"):
        gen.generate([P0], seed_each=["1"], **options)
