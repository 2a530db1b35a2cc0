"""The server through real HTTP on a loopback port: the official ``openai`` client (completions,
chat, streaming, n, logprobs, stop, errors as its exception classes), exactness under a concurrent
load, cancellation by closing streams, and a fuzz of bad bodies."""

from __future__ import annotations

import http.client
import json
import random
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import uvicorn

from generation.serving.app import make_app
from generation.serving.engine import Engine, EngineConfig
from servers import free_port, tiny_server

MAX_LENGTH, WIDTH, KEY = 128, 32, "test-key"
WORDS = "the of and a to in is was it for on with as his that by at from her he said".split()


@pytest.fixture(scope="module")
def server():
    with tiny_server(KEY, MAX_LENGTH, WIDTH) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server[2]}/v1", api_key=KEY, max_retries=0, timeout=60)


def raw(port: int, method: str, path: str, body: bytes | None = None, key: str = KEY):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    conn.request(method, path, body=body, headers=headers)
    response = conn.getresponse()
    data = response.read()
    conn.close()
    return response.status, data


def alone(generator, prompt, max_tokens, stop=None, **sampling):
    return generator.generate([prompt], max_length=MAX_LENGTH, max_new_tokens=max_tokens, ignore_eos=False,
                              bucket_width=WIDTH, stop=stop, **sampling)[0]


def test_completion_logprobs_stop_n(server, client):
    generator = server[0]
    r = client.completions.create(model="bloom-tiny", prompt=["the cat", "a dog and"], max_tokens=12, temperature=0,
                                  logprobs=2, n=2, stop=[" the"])
    assert len(r.choices) == 4 and [c.index for c in r.choices] == [0, 1, 2, 3]
    for c, prompt in zip(r.choices, ["the cat", "the cat", "a dog and", "a dog and"]):
        ref = alone(generator, prompt, 12, stop=[" the"])
        assert c.text == ref.text and c.finish_reason == {"eos": "stop"}.get(ref.finish_reason, ref.finish_reason)
        assert "".join(c.logprobs.tokens) == c.text and len(c.logprobs.token_logprobs) == len(ref.token_ids)
        assert all(len(top) >= 2 for top in c.logprobs.top_logprobs)
    assert r.usage.completion_tokens == sum(len(alone(generator, p, 12, stop=[" the"]).token_ids) * 2
                                            for p in ["the cat", "a dog and"])
    echoed = client.completions.create(model="bloom-tiny", prompt="the cat", max_tokens=3, temperature=0, echo=True)
    assert echoed.choices[0].text.startswith("the cat")
    assert [m.id for m in client.models.list().data] == ["bloom-tiny"]


def test_offline_path_scoring_and_beams(client):
    scored = client.completions.create(model="bloom-tiny", prompt="the cat sat", max_tokens=0, echo=True, logprobs=1)
    lp = scored.choices[0].logprobs
    assert scored.choices[0].text == "the cat sat" and lp.token_logprobs[0] is None and len(lp.tokens) >= 3
    beams = client.completions.create(model="bloom-tiny", prompt="the cat", max_tokens=5, temperature=0,
                                      extra_body={"num_beams": 3}, n=2)
    assert len(beams.choices) == 2


