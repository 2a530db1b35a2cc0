#!/usr/bin/env python3
"""Ours against llama.cpp and CTranslate2 on the same CPU, the same checkpoint and the same token ids.

One random BLOOM checkpoint (``utils/random_checkpoint.py``; bloom-560m's shape by default) is
converted with each peer's own converter, then every engine runs the same requests, given as token
ids (so no tokenizer is involved on the peers' side), with the same number of threads, each
engine in its own process (their thread pools never share one), one after the other:

* **first token, 16-token prompt** (``first16 ms``): a request for 1 new token after a 16-token
  prompt: prefill and the first token, back as an id;
* **batch-1 decode** (``decode ms/tok``): (a request for ``--decode_tokens`` (64) new tokens after
  the same prompt − the first-token request) / (``--decode_tokens`` − 1): greedy, EOS ignored;
* **128-token prompt** (``prompt128 ms``): a request for 1 new token after a 128-token prompt
  (prefill to the first logits, plus the argmax);
* **batch 8** (``batch8 tok/s``): 8 different 16-token prompts in one batch, 32 new tokens each:
  8 × 32 / the request's time.

Every figure is a median of ``--repeats`` (5) timed requests after ``--warmup`` (1) untimed ones;
within one engine and format the four requests go round-robin, so a drift in the machine's load
hits them alike. The engines cannot be interleaved (one process each); ``--rounds 2`` runs the
engines a second time in the reverse order and pools the samples.

Weight formats (``--formats``), each against the peers' format of the same weight width:

| format | ours (``Generator.from_pretrained``) | llama.cpp | CTranslate2 |
| --- | --- | --- | --- |
| ``fp32`` | ``dtype="fp32"`` | F32 (``convert_hf_to_gguf.py --outtype f32``) | ``float32`` |
| ``bf16`` | ``dtype="bf16"`` | BF16 (``--outtype bf16``) | none: no bfloat16 on a CPU |
| ``int8`` | ``quantize="int8"`` (``--quant_dtype`` activations) | Q8_0 (``--outtype q8_0``) | ``int8`` |
| ``int4`` | ``quantize="int4", group_size=32`` | Q4_0, every weight (``llama_model_quantize``, ``pure``) | none on a CPU |
| ``int8i``, ``int4i`` | the same with ``int8_activations=True`` (integer products) | Q8_0, Q4_0 | ``int8``, none |

A format whose ``int8_activations`` keyword this checkout does not take yet is skipped with a note.
``--ours_extra k=v,...`` passes more keywords to ours' ``from_pretrained`` (``cpu_path=avx2``
becomes ``cpu=CpuOptions(path="avx2")``). Ours' routes are those measured on this machine (the
library's default, ``CpuOptions(choice="measure")``, whatever ``$BLOOM_CPU_CHOICE`` says; the first
run of a format times them, before its figures; ``--ours_extra cpu_choice=static`` asks for the rule
of thumb), and the table says which were picked. Ours runs with ``bucket_width`` ``--bucket_width`` (16):
a prompt is padded to a multiple of 16, not to ``max_length`` (0: the static shapes of the CLI's
default, ``max_length`` = prompt + new tokens).

The converters:

* CTranslate2: ``ctranslate2.converters.TransformersConverter`` with ``quantization=float32|int8``
  (``pip install ctranslate2==4.8.5``); CTranslate2 takes tokens as strings, so each id is passed
  as its string in the converted ``vocabulary.json``. ``end_token`` is an unused padded id, so EOS
  is an ordinary token, as ``ignore_eos`` makes it for ours.
* llama.cpp: ``pip install llama-cpp-python`` builds llama.cpp on this machine; its converter,
  ``convert_hf_to_gguf.py`` with its ``conversion/`` and ``gguf-py/``, is taken from the same
  version's source package (``pip download --no-binary :all: llama-cpp-python==VERSION``, once,
  under ``--work``; ``--llama_cpp_src DIR`` names a llama.cpp source tree instead). The converter
  refuses a BPE tokenizer whose pre-tokenizer hash it does not know, and the checkpoint's tokenizer
  (a BLOOM-style byte-level BPE trained on a few KB, ``utils/bloom_tokenizer.py``) is one: the bench
  runs the converter with ``TextModel.get_vocab_base_pre`` returning ``"bloom"`` (the same
  pre-tokenizer: BLOOM's split, then bytes). Only the vocabulary's entry changes, and no tokenizer
  runs on llama.cpp's side: it is given ids. Requests go through the low-level API: one
  ``llama_batch`` holds every sequence's prompt (logits at each last token), then one token per
  sequence per step; greedy is the argmax of the returned logits (numpy).

The fp32 tokens are checked: ours, llama.cpp F32 and CTranslate2 float32 must give the same greedy
tokens (up to an EOS) for the decode and the batch-8 requests; other formats' agreement is printed.
The table names the CPU (model name, AVX2 / AVX512-BF16 / AMX flags) and the load average before
and after. The machine is shared: compare ratios, and rerun where the load was high.

    python bench/peers_bench.py                                   # bloom-560m shape, all formats
    python bench/peers_bench.py --shape 256,2,4 --repeats 2 --decode_tokens 16   # a smoke run
    python bench/peers_bench.py --formats int8,int8i,int4,int4i --engines ours,llama.cpp
"""

