"""``./bloom.py --serve --data_parallel 2``: two one-thread replicas behind one port.

The router and the metrics merge in the test process (quick); then real launches under torchrun,
asked through the official ``openai`` client: greedy answers equal one process's, requests sharing a
system prompt land on one replica (its prefix-cache hits in /metrics), both replicas get work, and a
replica whose launcher is killed (two launchers on loopback as two "nodes") leaves the other serving.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from servers import free_port, health, wait_until_healthy
from test_data_parallel import ENV, ROOT, kill_tree
from test_serving_tp import stop

from generation.serving.replicas import BLOCK_CHARS, Router, merge_metrics, prompt_text

SERVE = ["--serve", "--max_batch", "4", "--max_length", "96", "--bucket_width", "32", "--max_prefill", "2"]
SYSTEM = ("You are a terse assistant for a shipping company. Answer in one short sentence, never more; "
          "do not apologise and do not repeat the question. ")  # longer than two routing blocks
CACHE = ("--prefix_cache", "16MB")  # on, as one process's server with it is tested exact (test_prefix_serving.py)
PROMPTS = ["the cat sat on", "a", "once upon a time there was", "hello world", "and then", "x y z",
           "seven eight", "numbers: 1 2 3"]


# -- the router, in the test process --------------------------------------------------------------

def test_a_shared_leading_block_goes_to_the_replica_that_served_it():
    router = Router(2)
    first, why = router.choose(SYSTEM + "where is my parcel?")
    assert why == "least_loaded"
    router.in_flight[first] += 1  # still answering: the other replica is now the less loaded
    again, why = router.choose(SYSTEM + "when do you open?")
    assert (again, why) == (first, "prefix")
    other, why = router.choose("something else entirely, long enough to fill a block or two of text " * 2)
    assert (other, why) == (1 - first, "least_loaded")


def test_distinct_prompts_spread_over_replicas_and_a_down_one_gets_none():
    router = Router(2)
    chosen = [router.choose(f"prompt {i}")[0] for i in range(6)]
    assert chosen.count(0) == chosen.count(1) == 3
    router.up[1] = False
    assert {router.choose(SYSTEM + str(i))[0] for i in range(4)} == {0}
    router.up[0] = False
    assert router.choose("x") == (None, "down")


def test_a_prefix_spreads_once_its_replica_has_no_free_row():
    router = Router(2, rows=3)
    holder, _ = router.choose(SYSTEM + "0")
    router.in_flight[holder] = 2
    assert router.choose(SYSTEM + "1") == (holder, "prefix")
    router.in_flight[holder] = 3  # every row busy: the other replica takes it, and holds the prefix too
    assert router.choose(SYSTEM + "2") == (1 - holder, "least_loaded")
    router.in_flight[1 - holder] = 1
    assert router.choose(SYSTEM + "3") == (1 - holder, "prefix")  # the less loaded of its two holders


def test_prompt_text_reads_completions_and_chats():
    assert prompt_text(b'{"prompt": "abc"}') == "abc"
    assert prompt_text(b'{"prompt": ["abc", "def"]}') == "abc"
    assert prompt_text(b'{"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]}') \
        == "<system>S<user>U"
    assert prompt_text(b"not json") == "" and prompt_text(b"[1]") == ""
    assert len(SYSTEM) > 2 * BLOCK_CHARS


def test_metrics_get_a_replica_label_and_a_total():
    text = ("# HELP bloom_generated_tokens_total tokens generated\n# TYPE bloom_generated_tokens_total counter\n"
            "bloom_generated_tokens_total 5.0\n"
            "# HELP bloom_queue_length requests waiting\n# TYPE bloom_queue_length gauge\nbloom_queue_length 1.0\n")
    from prometheus_client import generate_latest
    from generation.serving.replicas import _Families

    out = generate_latest(_Families(merge_metrics({0: text, 1: text.replace("5.0", "7.0")}))).decode()
    assert 'bloom_generated_tokens_total{replica="0"} 5.0' in out
    assert 'bloom_generated_tokens_total{replica="1"} 7.0' in out
    assert 'bloom_generated_tokens_total{replica="total"} 12.0' in out
    assert 'bloom_queue_length{replica="total"} 2.0' in out


def test_a_replica_whose_engine_stopped_is_marked_down_and_the_other_keeps_serving():
    """Two replicas in this process behind the front door; the second's warm-up fails (its process
    lives on, its engine does not). Its /health and its requests answer 503 "engine_stopped", a
    request queued before it failed gets the error, the front door marks it down, and every request
    through the front door is answered by the first, as one engine alone answers it."""
    import threading

    import uvicorn

    from generation import Generator
    from generation.serving.app import make_app
    from generation.serving.engine import Engine, EngineConfig
    from generation.serving.handles import EngineError
    from generation.serving.params import SamplingParams
    from generation.serving.replicas import make_front_door

    generator = Generator.from_pretrained(ROOT / "checkpoints" / "bloom-tiny", dtype="fp32", device="cpu")
    config = EngineConfig(max_batch=4, max_length=64, bucket_width=16)
    good, broken = Engine(generator, config), Engine(generator, config)

    def fail():
        raise RuntimeError("out of device memory")

    broken.warm_up = fail
    queued = broken.submit(generator.tokenizer.encode("queued before"), SamplingParams(max_tokens=2))
    servers = []

    def serve(app) -> int:
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        threading.Thread(target=server.run, daemon=True).start()
        servers.append(server)
        while not server.started:
            time.sleep(0.02)
        return port

    def health_of(url: str) -> tuple[int, dict]:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as answer:
                return answer.status, json.loads(answer.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read())

    good.start()
    broken.start()
    try:
        urls = [f"http://127.0.0.1:{serve(make_app(e, 'bloom-tiny'))}" for e in (good, broken)]
        with pytest.raises(EngineError, match="the engine stopped: RuntimeError: out of device memory"):
            queued.result(10)
        code, body = health_of(urls[1])
        assert code == 503 and body["error"]["code"] == "engine_stopped"
        direct = openai.OpenAI(base_url=f"{urls[1]}/v1", api_key="none", max_retries=0, timeout=30)
        with pytest.raises(openai.APIStatusError) as refused:
            direct.completions.create(model="bloom-tiny", prompt="hello", max_tokens=2)
        assert refused.value.status_code == 503 and "the engine stopped" in str(refused.value)
        door = serve(make_front_door(urls, log=lambda line: None, rows=4))
        deadline = time.time() + 15
        while time.time() < deadline:
            replicas = health_of(f"http://127.0.0.1:{door}")[1].get("replicas", [])
            if [r["status"] for r in replicas] == ["ready", "down"]:
                break
            time.sleep(0.1)
        assert [r["status"] for r in replicas] == ["ready", "down"], replicas
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{door}/v1", api_key="none", max_retries=0, timeout=60)
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda p: client.completions.create(model="bloom-tiny", prompt=p, max_tokens=4,
                                                                        temperature=0), PROMPTS[:4]))
        for prompt, answer in zip(PROMPTS[:4], answers):
            alone = generator.generate([prompt], max_new_tokens=4, max_length=64, ignore_eos=False)[0].text
            assert answer.choices[0].text == alone
    finally:
        for server in servers:
            server.should_exit = True
        good.stop()
        broken.stop()


def test_a_replica_listens_on_loopback_on_the_front_doors_node_else_toward_the_master():
    from generation.serving.dp_serving import node_of, replica_address, url
    from generation.serving.listen import ListenError

    assert replica_address(True, {}) == "127.0.0.1"
    assert replica_address(False, {"MASTER_ADDR": "127.0.0.1"}) == "127.0.0.1"  # a master on this machine
    for environ in ({}, {"MASTER_ADDR": "no-such-host.invalid"}):
        with pytest.raises(ListenError, match="MASTER_ADDR"):
            replica_address(False, environ)
    assert node_of({"GROUP_RANK": "1"}) != node_of({"GROUP_RANK": "0"})  # two launchers on one machine: two nodes
    assert node_of({"CROSS_RANK": "0"}) == node_of({"GROUP_RANK": "0"})  # deepspeed's name for it
    assert url("fd00::2", 80) == "http://[fd00::2]:80" and url("10.0.0.2", 80) == "http://10.0.0.2:80"


# -- real launches ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def checkpoint(make_ckpt):
    return make_ckpt(hidden_size=64, n_layer=2, n_head=4, seed=5)


def command(checkpoint, port: int, *extra, ranks: int = 1, node: tuple[int, int] | None = None,
            deepspeed: bool = False, master: str = "127.0.0.1") -> list[str]:
    import sys

    prefix = [sys.executable]
    if deepspeed:
        prefix += ["-m", "deepspeed.launcher.runner", "--num_gpus", str(ranks), "--master_port", str(free_port())]
    elif node is not None:  # (this node's rank, master port): one launcher per "node" on loopback
        prefix += ["-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node[0]), "--nproc_per_node",
                   "1", "--master_addr", master, "--master_port", str(node[1])]
    elif ranks > 1:
        prefix += ["-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port", str(free_port())]
    return [*prefix, str(ROOT / "bloom.py"), "--weights", str(checkpoint), *SERVE, "--port", str(port), *extra]


def launch(cmd: list[str], port: int, log_path, wait: bool = True) -> subprocess.Popen:
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    if wait:
        try:
            wait_until_healthy(proc, port, 300, log=lambda: log_path.read_text()[-4000:])
        except AssertionError:
            kill_tree(proc.pid)
            raise
    return proc


def client(port: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)


def greedy(port: int, model: str, count: int = 24) -> list[str]:
    """Completions, chats and a stream, sent 8 at a time."""
    c = client(port)

    def ask(i):
        prompt = PROMPTS[i % len(PROMPTS)]
        if i % 3 == 0:
            return c.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0).choices[0].text
        if i % 3 == 1:
            return c.chat.completions.create(model=model, messages=[{"role": "system", "content": SYSTEM},
                                                                    {"role": "user", "content": prompt}],
                                             max_tokens=8, temperature=0).choices[0].message.content
        chunks = c.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0, stream=True)
        return "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)

    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(ask, range(count)))


def metrics(port: int) -> dict[tuple, float]:
    """The front door's /metrics: (sample name, sorted (label, value) pairs) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def at(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.mark.slow