def test_stream_joins_to_the_whole_answer(client):
    whole = client.completions.create(model="bloom-tiny", prompt="it was the", max_tokens=20, temperature=0.9, seed=3,
                                      stop=["and"])
    chunks = list(client.completions.create(model="bloom-tiny", prompt="it was the", max_tokens=20, temperature=0.9,
                                            seed=3, stop=["and"], stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    # Log-probs stream too: their tokens and offsets add up to the whole answer's.
    whole = client.completions.create(model="bloom-tiny", prompt="it was the", max_tokens=20, temperature=0,
                                      logprobs=1, stop=["and"])
    parts = [c.choices[0].logprobs for c in client.completions.create(
        model="bloom-tiny", prompt="it was the", max_tokens=20, temperature=0, logprobs=1, stop=["and"], stream=True)
        if c.choices and c.choices[0].logprobs]
    assert [t for p in parts for t in p.tokens] == whole.choices[0].logprobs.tokens
    assert [o for p in parts for o in p.text_offset] == whole.choices[0].logprobs.text_offset
    assert [v for p in parts for v in p.token_logprobs] == whole.choices[0].logprobs.token_logprobs


def test_chat(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, who are you?"}]
    r = client.chat.completions.create(model="bloom-tiny", messages=messages, max_tokens=10, temperature=0)
    assert r.choices[0].message.role == "assistant" and "\nUser:" not in r.choices[0].message.content
    chunks = list(client.chat.completions.create(model="bloom-tiny", messages=messages, max_tokens=10, temperature=0,
                                                 stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == r.choices[0].message.content
    lp = client.chat.completions.create(model="bloom-tiny", messages=messages, max_tokens=4, temperature=0,
                                       logprobs=True, top_logprobs=2)
    assert all(len(t.top_logprobs) == 2 for t in lp.choices[0].logprobs.content)


def test_errors_as_client_exceptions(server, client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="bloom-tiny", prompt="hi", max_tokens=-1)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="bloom-tiny", prompt="hi " * 200, max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="bloom-tiny", prompt="hi", temperature="hot")
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="hi")
    bad_key = openai.OpenAI(base_url=str(client.base_url), api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.completions.create(model="bloom-tiny", prompt="hi")
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model="bloom-tiny", messages=[{"role": "robot", "content": "x"}])
    assert error.value.body["type"] == "invalid_request_error" if isinstance(error.value.body, dict) else True


def test_concurrent_load_is_exact(server, client):
    """32 requests at once, mixed lengths, options and arrival times: greedy ones equal
    Generator.generate alone, seeded samples equal themselves alone; no new step shapes."""
    generator, engine, _ = server
    rng = random.Random(1)
    cases = []
    for i in range(32):
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 60)))
        sampling = {} if i % 2 == 0 else {"temperature": rng.choice([0.5, 1.0]), "top_p": rng.choice([1.0, 0.9]),
                                          "seed": i}
        top_k = rng.choice([0, 10]) if sampling else 0
        cases.append((prompt, rng.randint(1, 40), sampling, top_k, rng.random() * 0.3))
    warm = set(generator.backend.signatures)

    def ask(case):
        prompt, max_tokens, sampling, top_k, delay = case
        time.sleep(delay)
        extra = {"top_k": top_k} if top_k else None
        r = client.completions.create(model="bloom-tiny", prompt=prompt, max_tokens=max_tokens,
                                      temperature=sampling.get("temperature", 0), top_p=sampling.get("top_p", 1.0),
                                      seed=sampling.get("seed"), logprobs=0, extra_body=extra)
        return r.choices[0]

    with ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(ask, cases))
    assert generator.backend.signatures == warm  # before the references add their own shapes
    for (prompt, max_tokens, sampling, top_k, _), answer in zip(cases, answers):
        extra = dict(do_sample=True, temperature=sampling["temperature"], top_p=sampling["top_p"], seed=sampling["seed"],
                     top_k=top_k) if sampling else {}
        ref = alone(generator, prompt, max_tokens, **extra)
        assert answer.text == ref.text, (prompt, sampling)
        assert len(answer.logprobs.tokens) == len(ref.token_ids)
    metrics = raw(server[2], "GET", "/metrics")[1].decode()
    assert "bloom_time_to_first_token_seconds_count" in metrics and "bloom_running_rows 0.0" in metrics


def test_closed_streams_free_their_rows(server):
    generator, engine, port = server
    before = engine.tokens_total
    conns = []
    for i in range(4):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        body = json.dumps({"prompt": f"the {i}", "max_tokens": 120, "temperature": 0, "stream": True})
        conn.request("POST", "/v1/completions", body=body, headers={"Authorization": f"Bearer {KEY}"})
        response = conn.getresponse()
        assert response.status == 200
        response.fp.readline()  # the first chunk
        conns.append(conn)
    for conn in conns:
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
    for _ in range(200):
        if engine.running_rows == 0:
            break
        time.sleep(0.02)
    assert engine.running_rows == 0 and engine.queue_length == 0
    assert engine.tokens_total - before < 4 * 120  # they were cut short


BAD_BODIES = [
    b"", b"{", b"[]", b"null", b"42", b'"prompt"', b"\xff\xfe", b'{"prompt": NaN}', b'{"prompt": "hi", "max_tokens": 1e400}',
    b'{"prompt": 5}', b'{"prompt": []}', b'{"prompt": [1, "a"]}', b'{"prompt": [[]]}', b'{"prompt": [-1]}', b'{"prompt": ""}', b'{"prompt": "hi", "n": 0}',
    b'{"prompt": "hi", "n": 100, "temperature": 1}', b'{"prompt": "hi", "logprobs": 99}',
    b'{"prompt": "hi", "temperature": -1}', b'{"prompt": "hi", "top_p": 0}', b'{"prompt": "hi", "top_p": "x"}',
    b'{"prompt": "hi", "stop": [1]}', b'{"prompt": "hi", "stop": [""]}', b'{"prompt": "hi", "best_of": 1, "n": 2}',
    b'{"prompt": "hi", "stream": "yes"}', b'{"prompt": "hi", "stream_options": 3}', b'{"prompt": "hi", "wat": 1}',
    b'{"prompt": "hi", "presence_penalty": 9}', b'{"prompt": "hi", "frequency_penalty": "a"}',
    b'{"prompt": "hi", "seed": -3}', b'{"prompt": "hi", "echo": "true"}', b'{"prompt": "hi", "max_tokens": 0}',
    b'{"prompt": "hi", "top_k": -2}', b'{"prompt": "hi", "repetition_penalty": 0}', b'{"prompt": "hi", "model": 7}',
    b'{"prompt": "hi", "logit_bias": {"1": 5}}', b'{"prompt": {"a": 1}}', b"[" * 5000 + b"]" * 5000,
]
BAD_CHATS = [b'{"messages": []}', b'{"messages": "hi"}', b'{"messages": [{"role": "user"}]}',
             b'{"messages": [{"role": "user", "content": 3}]}', b'{"messages": [{"role": "user", "content": "x"}], "n": "2"}',
             b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}', b'{"prompt": "hi"}']


