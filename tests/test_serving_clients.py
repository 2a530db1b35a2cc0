"""The server against the clients people point at an OpenAI-compatible server, run unmodified:
schemathesis fuzzing from our own /openapi.json, the official openai client sending vLLM's
extensions as load generators do, and bodies that used to end in a 5xx."""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest

from generation import Generator
from servers import engine_server

KEY = "fuzz-key"
MAX_LENGTH = 48


@pytest.fixture(scope="module")
def generator():
    return Generator.from_pretrained("checkpoints/bloom-tiny", dtype="fp32", device="cpu")


@pytest.fixture(scope="module")
def server(generator):
    with engine_server(generator, "bloom-tiny", KEY, metrics=True, max_batch=4, max_length=MAX_LENGTH, bucket_width=16,
                       max_queue=64) as running:
        yield running.engine, running.port


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server[1]}/v1", api_key=KEY, max_retries=0, timeout=60)


def post(port: int, path: str, body: bytes, timeout: float = 60) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request("POST", path, body=body, headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    response = conn.getresponse()
    return response.status, json.loads(response.read() or b"{}")


def greedy_alone(generator, prompt: str, max_tokens: int) -> str:
    return generator.generate([prompt], max_length=MAX_LENGTH, max_new_tokens=max_tokens, ignore_eos=False,
                              bucket_width=16)[0].text


# --- the schema --------------------------------------------------------------------------------------


def test_the_schema_documents_the_bodies_and_metrics_as_text(server):
    conn = http.client.HTTPConnection("127.0.0.1", server[1], timeout=30)
    conn.request("GET", "/openapi.json")
    schema = json.loads(conn.getresponse().read())
    for path, model in (("/v1/completions", "CompletionBody"), ("/v1/chat/completions", "ChatBody")):
        body = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body["$ref"].endswith(model)
        assert {"400", "503"} <= set(schema["paths"][path]["post"]["responses"])
    fields = schema["components"]["schemas"]["CompletionBody"]["properties"]
    assert {"prompt", "max_tokens", "temperature", "ignore_eos", "min_tokens"} <= set(fields)
    assert "text/plain" in schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    # The ranges our checks accept, and the vLLM fields refused, are in the schema for clients to read.
    assert (fields["top_p"]["exclusiveMinimum"], fields["top_p"]["maximum"]) == (0, 1)
    assert (fields["n"]["minimum"], fields["presence_penalty"]["maximum"]) == (1, 2)
    assert fields["prompt_logprobs"]["not"] == {} and fields["min_p"]["enum"] == [0, None]
    assert "not" not in fields["guided_json"]  # structured output is honoured (docs/structured-output.md)


# --- vLLM's extensions, as a load generator sends them ------------------------------------------------


def test_a_load_generators_request_with_vllms_fields(server, client, generator):
    """guidellm's body: ignore_eos, a fixed max_tokens, streamed with usage on every chunk."""
    stream = client.completions.create(
        model="bloom-tiny", prompt="It was the best of times", max_tokens=20, stream=True, temperature=0,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "min_tokens": 20, "stream_options": {"include_usage": True,
                                                                             "continuous_usage_stats": True},
                    "skip_special_tokens": True, "spaces_between_special_tokens": True})
    chunks = list(stream)
    assert all(chunk.usage is not None for chunk in chunks)  # continuous usage stats
    final = chunks[-1].usage
    assert final.completion_tokens == 20 and final.total_tokens == final.prompt_tokens + 20
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    want = generator.generate(["It was the best of times"], max_length=MAX_LENGTH, max_new_tokens=20,
                              ignore_eos=True)[0]
    assert text == want.text