from __future__ import annotations

import argparse
import ast
import gc
import importlib.metadata
import json
import os
import shlex
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ENGINES = ("ours", "llama.cpp", "ctranslate2")
FORMATS = ("fp32", "bf16", "int8", "int4", "int8i", "int4i")
SHAPES = {"bloom-560m": (250880, 1024, 24, 16)}  # vocab, hidden, layers, heads
# The peers' format for each of ours (None: the peer has no such format on a CPU).
LLAMA_FORMAT = {"fp32": "F32", "bf16": "BF16", "int8": "Q8_0", "int4": "Q4_0"}
CT2_FORMAT = {"fp32": "float32", "bf16": None, "int8": "int8", "int4": None}
METRICS = ("first16_ms", "decode_ms_per_token", "prompt128_ms", "batch8_tokens_per_s")
HEADER = {"first16_ms": "first token, 16-token prompt (ms)", "decode_ms_per_token": "batch-1 decode (ms/token)",
          "prompt128_ms": "128-token prompt (ms)", "batch8_tokens_per_s": "batch 8 (tokens/s)"}
EOS = 2


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def weight_format(fmt: str) -> str:
    """The weight format a row compares at: ``int8i`` -> ``int8``."""
    return fmt[:-1] if fmt.endswith("i") else fmt


# --------------------------------------------------------------------------- the machine


def cpu_description() -> dict:
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model, flags = "unknown CPU", set()
    for line in info.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and model == "unknown CPU":
            model = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    isa = [f for f in ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8") if f in flags]
    caps = {name: os.environ[name] for name in ISA_CAPS if os.environ.get(name)}
    return {"model": model, "isa": isa, "cpus": os.cpu_count(), "caps": caps, "llama.cpp": llama_features()}


# The switches that make each engine run below this CPU's instruction set (an AVX2-only CPU, or an
# AVX-512 one without AMX, emulated on a Xeon with AMX): PyTorch's own kernels, oneDNN (also our AMX
# tiles: bloom_hpu/runtime/cpu/capability.py), MKL (PyTorch's fp32 GEMM) and CTranslate2 (CT2_USE_MKL=0:
# its oneDNN GEMMs, as on an AMD CPU). llama.cpp's instruction set is fixed when it is built
# (GGML_NATIVE=OFF GGML_AVX512=OFF ...).
ISA_CAPS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "CT2_FORCE_CPU_ISA", "CT2_USE_MKL")


def llama_features() -> str | None:
    """The instruction sets the importable llama.cpp was built for (its system info), or None."""
    try:
        import llama_cpp
    except ImportError:
        return None
    info = llama_cpp.llama_print_system_info()
    info = info.decode() if isinstance(info, bytes) else info
    return " ".join(part.strip() for part in info.split("|") if part.strip().endswith("= 1")) or info.strip()


def load_average() -> tuple[float, float, float]:
    return tuple(float(x) for x in Path("/proc/loadavg").read_text().split()[:3])


def versions() -> dict:
    out = {}
    for name, dist in (("torch", "torch"), ("transformers", "transformers"), ("llama-cpp-python", "llama_cpp_python"),
                       ("ctranslate2", "ctranslate2")):
        try:
            out[name] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


# --------------------------------------------------------------------------- checkpoint, prompts, conversions


def parse_shape(text: str) -> tuple[str, tuple[int, int, int, int]]:
    if text in SHAPES:
        return text, SHAPES[text]
    try:
        hidden, layers, heads = (int(x) for x in text.split(","))
    except ValueError:
        raise SystemExit(f"error: --shape is {', '.join(SHAPES)} or HIDDEN,LAYERS,HEADS; got {text!r}")
    return f"h{hidden}-l{layers}-n{heads}", (250880, hidden, layers, heads)


def checkpoint(work: Path, shape: str) -> Path:
    """The random float32 checkpoint of ``shape`` under ``work`` (written once, seed 0)."""
    name, (vocab, hidden, layers, heads) = parse_shape(shape)
    out = work / name / "hf"
    if not (out / "model.safetensors").exists():
        from utils.random_checkpoint import make_random_checkpoint

        log(f"writing a random {name} checkpoint to {out} (once)")
        make_random_checkpoint(out, vocab_size=vocab, hidden_size=hidden, n_layer=layers, n_head=heads)
    return out