def test_fuzz_of_bad_bodies(server):
    port = server[2]
    rng = random.Random(2)
    good = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    mutated = [good[:i] + bytes([rng.randrange(256)]) + good[i + 1:] for i in rng.sample(range(len(good)), 12)]
    cases = [("/v1/completions", b) for b in BAD_BODIES + mutated] + [("/v1/chat/completions", b) for b in BAD_CHATS]
    for path, body in cases:
        status, data = raw(port, "POST", path, body)
        if status == 200 and body in mutated:  # a mutation that is still a valid request
            continue
        assert 400 <= status < 500, (body, status, data)
        error = json.loads(data)["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], body
    assert raw(port, "GET", "/health")[0] == 200
    assert raw(port, "GET", "/nowhere")[0] == 404


def test_health_before_warm_up_and_a_full_queue(server):
    """An engine not yet started: /health says 503; once ready with its one queue place taken, a
    request gets 503 with the error JSON (the openai client's InternalServerError family)."""
    generator = server[0]
    engine = Engine(generator, EngineConfig(max_batch=1, max_length=32, bucket_width=0, max_queue=1))
    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(make_app(engine, "bloom-tiny"), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    for _ in range(200):
        if uv.started:
            break
        time.sleep(0.05)
    try:
        assert raw(port, "GET", "/health")[0] == 503
        engine.ready.set()  # no scheduler thread: what is queued stays queued
        engine.submit([5, 6], engine_params())
        status, data = raw(port, "POST", "/v1/completions", b'{"prompt": "hi"}')
        assert status == 503 and json.loads(data)["error"]["code"] == "queue_full"
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.InternalServerError):
            c.completions.create(model="bloom-tiny", prompt="hi")
    finally:
        uv.should_exit = True
        thread.join(10)


def engine_params():
    from generation.serving.params import SamplingParams

    return SamplingParams(max_tokens=1)


def test_chat_prompt_with_and_without_a_template():
    from generation.serving.openai_format import TURN_STOPS, chat_prompt

    class Plain:
        config = {}

    class Templated:
        config = {"chat_template": "{% for m in messages %}<{{ m.role }}>{{ m.content }}{{ eos_token }}{% endfor %}"
                                   "{% if add_generation_prompt %}<assistant>{% endif %}", "eos_token": "</s>"}

    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert chat_prompt(messages, Plain()) == ("System: S\nUser: U\nAssistant:", TURN_STOPS)
    assert chat_prompt(messages, Templated()) == ("<system>S</s><user>U</s><assistant>", [])


def test_cli_serve(tmp_path):
    """./bloom.py --serve on the embedded default: /health turns 200 after warm-up, a completion
    answers, and the process ends on SIGINT."""
    import signal
    import subprocess
    import sys

    port = free_port()
    proc = subprocess.Popen([sys.executable, "bloom.py", "--serve", "--port", str(port), "--max_length", "32",
                             "--max_batch", "2", "--bucket_width", "16"], stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(600):
            try:
                if raw(port, "GET", "/health")[0] == 200:
                    break
            except OSError:
                pass
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.1)
        status, data = raw(port, "POST", "/v1/completions", b'{"prompt": "hello", "max_tokens": 3, "temperature": 0}')
        assert status == 200 and len(json.loads(data)["choices"]) == 1
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(30)
    log = proc.stderr.read()
    # Prefills of 1 and 2 prompts and decodes of 1 and 2 rows, each at lengths 16 and 32; mixed
    # steps of 1 and 2 rows with chunks of 8, 16 and 32 (--prefill_chunk, capped at --max_length) at each.
    assert "warm-up: 4 prefill, 4 decode and 12 mixed shapes" in log, log


def test_token_id_prompts(server, client):
    """Prompts as token ids (as lm-eval sends them): generation and scoring use these very ids."""
    tokenizer = server[0].tokenizer
    ids = tokenizer.encode("the cat sat on the")
    by_text = client.completions.create(model="bloom-tiny", prompt="the cat sat on the", max_tokens=6, temperature=0)
    by_ids = client.completions.create(model="bloom-tiny", prompt=ids, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text and by_ids.usage.prompt_tokens == len(ids)
    scored_text = client.completions.create(model="bloom-tiny", prompt="the cat sat on the", max_tokens=0, echo=True,
                                            logprobs=0)
    scored_ids = client.completions.create(model="bloom-tiny", prompt=[ids, ids[:3]], max_tokens=0, echo=True, logprobs=0)
    # (within float tolerance: here the pass has two rows of different lengths)
    assert scored_ids.choices[0].logprobs.token_logprobs[0] is None
    assert scored_ids.choices[0].logprobs.token_logprobs[1:] == pytest.approx(
        scored_text.choices[0].logprobs.token_logprobs[1:], abs=1e-3)
    assert len(scored_ids.choices[1].logprobs.token_logprobs) == 3
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="bloom-tiny", prompt=[10**9], max_tokens=2)