def test_a_load_generators_chat_request_with_vllms_fields(server, client, generator):
    """The same on the chat endpoint: every chunk, the role's first one included, has the usage."""
    stream = client.chat.completions.create(
        model="bloom-tiny", messages=[{"role": "user", "content": "Hello"}], max_completion_tokens=7, stream=True,
        temperature=0, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "min_tokens": 7, "max_tokens": 7,
                    "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    chunks = list(stream)
    assert all(chunk.usage is not None for chunk in chunks)
    assert chunks[0].usage.completion_tokens == 0 and chunks[-1].usage.completion_tokens == 7
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    want = generator.generate(["User: Hello\nAssistant:"], max_length=MAX_LENGTH, max_new_tokens=7, ignore_eos=True)
    assert text == want[0].text.split("\nUser:")[0].split("\nSystem:")[0]


def test_chat_with_vllms_fields_and_text_parts(server, client):
    out = client.chat.completions.create(
        model="bloom-tiny", messages=[{"role": "user", "content": [{"type": "text", "text": "Hello"}]}],
        max_completion_tokens=6, extra_body={"ignore_eos": True, "top_k": 1, "use_beam_search": False})
    assert out.usage.completion_tokens == 6


@pytest.mark.parametrize("field, value", [
    ("truncate_prompt_tokens", 4), ("min_p", 0.1), ("stop_token_ids", [5]),
    ("include_stop_str_in_output", True), ("prompt_logprobs", 1), ("skip_special_tokens", False),
])
def test_vllm_fields_we_cannot_honour_are_a_400_naming_them(server, client, field, value):
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model="bloom-tiny", prompt="Hi", max_tokens=2, extra_body={field: value})
    assert error.value.body["param"] == field and "not supported" in error.value.body["message"]


def chat_alone(generator, content: str, max_tokens: int, **options) -> str:
    """What the chat endpoint should answer: the default turn format's prompt, generated alone and
    cut at the turn stops."""
    from generation.serving.openai_format import TURN_STOPS

    text = generator.generate([f"User: {content}\nAssistant:"], max_length=MAX_LENGTH, max_new_tokens=max_tokens,
                              ignore_eos=False, **options)[0].text
    for stop in TURN_STOPS:
        text = text.split(stop)[0]
    return text