def test_two_replicas_answer_what_one_process_answers(checkpoint, tmp_path):
    """Completions, chats and streams sent 8 at a time, the prefix cache on on both sides: which
    chats hit their system prompt, and on which replica, depends on arrival timing, and a hit must
    not change an answer. (On this checkpoint the closest call between a greedy token and the
    runner-up is 0.039 in log-probability, far above the float noise of a hit's other path.)"""
    port = free_port()
    one = launch(command(checkpoint, port, *CACHE), port, tmp_path / "one.log")
    try:
        want = greedy(port, checkpoint.name)
    finally:
        stop(one)
    port = free_port()
    two = launch(command(checkpoint, port, *CACHE, "--data_parallel", "2", ranks=2), port,
                 tmp_path / "two.log")
    try:
        got = greedy(port, checkpoint.name)
        with pytest.raises(openai.NotFoundError, match="'nope' does not exist"):  # a replica's error, passed on
            client(port).completions.create(model="nope", prompt="a", max_tokens=2)
        seen = metrics(port)
        health_body = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/health").read())
    finally:
        stop(two)
    assert got == want
    assert any(got)
    assert health_body["status"] == "ok" and [r["status"] for r in health_body["replicas"]] == ["ready", "ready"]
    for r in ("0", "1"):  # both replicas did work: distinct prompts are spread by load
        assert at(seen, "bloom_requests_total", endpoint="/v1/completions", replica=r, status="200") > 0, seen
    assert at(seen, "bloom_generated_tokens_total", replica="total") == sum(
        at(seen, "bloom_generated_tokens_total", replica=r) for r in ("0", "1")) > 0
    assert at(seen, "bloom_prefix_cache_hits", replica="total") > 0, seen  # some chats answered after a hit