def prompts(folder: Path) -> dict:
    """The requests' prompts, as text (ours) and token ids (the peers): text that re-encodes to
    exactly those ids, cut from the corpus as ``bench/generate_bench.py`` does."""
    from bench.generate_bench import make_prompts
    from generation.run.batch import BloomTokenizer

    tok = BloomTokenizer(folder)
    texts = {"p16": make_prompts(tok, 1, 16), "p128": make_prompts(tok, 1, 128), "b8": make_prompts(tok, 8, 16)}
    return {k: [{"text": t, "ids": tok.encode(t)} for t in v] for k, v in texts.items()}


def llama_cpp_source(work: Path, given: str | None) -> Path:
    """A llama.cpp source tree with convert_hf_to_gguf.py: ``given``, or the installed
    llama-cpp-python version's source package, downloaded and unpacked once under ``work``."""
    if given:
        return Path(given)
    version = importlib.metadata.version("llama_cpp_python")
    out = work / f"llama.cpp-src-{version}"
    if (out / "convert_hf_to_gguf.py").exists():
        return out
    with tempfile.TemporaryDirectory() as tmp:
        log(f"downloading llama-cpp-python {version}'s source package for llama.cpp's converter (once)")
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", tmp,
                        f"llama-cpp-python=={version}"], check=True, stdout=subprocess.DEVNULL)
        sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        keep = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/", "LICENSE")
        with tarfile.open(sdist) as tar:
            members = []
            for m in tar.getmembers():
                parts = m.name.split("/vendor/llama.cpp/", 1)
                if len(parts) == 2 and parts[1].startswith(keep) and (m.isfile() or m.isdir()):
                    m.name = parts[1]
                    members.append(m)
            tmp_out = out.with_name(out.name + ".part")
            tar.extractall(tmp_out, members=members, filter="data")
        tmp_out.rename(out)
    return out


# Runs llama.cpp's converter with our tokenizer registered as its "bloom" pre-tokenizer.
CONVERT_GGUF = """
import runpy, sys
src = sys.argv.pop(1)
sys.path.insert(0, src)
sys.path.insert(1, src + "/gguf-py")
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "bloom"
sys.argv[0] = src + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""

QUANTIZE_Q4_0 = """
import sys, llama_cpp as L
params = L.llama_model_quantize_default_params()
params.ftype = L.LLAMA_FTYPE_MOSTLY_Q4_0
params.pure = True  # every weight Q4_0, the token embeddings (also the output) too
params.nthread = int(sys.argv[3])
rc = L.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), params)
sys.exit(rc)
"""


def run_quiet(cmd: list[str], what: str, env=None) -> None:
    t = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode:
        raise RuntimeError(f"{what} failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-4000:]}")
    log(f"{what}: {time.perf_counter() - t:.0f} s")


def convert_llama(folder: Path, fmt: str, src: Path, threads: int) -> Path:
    out = folder.parent / f"gguf-{LLAMA_FORMAT[fmt]}{'-pure' if fmt == 'int4' else ''}.gguf"
    if out.exists():
        return out
    part = out.with_suffix(".part")
    if fmt == "int4":
        f32 = convert_llama(folder, "fp32", src, threads)
        run_quiet([sys.executable, "-c", QUANTIZE_Q4_0, str(f32), str(part), str(threads)],
                  f"llama.cpp: llama_model_quantize Q4_0 pure -> {out.name}")
    else:
        outtype = {"fp32": "f32", "bf16": "bf16", "int8": "q8_0"}[fmt]
        run_quiet([sys.executable, "-c", CONVERT_GGUF, str(src), str(folder), "--outtype", outtype,
                   "--outfile", str(part)], f"llama.cpp: convert_hf_to_gguf.py --outtype {outtype} -> {out.name}")
    part.rename(out)
    return out


CONVERT_CT2 = """
import sys, ctranslate2
ctranslate2.converters.TransformersConverter(sys.argv[1]).convert(sys.argv[2], quantization=sys.argv[3], force=True)
"""


def convert_ct2(folder: Path, fmt: str) -> Path:
    quantization = CT2_FORMAT[fmt]
    out = folder.parent / f"ct2-{quantization}"
    if (out / "model.bin").exists():
        return out
    part = out.with_name(out.name + ".part")
    run_quiet([sys.executable, "-c", CONVERT_CT2, str(folder), str(part), quantization],
              f"CTranslate2: TransformersConverter quantization={quantization} -> {out.name}")
    part.rename(out)
    return out


# --------------------------------------------------------------------------- the engines (each in its own process)


def ours_keywords(spec: dict, fmt: str) -> dict:
    """Ours' ``from_pretrained`` keywords for ``fmt``, with ``cpu``: the ``CpuOptions`` keywords.
    The routes are always measured on this machine (``choice="measure"``, the library's default,
    whatever ``$BLOOM_CPU_CHOICE`` says, as the test suite sets it to 'static'), unless
    ``--ours_extra cpu_choice=...`` asks otherwise; ``cpu_path=...`` picks the CPU path."""
    kwargs = dict(spec["ours_extra"])
    kwargs["cpu"] = {"choice": kwargs.pop("cpu_choice", "measure")}
    if "cpu_path" in kwargs:
        kwargs["cpu"]["path"] = kwargs.pop("cpu_path")
    base = weight_format(fmt)
    if base in ("fp32", "bf16"):
        kwargs["dtype"] = base
    else:
        kwargs.setdefault("dtype", spec["quant_dtype"])
        kwargs["quantize"] = base
        kwargs["group_size"] = spec["group_size"] if base == "int4" else None
    if fmt.endswith("i"):
        kwargs["int8_activations"] = True
    return kwargs


def routes_of(describe: str | None) -> str | None:
    """The routes ours picked, from its load line's end ('prompts native, decode weight-only (measured)')."""
    if not describe or "; routes " not in describe:
        return None
    return describe.rsplit("; routes ", 1)[1]