def test_chat_answered_offline_keeps_the_chat_shape(server, client, generator):
    """Beams and min_tokens run on the batch runner's path; its answer must still be a chat answer
    (a message, or content deltas), as the client parses it."""
    want = chat_alone(generator, "Hello", 5, num_beams=2)
    out = client.chat.completions.create(model="bloom-tiny", messages=[{"role": "user", "content": "Hello"}],
                                         max_tokens=5, extra_body={"use_beam_search": True})
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content == want
    assert out.choices[0].finish_reason in ("length", "stop")
    # Streamed as in vLLM's own tests: min_tokens without ignore_eos, usage on every chunk.
    stream = client.chat.completions.create(
        model="bloom-tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=6, stream=True,
        stream_options={"include_usage": True}, temperature=0,
        extra_body={"min_tokens": 6, "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    chunks = list(stream)
    assert all(chunk.usage is not None for chunk in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat_alone(generator, "Hello", 6, min_new_tokens=6)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("length", "stop")
    assert chunks[-1].usage.completion_tokens <= 6


@pytest.mark.parametrize("body, field", [
    ({"prompt": "Hi", "max_tokens": 3, "min_tokens": 5}, "min_tokens"),
    ({"prompt": "Hi", "max_tokens": 3, "min_tokens": 5, "ignore_eos": True}, "min_tokens"),
    ({"prompt": "Hi", "min_tokens": -1, "ignore_eos": True}, "min_tokens"),
    ({"messages": [{"role": "user", "content": "Hi"}], "logprobs": True, "use_beam_search": True}, "logprobs"),
    ({"messages": [{"role": "user", "content": "Hi"}], "top_logprobs": 2}, "top_logprobs"),
])
def test_vllm_fields_out_of_range_are_a_400_naming_them(server, body, field):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    status, answer = post(server[1], path, json.dumps(body).encode())
    assert status == 400 and answer["error"]["param"] == field, answer


def test_use_beam_search_runs_beams(server, client, generator):
    out = client.completions.create(model="bloom-tiny", prompt="It was", max_tokens=5, best_of=3,
                                    extra_body={"use_beam_search": True})
    want = generator.generate(["It was"], max_length=MAX_LENGTH, max_new_tokens=5, num_beams=3, ignore_eos=False)
    assert out.choices[0].text == want[0].text


# --- bodies that used to end in a 5xx --------------------------------------------------------------


@pytest.mark.parametrize("body, field", [
    ({"messages": [{"role": {}, "content": "x"}]}, "messages"),
    ({"messages": [{"role": ["user"], "content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages"),
    ({"prompt": "hi", "max_tokens": "5"}, "max_tokens"),
    ({"prompt": "hi", "bogus": 1}, "bogus"),
    ({"prompt": "hi", "repetition_penalty": float("inf")}, "repetition_penalty"),  # Python's json writes Infinity
    ({"prompt": "hi", "length_penalty": float("nan"), "num_beams": 2}, "length_penalty"),
])
def test_ill_typed_bodies_are_a_400_naming_the_field(server, body, field):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    status, answer = post(server[1], path, json.dumps(body).encode())
    assert status == 400 and answer["error"]["param"] == field, answer


def test_a_request_that_can_never_fit_is_a_400_not_a_retry_later(server):
    status, answer = post(server[1], "/v1/completions", json.dumps({"prompt": ["a"] * 10000, "max_tokens": 1}).encode())
    assert status == 400 and "--max_queue" in answer["error"]["message"]


def test_health_answers_while_a_large_body_is_tokenized(server):
    """A 5 MB prompt is tokenized off the event loop: /health answers meanwhile."""
    port = server[1]
    body = json.dumps({"prompt": "the cat sat on the mat " * 220000, "max_tokens": 1}).encode()
    done = {}
    worker = threading.Thread(target=lambda: done.update(answer=post(port, "/v1/completions", body, timeout=120)))
    worker.start()
    time.sleep(0.3)  # the body is in and being tokenized
    slowest = 0.0
    while worker.is_alive():
        start = time.perf_counter()
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("GET", "/health")
        assert conn.getresponse().status == 200
        slowest = max(slowest, time.perf_counter() - start)
        time.sleep(0.05)
    worker.join()
    assert done["answer"][0] == 400  # far longer than max_length
    assert slowest < 1.0, slowest


# --- schemathesis ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_schemathesis_strict_checks_pass_and_the_server_stays_exact(server, client, generator, tmp_path):
    """Property-based fuzzing from /openapi.json (bounded, fixed seed), run as its own CLI with every
    check: no server error, answers and headers as documented, schema-invalid bodies refused,
    schema-valid ones accepted (save the refusals no JSON schema can state, named in
    tests/schemathesis_checks.py), undeclared methods a 405 with ``Allow``."""
    engine, port = server
    command = [sys.executable, "-m", "schemathesis.cli", "run", f"http://127.0.0.1:{port}/openapi.json",
               "--checks", "all", "--exclude-checks", "positive_data_acceptance", "--max-examples", "40", "--seed", "7",
               "--generation-deterministic", "--phases", "coverage,fuzzing", "--header", f"Authorization: Bearer {KEY}",
               "--request-timeout", "60", "--workers", "1", "--no-shrink", "--report", "junit", "--report-dir", str(tmp_path)]
    tests = str(Path(__file__).resolve().parent)
    hooks = dict(os.environ, SCHEMATHESIS_HOOKS="schemathesis_checks",
                 PYTHONPATH=os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")])))
    done = subprocess.run(command, capture_output=True, text=True, timeout=400, cwd=tmp_path, env=hooks)  # its cache there
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert "Tested: 5" in done.stdout and " generated" in done.stdout, done.stdout[-3000:]
    # The documented ranges are ours: the valid requests it makes mostly run, not mostly a 400.
    assert "mostly rejected" not in done.stdout, done.stdout[-3000:]
    # Still healthy and exact afterwards.
    for _ in range(100):
        if engine.running_rows == 0 and engine.queue_length == 0:
            break
        time.sleep(0.1)
    out = client.completions.create(model="bloom-tiny", prompt="It was the best of times", max_tokens=8, temperature=0)
    assert out.choices[0].text == greedy_alone(generator, "It was the best of times", 8)


def test_undeclared_methods_are_a_405_with_allow(server):
    """RFC 9110: a 405 names the methods the path takes (schemathesis's unsupported_method check)."""
    for path, allowed in (("/health", "GET"), ("/metrics", "GET"), ("/v1/models", "GET"),
                          ("/v1/completions", "POST"), ("/v1/chat/completions", "POST")):
        for method in ("TRACE", "DELETE", "PUT"):
            conn = http.client.HTTPConnection("127.0.0.1", server[1], timeout=30)
            conn.request(method, path, headers={"Authorization": f"Bearer {KEY}"})
            response = conn.getresponse()
            assert response.status == 405 and response.getheader("Allow") == allowed, (method, path)
            assert json.loads(response.read())["error"]["message"] == "Method Not Allowed"


def test_search_options_the_model_cannot_run_are_a_400(server):
    """Found by schemathesis: num_beams past what the vocabulary allows was a 500 from the engine."""
    for path, body in (("/v1/completions", {"prompt": "hi", "num_beams": 16994}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "num_beams": 16994})):
        status, answer = post(server[1], path, json.dumps(body).encode())
        assert status == 400 and "num_beams" in answer["error"]["message"], answer