@pytest.mark.slow
def test_two_replicas_of_two_ranks_answer_what_one_process_answers(checkpoint, tmp_path):
    """deepspeed --num_gpus 4 ... --data_parallel 2: two replicas of two tensor-parallel ranks, each
    leader sending its steps over its own replica's group. Few short requests: four one-thread
    ranks share two cores."""
    port = free_port()
    one = launch(command(checkpoint, port, *CACHE), port, tmp_path / "one.log")
    try:
        want = greedy(port, checkpoint.name, count=8)
    finally:
        stop(one)
    port = free_port()
    four = launch(command(checkpoint, port, *CACHE, "--data_parallel", "2", ranks=4, deepspeed=True),
                  port, tmp_path / "four.log")
    try:
        got = greedy(port, checkpoint.name, count=8)
        seen = metrics(port)
        health_body = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/health").read())
    finally:
        stop(four)
    log = (tmp_path / "four.log").read_text()
    assert "num_local_procs=4" in log, log[-3000:]
    assert got == want
    assert any(got)
    assert [r["status"] for r in health_body["replicas"]] == ["ready", "ready"]
    for r in ("0", "1"):
        assert at(seen, "bloom_generated_tokens_total", replica=r) > 0, seen


@pytest.mark.slow
def test_idle_replicas_of_two_ranks_outlive_their_collective_timeout(checkpoint, tmp_path, monkeypatch):
    """Each replica's leader sends heartbeats to its own ranks while idle: 25 idle seconds under a
    12 s collective timeout (the replicas' groups take it too), then both replicas still answer."""
    request = dict(prompt="the cat sat on", max_tokens=6, temperature=0)
    port = free_port()
    one = launch(command(checkpoint, port), port, tmp_path / "one.log")
    try:
        want = client(port).completions.create(model=checkpoint.name, **request).choices[0].text
    finally:
        stop(one)
    monkeypatch.setitem(ENV, "BLOOM_COLLECTIVE_TIMEOUT", "12")
    port = free_port()
    four = launch(command(checkpoint, port, "--data_parallel", "2", ranks=4, deepspeed=True), port,
                  tmp_path / "four.log")
    try:
        time.sleep(25)
        assert four.poll() is None, (tmp_path / "four.log").read_text()[-3000:]
        c = client(port)
        with ThreadPoolExecutor(2) as pool:  # two at once: the front door gives the second to the other replica
            got = list(pool.map(lambda _: c.completions.create(model=checkpoint.name, **request).choices[0].text,
                                range(2)))
        seen = metrics(port)
    finally:
        stop(four)
    assert got == [want, want]
    assert [at(seen, "bloom_requests_total", endpoint="/v1/completions", replica=r, status="200") for r in "01"] \
        == [1, 1], seen