class Ours:
    name = "ours"

    def __init__(self, spec: dict, fmt: str):
        import torch

        from bloom_hpu.runtime.cpu import CpuOptions
        from generation.generator import Generator
        from generation.request.options import build_options

        self.build_options = build_options
        torch.set_num_threads(spec["threads"])
        kwargs = ours_keywords(spec, fmt)
        kwargs["cpu"] = CpuOptions(**kwargs.pop("cpu"))
        self.gen = Generator.from_pretrained(spec["folder"], **kwargs)
        self.text = {tuple(p["ids"]): p["text"] for group in spec["prompts"].values() for p in group}
        self.bucket = spec["bucket_width"]
        shown = {k: v for k, v in kwargs.items() if k != "cpu"}
        import generation

        tree = Path(generation.__file__).resolve().parent.parent
        self.describe = (f"{tree}: Generator.from_pretrained({', '.join(f'{k}={v!r}' for k, v in shown.items())}); "
                         f"bucket_width {self.bucket}; {self.gen.backend.fast_path}")

    def generate(self, ids: list[list[int]], n: int) -> list[list[int]]:
        opts = self.build_options(max_length=max(map(len, ids)) + n, max_new_tokens=n, ignore_eos=True,
                                  bucket_width=self.bucket)
        results = self.gen.generate([self.text[tuple(p)] for p in ids], opts)
        return [r.sequences[0].token_ids for r in results]


