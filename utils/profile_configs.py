#!/usr/bin/env python3
"""Profile deployment configurations of a BLOOM shape on random weights, under a latency bound.

Every point of the product of --tensor_parallel_sizes, --dtypes, --max_batch_sizes and
--input_output_lengths (and the --scenario: offline, online or both) is measured on random weights
drawn in memory (no checkpoint files), then judged against --max_latency_ms and ranked by tokens/s.
Each tensor-parallel size is one launch (its ranks under the DeepSpeed launcher), each dtype one set
of weights shared by its configurations. Outputs in --out: results.csv, results.json, profile.png;
the top N printed, the best named. A rerun skips what is done. See docs/profiling.md.

    utils/profile_configs.py --model bloom-560m --tensor_parallel_sizes 1 2 --dtypes fp32 bf16 int8 \\
        --max_batch_sizes 1 4 16 --input_output_lengths 60,20 200,200 --max_latency_ms 200 --out profile
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from utils.profiling.spec import SpecError, load_spec  # noqa: E402
from utils.profiling.sweep import DTYPES, SCENARIOS, Config, parse_lengths, product  # noqa: E402

WORKER = ROOT / "utils" / "profiling" / "worker.py"


class UsageError(Exception):
    """Bad input: printed as one ``error:`` line, exit 1."""


class Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own errors, as ours: one line, exit 1
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="utils/profile_configs.py", description=__doc__.split("\n\n")[0],
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True,
                   help="a BLOOM name (bloom-560m, bloom-1b1, bloom-1b7, bloom-3b, bloom-7b1, bloom), a checkpoint's "
                   "config.json (or its folder), or a spec file, JSON or YAML, with n_layer, hidden_size, n_head, "
                   "vocab_size (and max_length, default 2048)")
    p.add_argument("--tensor_parallel_sizes", type=int, nargs="*", default=[1], metavar="N",
                   help="ranks per configuration (default 1); more than 1 runs under the DeepSpeed launcher")
    p.add_argument("--dtypes", nargs="*", default=["bf16"], metavar="D",
                   help=f"from {', '.join(DTYPES)} (int8/int4: quantized weights, activations bf16; default bf16)")
    p.add_argument("--max_batch_sizes", type=int, nargs="*", default=[1], metavar="B",
                   help="offline: the static batch; online: the server's --max_batch (default 1)")
    p.add_argument("--input_output_lengths", nargs="*", default=["60,20"], metavar="IN,OUT",
                   help="prompt and new tokens, e.g. 60,20 200,200 (default 60,20)")
    p.add_argument("--scenario", default="offline", choices=list(SCENARIOS),
                   help="offline: static batches, maximum throughput; online: the server under a concurrency "
                   "sweep of closed-loop clients (1, 2, 4 ... max_batch); both (default offline)")
    p.add_argument("--max_latency_ms", type=float,
                   help="the latency bound, in ms. Offline: the time per generated token (the decode step); "
                   "online: the inter-token latency p99 AND the time to first token p99. Configurations over it "
                   "are listed as rejected, with why (default: no bound)")
    p.add_argument("--out", default="profile", help="folder of results.csv, results.json, profile.png (default profile)")
    p.add_argument("--top", type=int, default=10, help="rows of the printed table (default 10)")
    p.add_argument("--threads", type=int, help="CPU threads in all, split among the ranks (default: the cores)")
    p.add_argument("--device", help="cpu, cuda or hpu (default: the best available)")
    p.add_argument("--speculate", nargs="*", default=["off"], metavar="S",
                   help="offline: speculation as another axis, e.g. off ngram:4 (prompt lookup, up to 4 guesses "
                   "verified a pass; default off)")
    p.add_argument("--repeats", type=int, default=3,
                   help="offline: the most timed rounds (a one-token and a full request each) per configuration, "
                   "medians kept (default 3)")
    p.add_argument("--min_repeats", type=int, default=1, help="offline: the fewest timed rounds (default 1)")
    p.add_argument("--min_timed_s", type=float, default=10.0,
                   help="offline: rounds stop once the full requests timed add up to this many seconds "
                   "(default 10; 0: --min_repeats rounds)")
    p.add_argument("--spread", type=float, default=0.05,
                   help="offline: or once two rounds or more agree within this fraction of their median (default 0.05)")
    p.add_argument("--warmup", type=int, default=1,
                   help="offline: untimed warm-ups (a prompt and a decode step: every shape the timed requests run; "
                   "default 1)")
    p.add_argument("--requests_per_client", type=int, default=2,
                   help="online: requests per client at each level (at least 4 a level; default 2)")
    p.add_argument("--bucket_width", type=int, default=32, help="online: the server's --bucket_width (default 32)")
    p.add_argument("--prefix_cache", default="0", help="the prefix cache's pool, e.g. 1GB (default 0: none)")
    p.add_argument("--seed", type=int, default=0, help="of the random weights (default 0)")
    return p


# --------------------------------------------------------------------------- checking the input


def check_args(args) -> tuple[object, list[Config]]:
    """The spec and the sweep, or UsageError for anything that cannot run."""
    try:
        spec = load_spec(args.model)
    except SpecError as error:
        raise UsageError(str(error)) from None
    for name, values in (("--tensor_parallel_sizes", args.tensor_parallel_sizes), ("--dtypes", args.dtypes),
                         ("--max_batch_sizes", args.max_batch_sizes),
                         ("--input_output_lengths", args.input_output_lengths)):
        if not values:
            raise UsageError(f"the sweep is empty: {name} has no values")
    unknown = [d for d in args.dtypes if d not in DTYPES]
    if unknown:
        raise UsageError(f"unknown dtype {unknown[0]!r}: choose from {', '.join(DTYPES)}")
    if min(args.tensor_parallel_sizes) < 1 or min(args.max_batch_sizes) < 1:
        raise UsageError("tensor-parallel and batch sizes must be >= 1")
    if args.top < 1 or args.repeats < 1 or args.warmup < 0 or args.requests_per_client < 1 or args.bucket_width < 0:
        raise UsageError("--top, --repeats and --requests_per_client must be >= 1, --warmup and --bucket_width >= 0")
    if not 1 <= args.min_repeats <= args.repeats or args.min_timed_s < 0 or args.spread < 0:
        raise UsageError("--min_repeats must be from 1 to --repeats, --min_timed_s and --spread >= 0")
    args.speculate = speculations(args.speculate)
    if args.threads is not None and args.threads < 1:
        raise UsageError("--threads must be >= 1")
    for tp in args.tensor_parallel_sizes:
        if spec.n_head % tp:
            divisors = [n for n in range(1, spec.n_head + 1) if spec.n_head % n == 0]
            raise UsageError(f"the model's {spec.n_head} attention heads do not divide into {tp} tensor-parallel "
                             f"ranks; use sizes that divide {spec.n_head}: {', '.join(map(str, divisors))}")
    if "int4" in args.dtypes:
        from bloom_hpu.int4 import DEFAULT_GROUP_SIZE

        for tp in args.tensor_parallel_sizes:
            if (spec.hidden_size // tp) % DEFAULT_GROUP_SIZE:
                raise UsageError(f"int4 keeps a scale per {DEFAULT_GROUP_SIZE} weights of a rank's part of a row: "
                                 f"hidden_size {spec.hidden_size} / {tp} ranks is not a multiple of it")
    lengths = []
    for text in args.input_output_lengths:
        try:
            n_in, n_out = parse_lengths(text)
        except ValueError as error:
            raise UsageError(str(error)) from None
        if n_in + n_out > spec.max_length:
            raise UsageError(f"--input_output_lengths {text}: {n_in} + {n_out} tokens is past the model's maximum "
                             f"length {spec.max_length}")
        lengths.append((n_in, n_out))
    from generation.run.prefix_pool import parse_size

    try:
        args.prefix_cache_bytes = parse_size(args.prefix_cache)
    except ValueError as error:
        raise UsageError(f"--prefix_cache: {error}") from None
    if max(args.tensor_parallel_sizes) > 1:
        import importlib.util

        if importlib.util.find_spec("deepspeed") is None:
            raise UsageError("tensor-parallel sizes above 1 run under the DeepSpeed launcher; install deepspeed "
                             "(pip install -r requirements.txt)")
    return spec, product(args.scenario, args.tensor_parallel_sizes, args.dtypes, args.max_batch_sizes, lengths,
                         args.speculate)


def speculations(values: list[str]) -> list[str]:
    """--speculate's values as the library names them ("off", "ngram:4"), or UsageError."""
    from generation.search.guesses import SpeculationError, parse_speculation

    if not values:
        raise UsageError("the sweep is empty: --speculate has no values")
    named = []
    for value in values:
        try:
            speculation = parse_speculation(value)
        except SpeculationError as error:
            raise UsageError(f"--speculate: {error}") from None
        if speculation is not None and speculation.kind != "ngram":
            raise UsageError(f"--speculate {value}: the profiler speculates by prompt lookup (ngram[:K]); a draft "
                             "model is another model to profile")
        named.append("off" if speculation is None else f"{speculation.kind}:{speculation.k}")
    return list(dict.fromkeys(named))