@pytest.mark.slow
def test_requests_sharing_a_system_prompt_land_on_one_replica(checkpoint, tmp_path):
    """One system prompt, many users, 4 at a time: every chat after the first is routed by its
    prefix to the replica that served the first, and hits that replica's prefix cache."""
    port = free_port()
    two = launch(command(checkpoint, port, "--data_parallel", "2", ranks=2), port, tmp_path / "two.log")
    try:
        c = client(port)
        c.completions.create(model=checkpoint.name, prompt="warm", max_tokens=1)  # replica 0 now has one served
        ask = lambda i: c.chat.completions.create(model=checkpoint.name, messages=[
            {"role": "system", "content": SYSTEM}, {"role": "user", "content": f"question {i}"}],
            max_tokens=2, temperature=0)
        ask(0)
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(ask, range(1, 9)))
        seen = metrics(port)
    finally:
        stop(two)
    routed = {r: at(seen, "bloom_routed_requests_total", reason="prefix", replica=r) for r in ("0", "1")}
    holder = max(routed, key=routed.get)
    assert sorted(routed.values()) == [0, 8], routed
    hits = {r: at(seen, "bloom_prefix_cache_hits", replica=r) for r in ("0", "1")}
    assert hits[holder] >= 8 and hits[str(1 - int(holder))] == 0, hits
    assert at(seen, "bloom_prefix_cache_hits", replica="total") == hits["0"] + hits["1"]


