"""Data parallelism (``--data_parallel D``): the split of the work, the part files and their fold,
and real launches under torchrun: D = 2 x T = 1 and D = 1 x T = 2 give one process's results file,
a kill then a rerun gives the same file, and bad launches stop with one line and write nothing."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from bloom_hpu.data_parallel import check_data_parallel
from bloom_hpu.tp import ParallelError
from generation.jobs.data_parallel import deal
from generation.jobs.parts import find_parts, fold_parts, part_path, rewrite_in_order, settled_lines

ROOT = Path(__file__).resolve().parent.parent
WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike".split()


# --- the split ----------------------------------------------------------------------------------


def test_deal_gives_every_item_to_exactly_one_replica_and_balances():
    costs = [1, 9, 3, 3, 8, 2, 2, 7, 1, 5]
    shares = deal(costs, 3)
    assert sorted(i for share in shares for i in share) == list(range(len(costs)))
    loads = [sum(costs[i] for i in share) for share in shares]
    assert max(loads) - min(loads) <= max(costs)  # greedy longest-first: within one item
    assert all(share == sorted(share) for share in shares)  # each replica keeps the planned order
    assert deal(costs, 3) == shares  # every rank deals alike


def test_deal_with_more_replicas_than_items_leaves_some_idle():
    assert sorted(map(len, deal([4.0], 2))) == [0, 1]


def test_world_size_must_divide_into_replicas():
    assert check_data_parallel(4, 2) == 2
    assert check_data_parallel(2, 2) == 1
    with pytest.raises(ParallelError, match="does not divide the 3 ranks"):
        check_data_parallel(3, 2)
    with pytest.raises(ParallelError, match="needs a launch of 2 ranks or a multiple"):
        check_data_parallel(1, 2)
    with pytest.raises(ParallelError, match=">= 1"):
        check_data_parallel(2, 0)


# --- part files -----------------------------------------------------------------------------------


def _record(prompt: str, t: float) -> bytes:
    return json.dumps({"request": {"prompt": prompt}, "result": {"request_time": {"batch_time": t}}}).encode()


def test_a_fold_killed_at_any_point_and_run_again_keeps_every_line_once(tmp_path):
    results = tmp_path / "out.jsonl"
    before = [_record("a", 0.1)]
    parts = {0: [_record("b", 0.2), _record("c", 0.3)], 1: [_record("d", 0.4)]}
    everything = Counter(before + parts[0] + parts[1])
    appended = parts[0] + parts[1]
    data = b"".join(line + b"\n" for line in appended)
    # A kill after k bytes of the fold's append (k = 0: before it; len: before the parts are deleted).
    for k in range(0, len(data) + 1, 7):
        results.write_bytes(b"".join(line + b"\n" for line in before) + data[:k])
        for g, lines in parts.items():
            part_path(results, g).write_bytes(b"".join(line + b"\n" for line in lines))
        # The non-writing ranks' view is the same at every such moment.
        assert Counter(settled_lines(results)) == everything, k
        from generation.jobs.runner import repair_results

        repair_results(results)  # the rerun cuts a torn last line first
        with open(results, "ab") as out:
            fold_parts(results, out)
        assert find_parts(results) == []
        assert Counter(results.read_bytes().splitlines()) == everything, k


def test_fold_drops_a_torn_part_line_and_keeps_a_whole_one_without_newline(tmp_path):
    results = tmp_path / "out.jsonl"
    results.write_bytes(b"")
    part_path(results, 0).write_bytes(_record("a", 1) + b"\n" + b'{"request": {"prompt": "to')
    part_path(results, 1).write_bytes(_record("b", 2))
    with open(results, "ab") as out:
        assert fold_parts(results, out) == 2
    assert results.read_bytes() == _record("a", 1) + b"\n" + _record("b", 2) + b"\n"


def test_rewrite_puts_records_in_one_process_order_and_unknown_ones_last(tmp_path):
    results = tmp_path / "out.jsonl"
    lines = [_record("c", 1), _record("x", 2), _record("a", 3), _record("b", 4)]
    results.write_bytes(b"".join(line + b"\n" for line in lines))
    order = {"a": 0, "b": 1, "c": 2}
    rewrite_in_order(results, lambda rec: order.get(rec["request"]["prompt"]))
    assert [json.loads(line)["request"]["prompt"] for line in results.read_bytes().splitlines()] == ["a", "b", "c", "x"]


# --- real launches --------------------------------------------------------------------------------


def write_requests(path: Path, n: int = 24) -> None:
    """Lines of mixed length and options; the last two repeat earlier lines exactly."""
    lines = []
    for i in range(n):
        prompt = " ".join(WORDS[(i * j) % len(WORDS)] for j in range(1 + (i * 5) % 17))
        lines.append({"prompt": prompt, "max_tokens": 3 + i % 5, "temperature": 0, "logprobs": i % 2})
    lines += lines[:2]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bloom(folder, *args, ranks: int = 1, launcher: str = "torchrun", node: tuple[int, int] | None = None) -> list[str]:
    """The command line of ``bloom.py`` alone, or under a launcher on ``ranks`` ranks; ``node``:
    (this node's rank, master port) of a two-node torchrun launch on loopback."""
    prefix = [sys.executable]
    if node is not None:
        prefix += ["-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node[0]), "--nproc_per_node",
                   str(ranks), "--master_addr", "127.0.0.1", "--master_port", str(node[1])]
    elif ranks > 1 and launcher == "deepspeed":
        prefix += ["-m", "deepspeed.launcher.runner", "--num_gpus", str(ranks), "--master_port", str(free_port())]
    elif ranks > 1:
        prefix += ["-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port", str(free_port())]
    return [*prefix, str(ROOT / "bloom.py"), "--weights", str(folder), "--quiet", "--prefix_cache", "0", *args]


ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def run(cmd, timeout=300, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=timeout, cwd=cwd)


def without_timings(path: Path) -> list[str]:
    out = []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        record["result"].pop("request_time")
        out.append(json.dumps(record))
    return out


@pytest.fixture(scope="module")
def job(make_ckpt, tmp_path_factory):
    """(checkpoint, requests file, one process's results file)."""
    folder = make_ckpt(hidden_size=64, n_layer=2, n_head=4, seed=7)
    where = tmp_path_factory.mktemp("dp")
    requests = where / "in.jsonl"
    write_requests(requests)
    one = where / "one.jsonl"
    done = run(bloom(folder, "--requests", requests, "--results", one, "--budget", "128"))
    assert done.returncode == 0, done.stderr
    return folder, requests, one


@pytest.fixture(scope="module")
def one_per_batch(job):
    """One process's results file with one request per batch (--budget 32): its numbers are those of
    rows alone, which a run of many small batches must give bit for bit."""
    folder, requests, one = job
    path = one.with_name("one-per-batch.jsonl")
    done = run(bloom(folder, "--requests", requests, "--results", path, "--budget", "32"))
    assert done.returncode == 0, done.stderr
    return path


@pytest.mark.slow
@pytest.mark.parametrize("ranks, data_parallel, launcher", [(2, 2, "deepspeed"), (2, 1, "torchrun"), (4, 2, "torchrun")],
                         ids=["D2xT1", "D1xT2", "D2xT2"])
@pytest.mark.slow
def test_replicas_give_one_process_results_file(job, tmp_path, ranks, data_parallel, launcher):
    """Each replica's model collectives stay in its own group: were they the world's, the two
    replicas' different batches would be summed together (or hang)."""
    folder, requests, one = job
    results = tmp_path / "out.jsonl"
    done = run(bloom(folder, "--requests", requests, "--results", results, "--budget", "128",
                     "--data_parallel", str(data_parallel), ranks=ranks, launcher=launcher))
    assert done.returncode == 0, done.stderr[-4000:]
    if ranks == data_parallel:  # whole replicas: the very same numbers
        assert without_timings(results) == without_timings(one)
    else:  # one model split over two ranks: its sums add up in another order (float tolerance)
        assert_close_records(results, one)
    assert find_parts(results) == []
    assert done.stderr.count("26 requests answered") == 1  # one summary, from rank 0


@pytest.mark.slow
def test_two_replicas_speculating_give_one_process_results_and_its_speculation_summary(job, tmp_path):
    """Each replica's speculation is counted: the summary adds up every replica's verify passes,
    guesses and acceptances, which are one process's (each batch runs as it would there)."""
    folder, requests, one = job
    alone, results = tmp_path / "alone.jsonl", tmp_path / "out.jsonl"
    single = run(bloom(folder, "--requests", requests, "--results", alone, "--budget", "128", "--speculate", "ngram:4"))
    assert single.returncode == 0, single.stderr[-4000:]
    done = run(bloom(folder, "--requests", requests, "--results", results, "--budget", "128", "--speculate", "ngram:4",
                     "--data_parallel", "2", ranks=2, launcher="torchrun"))
    assert done.returncode == 0, done.stderr[-4000:]
    assert without_timings(results) == without_timings(one)
    summary = [line for line in done.stderr.splitlines() if "requests answered" in line]
    want = re.search(r"speculation: .*\)", single.stderr).group(0)
    assert len(summary) == 1 and want in summary[0], (summary, want)


def assert_close_records(got: Path, want: Path) -> None:
    """The same records in the same order, the same texts; log-probs within float tolerance."""
    got_records = [json.loads(line) for line in got.read_text().splitlines()]
    want_records = [json.loads(line) for line in want.read_text().splitlines()]
    assert [r["request"] for r in got_records] == [r["request"] for r in want_records]
    for g, w in zip(got_records, want_records):
        for a, b in zip(g["result"]["choices"], w["result"]["choices"], strict=True):
            assert (a["text"], a["finish_reason"]) == (b["text"], b["finish_reason"])
            if b.get("logprobs"):
                assert a["logprobs"]["tokens"] == b["logprobs"]["tokens"]
                assert a["logprobs"]["token_logprobs"] == pytest.approx(b["logprobs"]["token_logprobs"], abs=1e-4)


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process under it. torchrun starts each rank in a session of its
    own, so killing the launcher's process group would leave the ranks running."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parent = int(stat[stat.rindex(")") + 2:].split()[1])
            children.setdefault(parent, []).append(int(entry.name))
    todo, tree = [pid], []
    while todo:
        tree.append(todo.pop())
        todo += children.get(tree[-1], [])
    for p in reversed(tree):  # the ranks first: a launcher that sees them die must not outlive the kill
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.slow
def test_two_nodes_on_loopback_give_one_process_results_file(job, tmp_path):
    """Two torchrun launchers, one per "node" (--node_rank 0 and 1), one rank each: two replicas."""
    folder, requests, one = job
    results = tmp_path / "out.jsonl"
    port = free_port()
    nodes = [subprocess.Popen(bloom(folder, "--requests", requests, "--results", results, "--budget", "128",
                                    "--data_parallel", "2", node=(r, port)),
                              env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    logs = [node.communicate(timeout=300) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], [err[-3000:] for _, err in logs]
    assert without_timings(results) == without_timings(one)
    assert "26 requests answered by 2 replicas" in logs[0][1]


@pytest.mark.slow
def test_a_killed_two_replica_job_rerun_gives_the_same_file(job, one_per_batch, tmp_path):
    folder, requests, _ = job
    results = tmp_path / "out.jsonl"
    # One request per batch: many batches, so the kill lands with some answers in the parts.
    cmd = bloom(folder, "--requests", requests, "--results", results, "--budget", "32", "--data_parallel", "2",
                ranks=2)
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 200
    while proc.poll() is None and time.monotonic() < deadline:
        if sum(p.stat().st_size > 0 for p in find_parts(results)) == 2:
            break
        time.sleep(0.01)
    kill_tree(proc.pid)  # both ranks and the launcher, at once
    proc.wait()
    answered = sum(p.read_bytes().count(b"\n") for p in find_parts(results))
    assert 0 < answered < 26, proc.stderr.read().decode()[-3000:]

    rerun = run(cmd)
    assert rerun.returncode == 0, rerun.stderr[-4000:]
    assert "already answered" in rerun.stderr
    assert without_timings(results) == without_timings(one_per_batch)
    assert find_parts(results) == []


@pytest.mark.slow
def test_parts_left_by_a_killed_job_are_taken_by_a_one_process_rerun(job, tmp_path):
    """A different D on the rerun: the parts a killed replica job left are folded, never answered again."""
    folder, requests, one = job
    results = tmp_path / "out.jsonl"
    lines = one.read_bytes().splitlines(keepends=True)
    part_path(results, 0).write_bytes(b"".join(lines[0:6:2]))
    part_path(results, 1).write_bytes(b"".join(lines[1:6:2]) + lines[6][:20])  # ends torn
    results.write_bytes(b"".join(lines[10:12]))
    done = run(bloom(folder, "--requests", requests, "--results", results, "--budget", "128"))
    assert done.returncode == 0, done.stderr
    assert "resuming: 8 of 26" in done.stderr
    assert sorted(without_timings(results)) == sorted(without_timings(one))
    assert find_parts(results) == []


@pytest.mark.slow
def test_bad_launches_stop_with_one_line_and_write_nothing(job, tmp_path):
    folder, requests, _ = job
    results = tmp_path / "out.jsonl"
    # 2 ranks cannot make 3 replicas.
    done = run(bloom(folder, "--requests", requests, "--results", results, "--data_parallel", "3", ranks=2))
    assert done.returncode != 0
    assert "error: --data_parallel 3 does not divide the 2 ranks" in done.stderr
    assert done.stderr.count("error:") == 1
    # More replicas than lines.
    one_line = tmp_path / "one.jsonl"
    one_line.write_text(requests.read_text().splitlines()[0] + "\n")
    done = run(bloom(folder, "--requests", one_line, "--results", results, "--data_parallel", "2", ranks=2))
    assert done.returncode != 0
    assert "error: --data_parallel 2 is more than the 1 request(s)" in done.stderr
    # Ranks that read different request files under the same path (one per node): the check names the rank.
    for r in (0, 1):
        (tmp_path / f"rank{r}").mkdir()
        write_requests(tmp_path / f"rank{r}" / "in.jsonl", n=24 + r)
    wrapper = tmp_path / "by_rank.py"
    wrapper.write_text("import os, runpy, sys\nos.chdir(f\"rank{os.environ['RANK']}\")\n"
                       f"sys.path.insert(0, {str(ROOT)!r})\nsys.argv = sys.argv[1:]\n"
                       "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    cmd = bloom(folder, "--requests", "in.jsonl", "--results", results, "--data_parallel", "2", ranks=2)
    cmd.insert(cmd.index(str(ROOT / "bloom.py")), str(wrapper))
    done = run(cmd, cwd=tmp_path)
    assert done.returncode != 0
    assert "ranks disagree on requests file (rank 1 differs from rank 0)" in done.stderr
    assert not results.exists() and find_parts(results) == []


@pytest.mark.slow
def test_eval_over_two_replicas_gives_one_process_numbers(job, tmp_path):
    folder, _, _ = job
    passages = tmp_path / "eval.jsonl"
    passages.write_text("".join(json.dumps({"text": " ".join(WORDS[(i * j) % 13] for j in range(2 + i % 11))}) + "\n"
                                for i in range(1, 30)))
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    done = run(bloom(folder, "--eval", passages, "--results", one, "--budget", "256"))
    assert done.returncode == 0, done.stderr
    done = run(bloom(folder, "--eval", passages, "--results", two, "--budget", "256", "--data_parallel", "2", ranks=2))
    assert done.returncode == 0, done.stderr[-4000:]
    assert two.read_bytes() == one.read_bytes()


def test_the_bar_counts_the_lines_of_every_replica_as_their_parts_grow(tmp_path):
    from generation.jobs.data_parallel import _PartCounter

    results = tmp_path / "out.jsonl"
    counter = _PartCounter(results, 2)
    assert counter.lines() == 0  # no part yet
    part_path(results, 1).write_bytes(_record("a", 1) + b"\n")
    assert counter.lines() == 1
    with open(part_path(results, 0), "ab") as f:
        f.write(_record("b", 2) + b"\n" + _record("c", 3))  # the last one still being written
    assert counter.lines() == 2
    with open(part_path(results, 0), "ab") as f:
        f.write(b"\n")
    assert counter.lines() == 3


def test_a_shared_count_adds_what_every_replica_scored():
    """The eval bar's count: one key in the launch's store, added to by every replica's leader."""
    from torch.distributed import TCPStore

    from generation.jobs.data_parallel import SharedCount, launch_store

    port = free_port()
    server = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # the launcher's, here
    where = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    first, second = SharedCount(launch_store(where), "done"), SharedCount(launch_store(where), "done")
    assert first.add(3) == 3 and second.add(4) == 7 and first.value() == 7
    assert SharedCount(launch_store(where), "another job").value() == 0
    assert launch_store({}) is None  # no store: the bar counts its own rank's work
    del server


def test_replicas_take_work_from_one_queue_as_they_come_free():
    """The work queue: every item runs exactly once, the costliest first; a slow replica takes fewer
    items than a fast one (a fixed deal would give each the same cost); the follower of a replica
    of two ranks runs exactly its leader's items, in its order."""
    import threading

    from torch.distributed import TCPStore

    from bloom_hpu.data_parallel import Replicas
    from generation.jobs.data_parallel import WorkQueue, deal, launch_store

    port = free_port()
    server = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # the launcher's, here
    where = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    items, costs = list(range(12)), [float(i * 5 % 12) for i in range(12)]  # item 7 costs most, then 2
    ran: dict[int, list[int]] = {}

    def rank(world_rank: int, seconds_per_item: float) -> None:
        replicas = Replicas(world_rank // 2, 2, world_rank, None, 2)
        ran[world_rank] = []
        for item in WorkQueue(items, costs, replicas, launch_store(where), "job"):
            ran[world_rank].append(item)
            time.sleep(seconds_per_item)

    slow = {0: 0.12, 1: 0.12, 2: 0.01, 3: 0.01}  # replica 0 (ranks 0, 1) is slow, replica 1 (2, 3) fast
    threads = [threading.Thread(target=rank, args=(r, slow[r]), daemon=True) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert ran[1] == ran[0] and ran[3] == ran[2]  # followers run their leader's items
    assert sorted(ran[0] + ran[2]) == items  # every item once
    assert {ran[0][0], ran[2][0]} == {7, 2}  # the two costliest first
    assert len(ran[0]) < len(ran[2]) - 3, ran  # the fast replica took more
    fixed = deal(costs, 2)
    assert max(map(len, fixed)) - min(map(len, fixed)) <= 1  # where a deal would split them evenly
    replicas = Replicas(1, 2, 1, None, 1)
    assert list(WorkQueue(items, costs, replicas)) == [items[i] for i in fixed[1]]  # no store: the deal
    del server


@pytest.mark.slow
def test_the_eval_bar_counts_every_replicas_passages(job, tmp_path):
    """On a terminal (a pseudo-terminal here) rank 0's live bar ends at every passage of the job,
    not at its own replica's share."""
    import fcntl
    import pty
    import struct
    import termios

    folder, _, _ = job
    passages = tmp_path / "eval.jsonl"
    passages.write_text("".join(json.dumps({"text": " ".join(WORDS[(i * j) % 13] for j in range(2 + i % 11))}) + "\n"
                                for i in range(1, 30)))
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 160, 0, 0))  # 0 columns: tqdm draws nothing
    cmd = [arg for arg in bloom(folder, "--eval", passages, "--budget", "256", "--data_parallel", "2", ranks=2)
           if arg != "--quiet"]
    proc = subprocess.Popen(cmd, env=ENV, stdin=subprocess.DEVNULL, stdout=follower, stderr=follower)
    os.close(follower)
    seen = b""
    while True:
        try:
            data = os.read(leader, 65536)
        except OSError:  # the terminal closed: every process that held it ended
            break
        if not data:
            break
        seen += data
    os.close(leader)
    assert proc.wait(300) == 0, seen[-3000:]
    bars = [piece for piece in seen.decode(errors="replace").replace("\r", "\n").splitlines() if piece.startswith("eval:")]
    assert bars and "29/29" in bars[-1], bars[-3:]
