#!/usr/bin/env python3
"""Speculative decoding, side by side (issue 44): our generator with and without guesses, and
transformers' ``generate`` with and without its prompt lookup (``prompt_lookup_num_tokens``), on
the same checkpoint and token ids, in one process, one prompt at a time (batch 1).

Two figures:

* **verify cost**: one verify pass of k + 1 positions (``StepRunner.verify``) against one
  plain decode step, on the same cache (a prompt of ``--prompt_len`` tokens in it), medians of
  ``--steps`` alternated calls;
* **tokens/s** of whole requests (prefill included, the same for every variant) of ``--new_tokens``
  tokens, greedy, medians of ``--repeats`` rounds that go round-robin over the variants:

  - ``ours``                  the plain loop
  - ``ours+ngram:K``          prompt lookup (``--speculate ngram:K``)
  - ``ours+fail:K``           planted guesses that are always wrong: what adaptive k leaves of the cost
  - ``ours+oracle:K``         planted guesses that are always right (the plain run's own tokens):
                              the ceiling, acceptance 1
  - ``ours+draftNL:K``        a draft model (``--speculate draft:K``) of the target's first N blocks
                              (``--draft_layers``, default 4; ``utils/first_layers.py``), the same
                              width: what a draft's k steps and catch-up cost, at the acceptance
                              such a draft gets
  - ``ours+draft=self:K``     the target as its own draft: acceptance 1, at the cost of a draft as
                              big as the target (the ceiling of acceptance, not of speed)
  - ``transformers``          ``BloomForCausalLM.generate``, greedy
  - ``transformers+lookup:K`` the same with ``prompt_lookup_num_tokens=K`` (assisted generation)
  - ``transformers+draftNL:K`` the same with ``assistant_model`` the N-block draft, K tokens a round
  - ``llama.cpp``             with ``--gguf`` (the same checkpoint converted, e.g. by
                              ``bench/peers_bench.py``): llama-cpp-python's ``Llama.generate``, greedy
  - ``llama.cpp+lookup:K``    the same with its prompt lookup (``LlamaPromptLookupDecoding``, n-grams
                              of up to 3 tokens, K tokens a verify)

  Every variant's tokens are compared with ours' plain ones (``same``).

With ``--agreeing_target`` every variant runs on a copy of the target whose blocks past
``--draft_layers`` add nothing to the residual stream (their output projections zero): the same
cost a token, and the first-blocks draft agrees with it by construction, so ``ours+draftNL`` shows
what a draft that agrees costs and gives on this shape.

Random weights do not copy their context, so prompt lookup is measured where a model does: the
embedded default checkpoint (``--config tiny``), whose greedy text repeats itself; on a real
shape (``--config bloom-560m``) the verify cost, the failing and the oracle guesses say what a pass
costs and what acceptance 1 would give. ``--lead N`` makes a workload where the text repeats its
context on a real shape: a random model's greedy text falls into loops the longer it runs, so the
prompt becomes the last ``--prompt_len`` tokens of the plain loop's first N tokens after the corpus
prompt (token ids), and the model goes on repeating what its prompt holds.

    python bench/speculate_bench.py --config tiny --new_tokens 96
    python bench/speculate_bench.py --config bloom-560m --dtype bf16 --prompt_len 64 --new_tokens 32
    python bench/speculate_bench.py --config bloom-560m --draft_layers 4 --new_tokens 64
    python bench/speculate_bench.py --config bloom-560m --dtype bf16 --agreeing_target --no_transformers
    python bench/speculate_bench.py --config .peers/bloom-560m/hf --gguf .peers/bloom-560m/gguf-BF16.gguf \
        --dtype bf16 --lead 768 --prompt_len 64 --new_tokens 128 --draft_layers 0
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.generate_bench import checkpoint_folder, log, make_prompts  # noqa: E402
from bloom_hpu.runtime.steps import step_input  # noqa: E402
from generation.generator import Generator, parse_dtype  # noqa: E402
from generation.search import speculation  # noqa: E402
from generation.search.draft import DraftModel  # noqa: E402
from utils.first_layers import first_layers  # noqa: E402

TINY_PROMPT = "And God said unto Moses"


def planted(truth: list[int], right: bool):
    """A guesser for one row whose guesses are the true continuation ``truth`` (prompt + the plain
    run's tokens), or that plus one (always wrong)."""
    table = torch.tensor(truth + [3] * 64)

    def guess(sequence, used, k):
        slots = (used[:, None] + torch.arange(k)).clamp(max=table.numel() - 1)
        guesses = table[slots]
        return (guesses if right else (guesses + 1) % 1000), torch.full_like(used, k)

    return guess


def verify_cost(generator: Generator, prompt_ids: list[int], k: int, steps: int) -> tuple[float, float]:
    """Median ms of one decode step and of one verify pass of k + 1 positions, alternated, on one
    cache holding the prompt."""
    runner = generator.runner
    length = len(prompt_ids) + 2 * (k + 1) + steps
    cache = runner.cache(1, length)
    ids = torch.tensor([prompt_ids])
    runner.prefill(step_input(ids), torch.tensor([len(prompt_ids)]), cache)
    start = torch.tensor([len(prompt_ids)])
    token = torch.tensor([[prompt_ids[-1]]])
    guesses = torch.tensor([prompt_ids[-(k + 1):]])
    decode_ms, verify_ms = [], []
    for i in range(steps + 2):  # the first two of each untimed
        t = time.perf_counter()
        runner.decode(step_input(token), step_input(start), cache, length)
        d = time.perf_counter() - t
        t = time.perf_counter()
        runner.verify(step_input(guesses), step_input(start), cache, length)
        v = time.perf_counter() - t
        if i >= 2:
            decode_ms.append(d * 1e3)
            verify_ms.append(v * 1e3)
    return statistics.median(decode_ms), statistics.median(verify_ms)


def agreeing_target(src: Path, out: Path, layers: int) -> Path:
    """A copy of ``src`` whose blocks from ``layers`` on add nothing to the residual stream (their
    attention's and MLP's output projections zero): it computes exactly what its first ``layers``
    blocks compute, at the whole model's cost (every block still runs and reads its weights), so a
    draft of those first blocks agrees with it by construction."""
    import json

    from bloom_hpu.checkpoint import CheckpointReader, expected_names, read_json_object
    from bloom_hpu.config import BloomConfig
    from utils.random_checkpoint import copy_tokenizer, write_weights

    raw = read_json_object(src / "config.json")
    config = BloomConfig.from_json(raw)
    silent = tuple(f"h.{i}.{part}" for i in range(layers, config.n_layer)
                   for part in ("self_attention.dense.", "mlp.dense_4h_to_h."))
    with CheckpointReader(src, config) as reader:
        tensors = {name: reader.get(name) for name in expected_names(config)}
    for name, tensor in tensors.items():
        if any(part in name for part in silent):
            tensors[name] = torch.zeros_like(tensor)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    copy_tokenizer(src, out)
    write_weights(out, tensors, "safetensors")
    return out


def same(tokens: list[int], plain: list[int]) -> str:
    """"yes", or "NO@i": the first position where ``tokens`` leave ours without speculation."""
    if tokens == plain:
        return "yes"
    return f"NO@{next((i for i, (a, b) in enumerate(zip(tokens, plain)) if a != b), min(len(tokens), len(plain)))}"


def llama_cpp_variant(gguf: str, prompt_ids: list[int], new_tokens: int, lookup: int | None):
    """llama-cpp-python's own greedy generation of ``new_tokens`` after ``prompt_ids`` (with
    ``lookup``: its prompt lookup, n-grams of up to 3 tokens as ours, ``lookup`` tokens a verify),
    on ``torch``'s thread count. The model is loaded once."""
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    draft = LlamaPromptLookupDecoding(max_ngram_size=3, num_pred_tokens=lookup) if lookup else None
    threads = torch.get_num_threads()
    llm = llama_cpp.Llama(gguf, n_ctx=len(prompt_ids) + new_tokens + 16, n_batch=512, n_threads=threads,
                          n_threads_batch=threads, draft_model=draft, verbose=False)

    def run():
        llm.reset()  # no reuse of the last call's cache: every variant prefills its prompt
        out = []
        for token in llm.generate(prompt_ids, top_k=1, temp=0.0, reset=True):
            out.append(token)
            if len(out) == new_tokens:
                break
        return out, None
    return run


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="tiny", help="tiny, bloom-560m, bloom-1b1 or a checkpoint folder")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--prompt_len", type=int, default=32, help="tokens of the prompt (shapes other than tiny)")
    p.add_argument("--new_tokens", type=int, default=64)
    p.add_argument("--k", type=int, default=4, help="guesses a pass (ours: --speculate ngram:K; transformers: "
                   "prompt_lookup_num_tokens)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=20, help="alternated calls of the verify-cost figure")
    p.add_argument("--draft_layers", type=int, default=4, help="blocks of the target's that make the draft model "
                   "(fewer where the target has no more; 0: no draft rows)")
    p.add_argument("--agreeing_target", action="store_true",
                   help="run every variant on a copy of the target whose blocks past --draft_layers add nothing "
                   "(agreeing_target): the first-blocks draft then agrees with it, at the target's full cost")
    p.add_argument("--lead", type=int, default=0, help="the prompt: the last --prompt_len tokens of the plain "
                   "loop's first LEAD tokens after the corpus prompt (text the model repeats; 0: the corpus prompt)")
    p.add_argument("--gguf", help="the same checkpoint as a GGUF file: adds llama.cpp's variants (llama-cpp-python)")
    p.add_argument("--no_transformers", action="store_true")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's); 1 keeps a loaded machine's "
                   "figures steadier")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    dtype = parse_dtype(args.dtype)
    folder = checkpoint_folder(args.config, dtype)
    if args.agreeing_target:
        made = Path(tempfile.mkdtemp(prefix="speculate_bench_target_")) / "agreeing"
        folder = agreeing_target(Path(folder), made, args.draft_layers)
    generator = Generator.from_pretrained(folder, dtype=args.dtype)
    if args.config == "tiny":
        prompt = TINY_PROMPT
    else:
        prompt = make_prompts(generator.tokenizer, 1, args.prompt_len)[0]
    prompt_ids = generator.tokenizer.encode(prompt)
    if args.lead:
        if args.lead < args.prompt_len:
            raise SystemExit(f"error: --lead ({args.lead}) must be at least --prompt_len ({args.prompt_len})")
        lead = generator.generate(prompt, max_length=len(prompt_ids) + args.lead, ignore_eos=True)[0].token_ids
        prompt_ids = lead[-args.prompt_len:]
        prompt = [prompt_ids]  # token ids: byte tokens of a random model's text need not survive decoding
    max_length = len(prompt_ids) + args.new_tokens
    options = dict(max_length=max_length, ignore_eos=False)
    kspec = f"ngram:{args.k}"

    log(f"checkpoint {folder} ({args.dtype}), prompt {len(prompt_ids)} tokens, {args.new_tokens} new, k {args.k}")
    log(f"CPU fast path: {generator.backend.fast_path}; torch threads {torch.get_num_threads()}")
    decode_ms, verify_ms = verify_cost(generator, prompt_ids, args.k, args.steps)
    print(f"verify cost: decode step {decode_ms:.2f} ms, verify of {args.k + 1} positions {verify_ms:.2f} ms, "
          f"ratio {verify_ms / decode_ms:.2f}x")

    plain = generator.generate(prompt, **options)[0].token_ids
    truth = prompt_ids + plain
    hf = None
    if not args.no_transformers:
        import transformers

        transformers.logging.set_verbosity_error()
        hf = transformers.BloomForCausalLM.from_pretrained(folder, torch_dtype=dtype).eval()

    def ours(guesser=None, spec=None, draft=None):
        def run():
            if guesser is not None:
                speculation.GUESSERS["ngram"] = guesser
            generator.draft = draft  # the draft this variant runs (each loaded once, beside the target)
            try:
                out = generator.generate(prompt, speculate=spec, **options)[0].token_ids
            finally:
                speculation.GUESSERS["ngram"] = speculation.ngram_guesses
                generator.draft = None
            stats = generator.last_stats.speculation
            return out, stats
        return run

    def theirs(lookup: int | None, assistant=None):
        def run():
            extra = {"prompt_lookup_num_tokens": lookup} if lookup else {}
            if assistant is not None:
                extra = {"assistant_model": assistant}
            with torch.no_grad():
                out = hf.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                                  max_length=max_length, do_sample=False, num_beams=1, pad_token_id=3, **extra)
            return out[0, len(prompt_ids):].tolist(), None
        return run

    variants = {
        "ours": ours(spec="off"),
        f"ours+{kspec}": ours(spec=kspec),
        f"ours+fail:{args.k}": ours(planted(truth, right=False), kspec),
        f"ours+oracle:{args.k}": ours(planted(truth, right=True), kspec),
    }
    layers = min(args.draft_layers, generator.model.config.n_layer - 1)
    drafts = {}
    if layers > 0:
        made = Path(tempfile.mkdtemp(prefix="speculate_bench_draft_")) / f"first{layers}"
        drafts[f"draft{layers}L"] = first_layers(folder, made, layers)
        drafts["draft=self"] = folder
        log(f"draft models: the target's first {layers} blocks ({made}), and the target itself")
    for name, path in drafts.items():
        runner = Generator.from_pretrained(path, dtype=args.dtype).runner
        variants[f"ours+{name}:{args.k}"] = ours(spec=f"draft:{args.k}", draft=DraftModel(runner, path))
    if hf is not None:
        variants["transformers"] = theirs(None)
        variants[f"transformers+lookup:{args.k}"] = theirs(args.k)
        if layers > 0:
            assistant = transformers.BloomForCausalLM.from_pretrained(drafts[f"draft{layers}L"], torch_dtype=dtype).eval()
            assistant.generation_config.num_assistant_tokens = args.k
            assistant.generation_config.num_assistant_tokens_schedule = "constant"
            variants[f"transformers+draft{layers}L:{args.k}"] = theirs(None, assistant)
    if args.gguf:
        variants["llama.cpp"] = llama_cpp_variant(args.gguf, prompt_ids, args.new_tokens, None)
        variants[f"llama.cpp+lookup:{args.k}"] = llama_cpp_variant(args.gguf, prompt_ids, args.new_tokens, args.k)

    names = list(variants)
    times = {n: [] for n in names}
    results = {}
    for name in names:  # warm-up, untimed
        results[name] = variants[name]()
    for r in range(args.repeats):
        for name in names[r % len(names):] + names[: r % len(names)]:
            t = time.perf_counter()
            results[name] = variants[name]()
            times[name].append(time.perf_counter() - t)
    base = statistics.median(times["ours"])
    hf_base = statistics.median(times["transformers"]) if hf is not None else None
    print(f"{'variant':<26} {'tokens':>6} {'s':>8} {'tokens/s':>9} {'x ours':>7} {'x hf':>6} "
          f"{'tok/verify':>10} {'accept':>7} {'same':>5} {'spread':>7}")
    for name in names:
        tokens, stats = results[name]
        # transformers' prompt lookup may run past max_length by a few tokens: what was asked for
        # is compared and counted.
        tokens = tokens[: len(plain)]
        seconds = statistics.median(times[name])
        speed = len(tokens) / seconds
        per_verify = f"{stats.tokens_per_verify:.2f}" if stats and stats.verifies else "-"
        accept = f"{stats.acceptance:.2f}" if stats and stats.offered else "-"
        vs_hf = f"{hf_base / seconds:.2f}" if hf_base else "-"
        print(f"{name:<26} {len(tokens):>6} {seconds:>8.3f} {speed:>9.1f} {base / seconds:>7.2f} {vs_hf:>6} "
              f"{per_verify:>10} {accept:>7} {same(tokens, plain):>5} "
              f"{(max(times[name]) - min(times[name])) / seconds:>6.0%}")
    print("(x ours, x hf: the plain variant's median time over this one's: above 1 is faster; same: the tokens "
          "equal ours without speculation, NO@i where they first differ; spread: (slowest - fastest run) / median)")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