class LlamaCpp:
    name = "llama.cpp"

    def __init__(self, spec: dict, fmt: str):
        import numpy as np
        import llama_cpp as L

        self.L, self.np = L, np
        path = spec["gguf"][weight_format(fmt)]
        L.llama_backend_init()
        self._quiet = L.llama_log_callback(lambda level, text, data: None)  # kept: llama.cpp holds the pointer
        L.llama_log_set(self._quiet, None)
        mparams = L.llama_model_default_params()
        info = llama_features() or ""
        # llama.cpp's AMX buffers (Q4_0, Q8_0 on a CPU with AMX-INT8) die on an illegal instruction
        # here (tilezero before any tile configuration, llama-cpp-python 0.3.36 in a KVM guest with
        # AMX); without extra buffer types (its AMX and its REPACK layouts) it runs.
        quantized = weight_format(fmt) in ("int8", "int4")
        extra = {"on": True, "off": False}.get(spec["llama_extra_bufts"],
                                               not (quantized and "AMX_INT8 = 1" in info))
        mparams.use_extra_bufts = extra
        self.model = L.llama_model_load_from_file(path.encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        longest = max(len(p["ids"]) for group in spec["prompts"].values() for p in group)
        need = longest + max(spec["decode_tokens"], spec["batch_new"]) + 8
        self.contexts = {}
        for seqs in (1, len(spec["prompts"]["b8"])):
            c = L.llama_context_default_params()
            c.n_ctx = need * seqs
            c.n_batch = c.n_ubatch = max(512, need * seqs)
            c.n_seq_max = seqs
            c.n_threads = c.n_threads_batch = spec["threads"]
            ctx = L.llama_init_from_model(self.model, c)
            if not ctx:
                raise RuntimeError("llama.cpp could not make a context")
            self.contexts[seqs] = (ctx, L.llama_batch_init(c.n_batch, 0, seqs))
        self.describe = (f"{Path(path).name}, use_extra_bufts={extra} (its AMX and REPACK layouts, as built), n_threads {spec['threads']}; "
                         f"{info}").strip()

    def _clear(self, ctx) -> None:
        L = self.L
        if hasattr(L, "llama_memory_clear"):
            L.llama_memory_clear(L.llama_get_memory(ctx), True)
        else:
            L.llama_kv_self_clear(ctx)

    def generate(self, ids: list[list[int]], n: int) -> list[list[int]]:
        L, np = self.L, self.np
        ctx, batch = self.contexts[len(ids)]
        self._clear(ctx)
        # The prompts: every sequence's tokens in one batch, logits at each one's last token.
        k = 0
        for s, prompt in enumerate(ids):
            for pos, token in enumerate(prompt):
                batch.token[k], batch.pos[k], batch.n_seq_id[k] = token, pos, 1
                batch.seq_id[k][0] = s
                batch.logits[k] = pos == len(prompt) - 1
                k += 1
        batch.n_tokens = k
        out = [[] for _ in ids]
        for step in range(n):
            if L.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
            logits = np.ctypeslib.as_array(L.llama_get_logits(ctx), shape=(len(ids), self.n_vocab))
            tokens = logits.argmax(axis=1).tolist()
            for s, t in enumerate(tokens):
                out[s].append(t)
            if step == n - 1:
                break
            for s, t in enumerate(tokens):
                batch.token[s], batch.pos[s], batch.n_seq_id[s] = t, len(ids[s]) + step, 1
                batch.seq_id[s][0] = s
                batch.logits[s] = True
            batch.n_tokens = len(ids)
        return out


class CTranslate2:
    name = "ctranslate2"

    def __init__(self, spec: dict, fmt: str):
        import ctranslate2

        path = spec["ct2"][weight_format(fmt)]
        compute = CT2_FORMAT[weight_format(fmt)]
        self.gen = ctranslate2.Generator(path, device="cpu", compute_type=compute,
                                         intra_threads=spec["threads"], inter_threads=1)
        self.vocab = json.loads((Path(path) / "vocabulary.json").read_text())
        self.end = [len(self.vocab) - 1]  # a padded id, never generated: EOS is an ordinary token
        self.describe = f"{Path(path).name}, compute_type {compute}, intra_threads {spec['threads']}"

    def generate(self, ids: list[list[int]], n: int) -> list[list[int]]:
        results = self.gen.generate_batch([[self.vocab[i] for i in p] for p in ids], max_length=n, beam_size=1,
                                          sampling_topk=1, include_prompt_in_result=False, end_token=self.end)
        return [r.sequences_ids[0] for r in results]


ENGINE_CLASSES = {"ours": Ours, "llama.cpp": LlamaCpp, "ctranslate2": CTranslate2}


def engine_formats(engine: str, formats: list[str]) -> list[str]:
    if engine == "ours":
        return formats
    table = LLAMA_FORMAT if engine == "llama.cpp" else CT2_FORMAT
    seen = []
    for f in formats:  # int8i runs against the same peer format as int8: once
        if table.get(weight_format(f)) and weight_format(f) not in seen:
            seen.append(weight_format(f))
    return seen


def measure(engine, spec: dict) -> dict:
    """Warm-up, then the four requests round-robin, ``repeats`` times; the samples in seconds."""
    p16 = [spec["prompts"]["p16"][0]["ids"]]
    p128 = [spec["prompts"]["p128"][0]["ids"]]
    b8 = [p["ids"] for p in spec["prompts"]["b8"]]
    n_dec, n_b8 = spec["decode_tokens"], spec["batch_new"]
    requests = {"first16": (p16, 1), "decode": (p16, n_dec), "prompt128": (p128, 1), "batch8": (b8, n_b8)}
    tokens = {}
    for name, (ids, n) in requests.items():
        for _ in range(spec["warmup"]):
            got = engine.generate(ids, n)
        if spec["warmup"] == 0:
            got = engine.generate(ids, n)
        if name in ("decode", "batch8"):
            tokens[name] = got
    samples = {name: [] for name in requests}
    names = list(requests)
    for r in range(spec["repeats"]):
        for name in names[r % len(names):] + names[: r % len(names)]:
            ids, n = requests[name]
            start = time.perf_counter()
            engine.generate(ids, n)
            samples[name].append(time.perf_counter() - start)
    return {"samples": samples, "tokens": tokens}


def ours_tree(work: Path, rev: str) -> Path:
    """``rev`` of this repository, exported once under ``work`` (git archive: the index and the
    working tree are not touched)."""
    sha = subprocess.run(["git", "rev-parse", "--short=12", rev], cwd=ROOT, check=True, capture_output=True,
                         text=True).stdout.strip()
    out = work / f"ours-{sha}"
    if not (out / "generation" / "generator.py").exists():
        part = out.with_name(out.name + ".part")
        part.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "archive", sha], cwd=ROOT, check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(part)], input=archive, check=True)
        part.rename(out)
    return out