def prepare_out(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".writable"
        probe.write_text("")
        probe.unlink()
    except OSError as error:
        raise UsageError(f"--out {out}: cannot write there ({error.strerror or error})") from None


# --------------------------------------------------------------------------- what was done before


def load_records(out: Path, shape: dict) -> list[dict]:
    """The records of an earlier run in ``out`` (results.json), if it profiled the same shape."""
    path = out / "results.json"
    if not path.is_file():
        return []
    try:
        earlier = json.loads(path.read_text())
    except json.JSONDecodeError:
        raise UsageError(f"{path} is not valid JSON (delete it to start over)") from None
    if earlier.get("model") != shape:
        raise UsageError(f"{out} holds a profile of another model ({earlier.get('model')}); give another --out")
    # A failed configuration is tried again; the others are done.
    return [r for r in earlier.get("records", []) if r.get("status") != "failed"]


# --------------------------------------------------------------------------- the machine


def machine(device: str | None) -> dict:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    info = {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform(), "device": device or "auto"}
    from bloom_hpu.runtime.cpu.capability import detect

    capability = detect()
    info["cpu_isa"] = capability.isa + (" + AMX" if capability.amx else "")
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for package in ("torch", "deepspeed", "transformers", "tokenizers"):
        try:
            out[package] = version(package)
        except PackageNotFoundError:
            out[package] = None
    return out


# --------------------------------------------------------------------------- launching


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(tp: int, plan_path: Path, args) -> subprocess.Popen:
    """One tensor-parallel size: the worker alone, or its ranks under the DeepSpeed launcher."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if args.threads:
        env["OMP_NUM_THREADS"] = str(max(1, args.threads // tp))
    if tp == 1:
        command = [sys.executable, str(WORKER), str(plan_path)]
    else:
        command = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(tp),
                   "--master_port", str(free_port()), str(WORKER), str(plan_path)]
    # Its own process group, so a Ctrl-C here ends every rank (see stop()).
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=sys.stderr, start_new_session=True)


def stop(process: subprocess.Popen) -> None:
    import signal

    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def confirm_command(spec, row: dict, threads: int | None) -> str | None:
    """The command that measures ``row``'s configuration with bench/generate_bench.py directly (its
    own random checkpoint of the recipe on disk, or the checkpoint the spec came from), for a
    by-hand check that the two agree within noise; None where generate_bench cannot run it (online,
    tensor-parallel, speculating, or a shape it has no checkpoint of)."""
    from bench.generate_bench import SHAPES

    if row["scenario"] != "offline" or row["tp"] != 1 or row.get("speculate", "off") != "off":
        return None
    folder = Path(spec.tokenizer_dir) if spec.tokenizer_dir else None  # the checkpoint the spec came from
    if spec.name in SHAPES:
        config = spec.name
    elif folder is not None and (any(folder.glob("*.safetensors")) or any(folder.glob("*.bin"))):
        config = str(folder)
    else:
        return None
    dtype = "fp32" if row["dtype"] == "fp32" else "bf16"
    variant = "ours" if row["dtype"] in ("fp32", "bf16") else f"ours+{row['dtype']}"
    command = ["python", "bench/generate_bench.py", "--config", config, "--dtype", dtype, "--batch_size",
               row["max_batch"], "--prompt_len", row["input_len"], "--new_tokens", row["output_len"], "--max_length",
               row["input_len"] + row["output_len"], "--variants", variant, "--repeats", 3]
    return shlex.join(map(str, command + (["--threads", threads] if threads else [])))


class Clock:
    """The sweep's time: estimated before it starts (``estimate.py``), then rescaled as it goes by
    how the finished configurations compared with their estimates."""

    def __init__(self, shape: dict, todo: list[dict], timing: dict, args):
        from utils.profiling import estimate

        self.todo = {c["key"]: c for c in todo}
        self.rates = None
        self.device = args.device or "cpu"
        self.estimate = {"configs": {}, "startup": 0.0, "total": 0.0}
        if todo:
            import torch

            if args.threads:
                torch.set_num_threads(args.threads)
            try:
                self.rates = estimate.machine_rates(self.device)
            except (RuntimeError, ImportError):  # a device this process cannot reach (hpu before its bridge)
                self.rates = None
            else:
                self.estimate = estimate.sweep_seconds(shape, todo, timing, self.rates, shared=self.device == "cpu")
        self.started = time.perf_counter()
        self.done_estimated = self.done_measured = 0.0

    def describe(self) -> dict:
        return {"seconds": round(self.estimate["total"]), "rates": self.rates,
                "configs_s": {k: round(v, 1) for k, v in self.estimate["configs"].items()}}

    def announce(self) -> str:
        from utils.profiling.estimate import minutes

        if not self.todo:
            return "nothing to measure"
        if self.rates is None:
            return f"no estimate of the time: the rates could not be measured on {self.device}"
        r = self.rates
        return (f"estimate: about {minutes(self.estimate['total'])} for {len(self.todo)} configurations "
                f"({minutes(self.estimate['startup'])} of launches and weights; from {r['read_bytes_s'] / 1e9:.1f} GB/s "
                f"read and {r['ops_s']['bfloat16'] / 1e9:.0f}/{r['ops_s']['float32'] / 1e9:.0f} GFLOP/s bf16/fp32 "
                f"measured now; rough: rescaled as configurations finish)")

    def progress(self, record: dict) -> str:
        from utils.profiling.estimate import minutes

        estimated = self.estimate["configs"].pop(record["key"], None)
        if estimated is not None and record.get("wall_s") is not None:
            self.done_estimated += estimated
            self.done_measured += record["wall_s"]
        so_far = f"{minutes(time.perf_counter() - self.started)} so far"
        if self.rates is None:
            return so_far
        scale = self.done_measured / self.done_estimated if self.done_estimated else 1.0
        return f"{so_far}, about {minutes(sum(self.estimate['configs'].values()) * scale)} left"


def run(args) -> int:
    from utils.profiling.random_model import write_model_folder
    from utils.profiling.report import table, write_outputs

    spec, configs = check_args(args)
    out = Path(args.out)
    prepare_out(out)
    shape = spec.shape()
    records = load_records(out, shape)
    done = {r["key"] for r in records}
    todo = [c for c in configs if c.key not in done]
    log(f"{len(configs)} configurations, {len(configs) - len(todo)} done before, {len(todo)} to measure")
    meta = {"command": shlex.join([Path(sys.argv[0]).name] + sys.argv[1:]), "model": shape,
            "versions": versions(), "machine": machine(args.device),
            "title": f"{spec.name}: {spec.n_layer} layers x {spec.hidden_size} hidden, {spec.n_head} heads, "
                     f"vocab {spec.vocab_size}"}
    work = out / "work"
    model_dir = work / "model"
    write_model_folder(model_dir, spec.config(), spec.tokenizer_dir)
    in_sweep = {c.key for c in configs}
    timing = {"repeats": args.repeats, "min_repeats": args.min_repeats, "min_timed_s": args.min_timed_s,
              "spread": args.spread, "warmup": args.warmup, "requests_per_client": args.requests_per_client}
    clock = Clock(shape, [c.to_dict() for c in todo], timing, args)
    meta["estimate"] = clock.describe()
    log(clock.announce())

    def publish() -> list[dict]:
        return write_outputs(out, records, meta, args.max_latency_ms, args.top)

    try:
        for tp in dict.fromkeys(c.tp for c in todo):
            mine = [c.to_dict() for c in todo if c.tp == tp]
            records_path = work / f"records-tp{tp}.jsonl"
            records_path.write_text("")
            plan = {**timing, "device": args.device, "model_dir": str(model_dir), "spec": shape, "configs": mine,
                    "records": str(records_path), "bucket_width": args.bucket_width,
                    "prefix_cache_bytes": args.prefix_cache_bytes, "seed": args.seed,
                    "threads": max(1, args.threads // tp) if args.threads else None}
            plan_path = work / f"plan-tp{tp}.json"
            plan_path.write_text(json.dumps(plan, indent=2))
            log(f"tensor parallel {tp}: {len(mine)} configurations")
            process = launch(tp, plan_path, args)
            seen = 0
            try:
                while True:
                    finished = process.poll() is not None
                    lines = records_path.read_text().splitlines()
                    for line in lines[seen:]:
                        records.append(json.loads(line))
                        log(f"done {records[-1]['key']} ({records[-1]['status']}; "
                            f"{len(records)}/{len(configs)} recorded; {clock.progress(records[-1])})")
                        publish()  # the table so far: an interruption keeps it
                    seen = len(lines)
                    if finished:
                        break
                    time.sleep(0.5)
            finally:
                stop(process)
            if process.returncode != 0:
                got = {r["key"] for r in records}
                for config in mine:
                    if config["key"] not in got:
                        records.append({**config, "status": "failed",
                                        "reason": f"the tp-{tp} launch ended with exit code {process.returncode}"})
                publish()
    except KeyboardInterrupt:
        log("interrupted: what finished is in the results; run again to measure the rest")
        publish()
        return 130
    rows = [r for r in publish() if r["key"] in in_sweep]
    print(table(rows, args.top))
    best = rows[0] if rows and rows[0]["status"] == "ok" else None
    if best is not None:
        command = confirm_command(spec, best, args.threads)
        log(f"confirm the best by hand (generate_bench, docs/profiling.md): {command}" if command else
            "the best cannot be rerun by bench/generate_bench.py (online, tensor-parallel, speculating or a shape "
            "it has no checkpoint of): see docs/profiling.md")
    log(f"results: {out / 'results.csv'}, {out / 'results.json'}, {out / 'profile.png'}")
    return 0


def main(argv=None) -> int:
    try:
        return run(build_parser().parse_args(argv))
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