@pytest.mark.slow
def test_a_killed_replica_is_reported_and_the_other_keeps_serving(checkpoint, tmp_path):
    """Two launchers on loopback as two "nodes", one replica each (one launcher ends every rank it
    started when one dies, so a replica that dies alone is another node's)."""
    port, master = free_port(), free_port()
    nodes = [launch(command(checkpoint, port, "--data_parallel", "2", node=(r, master)), port,
                    tmp_path / f"node{r}.log", wait=False) for r in (0, 1)]
    try:
        wait_until_healthy(nodes[0], port, 300, log=lambda: (tmp_path / "node0.log").read_text()[-4000:])
        c = client(port)
        ask = lambda p: c.completions.create(model=checkpoint.name, prompt=p, max_tokens=4, temperature=0).choices[0].text
        want = [ask(p) for p in PROMPTS]
        kill_tree(nodes[1].pid)  # replica 1's leader, and its launcher
        nodes[1].wait(30)
        deadline = time.time() + 30
        while time.time() < deadline and health(port) != 503:
            time.sleep(0.2)
        answer = urllib.request.Request(f"http://127.0.0.1:{port}/health")
        with pytest.raises(urllib.error.HTTPError) as down:
            urllib.request.urlopen(answer, timeout=10)
        body = json.loads(down.value.read())
        assert down.value.code == 503 and "replica 1 is down" in body["error"]["message"], body
        assert [r["status"] for r in body["replicas"]] == ["ready", "down"]
        assert [ask(p) for p in PROMPTS] == want  # every request now on replica 0, answered as before
        assert nodes[0].poll() is None
        up = metrics(port)
        assert at(up, "bloom_replica_up", replica="0") == 1 and at(up, "bloom_replica_up", replica="1") == 0
    finally:
        for node in nodes:
            if node.poll() is None:
                stop(node)
    assert "replica 1 is down" in (tmp_path / "node0.log").read_text()


@pytest.mark.slow
def test_a_replica_on_another_node_listens_toward_the_master(checkpoint, tmp_path):
    """Two launchers as two nodes whose master is this machine's network address (not loopback):
    the second node's replica listens on its address toward the master, the first on loopback, and
    the front door answers through both what one process answers."""
    from generation.serving.dp_serving import facing_address

    address = facing_address("203.0.113.1")  # the interface of the default route (TEST-NET: nothing is sent)
    if address is None or address.startswith("127.") or ":" in address:
        pytest.skip("this machine has no IPv4 network address besides loopback")
    single_port = free_port()
    single = launch(command(checkpoint, single_port), single_port, tmp_path / "single.log")
    try:
        c = client(single_port)
        want = [c.completions.create(model=checkpoint.name, prompt=p, max_tokens=6, temperature=0).choices[0].text
                for p in PROMPTS]
    finally:
        stop(single)
    port, master = free_port(), free_port()
    nodes = [launch(command(checkpoint, port, "--data_parallel", "2", node=(r, master), master=address), port,
                    tmp_path / f"node{r}.log", wait=False) for r in (0, 1)]
    try:
        wait_until_healthy(nodes[0], port, 300, log=lambda: (tmp_path / "node0.log").read_text()[-4000:])
        urls = [r["url"] for r in json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/health").read())["replicas"]]
        assert urls[0].startswith("http://127.0.0.1:") and urls[1].startswith(f"http://{address}:"), urls
        c = client(port)
        got = [c.completions.create(model=checkpoint.name, prompt=p, max_tokens=6, temperature=0).choices[0].text
               for p in PROMPTS]
        assert got == want
        routed = metrics(port)
        assert all(at(routed, "bloom_routed_requests_total", replica=str(r), reason="least_loaded") >= 1 for r in (0, 1))
    finally:
        for node in nodes:  # the ranks too: torchrun starts each in a session of its own
            kill_tree(node.pid)
            node.wait(30)


@pytest.mark.slow
def test_a_busy_port_stops_every_rank_with_one_error_line(checkpoint, tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        done = subprocess.run(command(checkpoint, port, "--data_parallel", "2", ranks=2), cwd=ROOT, env=ENV,
                              capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    # Every rank stops with the same line, before loading anything (the launcher then reports its children).
    assert f"error: rank 0: 127.0.0.1:{port} is already in use" in done.stderr, done.stderr[-3000:]
    assert "warm-up" not in done.stderr