def engine_main(spec_path: str, out_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    if spec["engine"] == "ours" and spec.get("ours_root"):
        sys.path.insert(0, spec["ours_root"])  # before anything of ours is imported
    os.environ.setdefault("OMP_NUM_THREADS", str(spec["threads"]))
    cls = ENGINE_CLASSES[spec["engine"]]
    results = {}
    for fmt in engine_formats(spec["engine"], spec["formats"]):
        log(f"{spec['engine']} {fmt}: loading")
        try:
            engine = cls(spec, fmt)
        except TypeError as e:
            if fmt.endswith("i") and "int8_activations" in str(e):
                results[fmt] = {"skipped": "this checkout's from_pretrained takes no int8_activations"}
                continue
            raise
        except Exception as e:  # noqa: BLE001: one format's failure is reported, the others still run
            results[fmt] = {"skipped": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
            log(f"{spec['engine']} {fmt}: skipped: {results[fmt]['skipped']}")
            continue
        log(f"{spec['engine']} {fmt}: timing ({engine.describe})")
        results[fmt] = {"describe": engine.describe, **measure(engine, spec)}
        Path(out_path).write_text(json.dumps(results))
        del engine
        gc.collect()
    Path(out_path).write_text(json.dumps(results))
    return 0


# --------------------------------------------------------------------------- the driver


def figures(samples: dict, spec: dict) -> dict:
    med = {k: statistics.median(v) for k, v in samples.items()}
    return {"first16_ms": med["first16"] * 1e3,
            "decode_ms_per_token": max(med["decode"] - med["first16"], 0.0) * 1e3 / max(spec["decode_tokens"] - 1, 1),
            "prompt128_ms": med["prompt128"] * 1e3,
            "batch8_tokens_per_s": len(spec["prompts"]["b8"]) * spec["batch_new"] / med["batch8"]}


def peer_format(engine: str, fmt: str) -> str | None:
    table = LLAMA_FORMAT if engine == "llama.cpp" else CT2_FORMAT
    return table.get(weight_format(fmt))


def until_eos(tokens: list[int]) -> list[int]:
    return tokens[: tokens.index(EOS) + 1] if EOS in tokens else tokens


def same_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def agreement(results: dict, formats: list[str]) -> list[str]:
    """Lines on how the greedy tokens agree: for each format, each peer against ours."""
    lines = []
    for fmt in formats:
        ours = results.get("ours", {}).get(fmt, {}).get("tokens")
        if not ours:
            continue
        for engine in ENGINES[1:]:
            theirs = results.get(engine, {}).get(weight_format(fmt), {}).get("tokens")
            if not theirs:
                continue
            parts = []
            for req in ("decode", "batch8"):
                rows = list(zip(ours[req], theirs[req]))
                same = sum(until_eos(a) == until_eos(b) for a, b in rows)
                first = [same_prefix(a, b) for a, b in rows]
                parts.append(f"{req}: {same}/{len(rows)} rows identical (tokens before the first difference: "
                             f"{', '.join(map(str, first))})")
            lines.append(f"{fmt} vs {engine} {peer_format(engine, fmt)}: " + "; ".join(parts))
    return lines


def fp32_check(results: dict) -> str | None:
    """None where ours, llama.cpp F32 and CTranslate2 float32 (those that ran) gave the same greedy
    tokens; else what differs."""
    runs = {e: results.get(e, {}).get("fp32", {}).get("tokens") for e in ENGINES}
    runs = {e: t for e, t in runs.items() if t}
    if len(runs) < 2:
        return "fewer than two engines ran fp32: nothing to compare"
    ref_name, ref = next(iter(runs.items()))
    bad = [f"{e} differs from {ref_name} ({req})" for e, t in runs.items() for req in ("decode", "batch8")
           if [until_eos(x) for x in t[req]] != [until_eos(x) for x in ref[req]]]
    return "; ".join(bad) or None


def fmt_num(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def markdown(report: dict) -> str:
    spec, rows = report["spec"], report["rows"]
    cpu = report["cpu"]
    caps = " ".join(f"{k}={v}" for k, v in cpu.get("caps", {}).items())
    out = [f"CPU: {cpu['model']} ({cpu['cpus']} logical CPUs; flags: {', '.join(cpu['isa'])}"
           f"{'; capped: ' + caps if caps else ''}; llama.cpp built with: {cpu.get('llama.cpp') or '-'}); "
           f"{spec['threads']} threads per engine; load average (1, 5, 15 min) before "
           f"{', '.join(map(str, report['load_before']))}, after {', '.join(map(str, report['load_after']))}",
           f"model: random {report['shape']} checkpoint (vocab {spec['vocab']}, hidden {spec['hidden']}, "
           f"{spec['layers']} layers, {spec['heads']} heads); medians of {spec['repeats']} x {spec['rounds']} round(s); "
           f"versions: {', '.join(f'{k} {v}' for k, v in report['versions'].items())}", "",
           "| format | figure | ours | llama.cpp | CTranslate2 | ours / best peer |",
           "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        for metric in METRICS:
            vals = r["values"][metric]
            ratio = r["ratios"].get(metric)
            note = "" if metric != "batch8_tokens_per_s" else " (tokens/s: ours / best; above 1 is faster)"
            out.append(f"| {r['label']} | {HEADER[metric]} | {fmt_num(vals.get('ours'))} | "
                       f"{fmt_num(vals.get('llama.cpp'))} | {fmt_num(vals.get('ctranslate2'))} | "
                       f"{fmt_num(ratio, 2)}{note if ratio is not None else ''} |")
    picked = [f"{r['label']}: {routes_of(r['describe'].get('ours'))}" for r in rows if routes_of(r["describe"].get("ours"))]
    if picked:
        out += ["", "Ours' CPU routes, as its load line gave them (measured on this machine unless it says otherwise): "
                + "; ".join(picked)]
    return "\n".join(out)


def build_rows(results: dict, spec: dict) -> list[dict]:
    rows = []
    for fmt in spec["formats"]:
        ours = results.get("ours", {}).get(fmt, {})
        label = {"fp32": "fp32 / F32 / float32", "bf16": "bf16 / BF16 / -", "int8": "int8 / Q8_0 / int8",
                 "int4": f"int4 G={spec['group_size']} / Q4_0 pure / -", "int8i": "int8 (integer) / Q8_0 / int8",
                 "int4i": f"int4 G={spec['group_size']} (integer) / Q4_0 pure / -"}[fmt]
        values = {m: {} for m in METRICS}
        notes = []
        if "skipped" in ours:
            notes.append(f"ours: skipped ({ours['skipped']})")
        for engine in ENGINES:
            key = fmt if engine == "ours" else weight_format(fmt)
            got = results.get(engine, {}).get(key, {})
            if "samples" in got:
                for m, v in figures(got["samples"], spec).items():
                    values[m][engine] = v
            elif engine != "ours" and "skipped" in got:
                notes.append(f"{engine}: skipped ({got['skipped']})")
        ratios = {}
        for m in METRICS:
            peers = [values[m][e] for e in ENGINES[1:] if e in values[m]]
            if "ours" in values[m] and peers:
                best = max(peers) if m == "batch8_tokens_per_s" else min(peers)
                ratios[m] = values[m]["ours"] / best if best else None
        rows.append({"format": fmt, "label": label, "values": values, "ratios": ratios, "notes": notes,
                     "describe": {e: results.get(e, {}).get(fmt if e == "ours" else weight_format(fmt), {})
                                  .get("describe") for e in ENGINES}})
    return rows


def parse_extra(text: str) -> dict:
    out = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"error: --ours_extra takes key=value items, got {item!r}")
        try:
            out[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            out[key.strip()] = value.strip()
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default=str(ROOT / ".peers"), help="the checkpoint and the conversions, cached")
    p.add_argument("--shape", default="bloom-560m", help="bloom-560m, or HIDDEN,LAYERS,HEADS (vocab 250880)")
    p.add_argument("--formats", default="fp32,bf16,int8,int4,int8i,int4i", help=f"from {', '.join(FORMATS)}")
    p.add_argument("--engines", default=",".join(ENGINES), help=f"from {', '.join(ENGINES)}")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5, help="timed requests of each kind (medians)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rounds", type=int, default=1, help="run the engines this many times, the order reversed "
                   "each round, pooling the samples")
    p.add_argument("--decode_tokens", type=int, default=64, help="new tokens of the batch-1 decode request")
    p.add_argument("--batch_new", type=int, default=32, help="new tokens per row of the batch-8 request")
    p.add_argument("--group_size", type=int, default=32, help="ours' int4 group (Q4_0's is 32)")
    p.add_argument("--quant_dtype", default="bf16", choices=["fp32", "bf16"], help="ours' activations for int8/int4")
    p.add_argument("--bucket_width", type=int, default=16, help="ours: prompts padded to a multiple (0: static)")
    p.add_argument("--llama_extra_bufts", default="auto", choices=["auto", "on", "off"],
                   help="llama.cpp's extra buffer types (AMX, REPACK); auto: off for Q8_0/Q4_0 where llama.cpp "
                   "was built with AMX-INT8, whose AMX path dies on an illegal instruction on this VM")
    p.add_argument("--ours_rev", help="run ours from this git revision (exported once under --work with git "
                   "archive), not from the working tree: e.g. HEAD while the tree is being edited")
    p.add_argument("--ours_extra", default="", help="more from_pretrained keywords for ours: k=v,k=v")
    p.add_argument("--llama_cpp_src", help="a llama.cpp source tree for convert_hf_to_gguf.py")
    p.add_argument("--json", help="write everything to this file")
    p.add_argument("--markdown", help="write the table (markdown) to this file too")
    p.add_argument("--engine_spec", help=argparse.SUPPRESS)
    p.add_argument("--engine_out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    for bad, allowed, what in ((set(args.formats) - set(FORMATS), FORMATS, "format"),
                               (set(args.engines) - set(ENGINES), ENGINES, "engine")):
        if bad:
            p.error(f"unknown {what} {sorted(bad)[0]!r}; choose from {', '.join(allowed)}")
    return args


def peer_available(engine: str) -> str | None:
    """None where the engine can run here, else why not."""
    module = {"llama.cpp": "llama_cpp", "ctranslate2": "ctranslate2"}.get(engine)
    if module is None:
        return None
    try:
        __import__(module)
    except Exception as e:  # noqa: BLE001: an installed but broken build is reported as such
        return f"{module} is not importable ({type(e).__name__}: {e})"
    return None


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.engine_spec:
        return engine_main(args.engine_spec, args.engine_out)
    load_before = load_average()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if not (work / ".gitignore").exists():
        (work / ".gitignore").write_text("*\n")  # a cache, never part of the repository
    folder = checkpoint(work, args.shape)
    name, (vocab, hidden, layers, heads) = parse_shape(args.shape)
    engines, missing = [], {}
    for e in args.engines:
        why = peer_available(e)
        if why:
            missing[e] = why
            log(f"{e}: not run: {why}")
        else:
            engines.append(e)
    spec = {"folder": str(folder), "formats": args.formats, "threads": args.threads, "repeats": args.repeats,
            "warmup": args.warmup, "rounds": args.rounds, "decode_tokens": args.decode_tokens,
            "batch_new": args.batch_new, "group_size": args.group_size, "quant_dtype": args.quant_dtype,
            "bucket_width": args.bucket_width, "llama_extra_bufts": args.llama_extra_bufts, "ours_extra": parse_extra(args.ours_extra),
            "prompts": prompts(folder), "vocab": vocab, "hidden": hidden, "layers": layers, "heads": heads,
            "gguf": {}, "ct2": {},
            "ours_root": str(ours_tree(work, args.ours_rev)) if args.ours_rev else None}
    if "llama.cpp" in engines:
        src = llama_cpp_source(work, args.llama_cpp_src)
        for fmt in engine_formats("llama.cpp", args.formats):
            spec["gguf"][fmt] = str(convert_llama(folder, fmt, src, args.threads))
    if "ctranslate2" in engines:
        for fmt in engine_formats("ctranslate2", args.formats):
            spec["ct2"][fmt] = str(convert_ct2(folder, fmt))

    results: dict = {}
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            order = engines if rnd % 2 == 0 else engines[::-1]
            for engine in order:
                spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / f"{engine}-{rnd}.json"
                spec_path.write_text(json.dumps(dict(spec, engine=engine)))
                log(f"round {rnd + 1}/{args.rounds}: {engine} (load average {load_average()[0]:.2f})")
                done = subprocess.run([sys.executable, __file__, "--engine_spec", str(spec_path),
                                       "--engine_out", str(out_path)], env=env)
                if done.returncode or not out_path.exists():
                    missing[engine] = f"its process failed (exit {done.returncode})"
                    continue
                for fmt, got in json.loads(out_path.read_text()).items():
                    have = results.setdefault(engine, {}).setdefault(fmt, got)
                    if have is not got and "samples" in got:  # a later round: pool the samples
                        for k, v in got["samples"].items():
                            have["samples"][k] += v
    load_after = load_average()

    rows = build_rows(results, spec)
    report = {"command": shlex.join(["python", "bench/peers_bench.py"] + (sys.argv[1:] if argv is None else argv)),
              "cpu": cpu_description(), "versions": versions(), "shape": name, "load_before": load_before,
              "load_after": load_after, "spec": {k: v for k, v in spec.items() if k not in ("prompts",)},
              "prompt_ids": spec["prompts"], "rows": rows, "not_run": missing,
              "fp32_tokens": fp32_check(results), "agreement": agreement(results, args.formats),
              "results": results}
    text = markdown(report)
    print(text)
    print()
    for r in rows:
        for note in r["notes"]:
            print(f"note: {r['format']}: {note}")
    for e, why in missing.items():
        print(f"note: {e} not run: {why}")
    check = report["fp32_tokens"]
    ran = [e for e in ENGINES if "tokens" in results.get(e, {}).get("fp32", {})]
    print("fp32 greedy tokens: " + (f"{', '.join(ran)} agree (decode and batch 8, up to an EOS)" if check is None
                                    else f"not checked: {check}" if "fewer" in check else f"MISMATCH: {check}"))
    for line in report["agreement"]:
        print(f"tokens: {line}")
    for r in rows:
        for e, d in r["describe"].items():
            if d:
                print(f"ran: {r['format']} {e}: {d}")
    print(f"command: {report['command']}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    return 0 if check is None or "fewer" in check else 1


if __name__ == "__main__":
    sys.exit(main())
