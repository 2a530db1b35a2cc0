"""The grammar libraries side by side on a vocabulary of BLOOM's size: how the library of
``generation/request/grammar.py`` was chosen (``python bench/structured_bench.py libraries``).

For each of llguidance, xgrammar and outlines-core, on the same tokenizer of 250,880 tokens:

* ``tokenizer``: the one-time cost of reading the vocabulary;
* ``compile first`` / ``compile cached``: a nested-object JSON schema compiled the first time, and
  again (the library's own cache where it has one; otherwise a fresh compile);
* ``mask``: the median time of one allowed-token mask (a [vocab] bitmask), over every step of
  walking a valid instance of the schema token by token (mask, then the instance's token).

The tokenizer: no BLOOM tokenizer can be fetched here, so ``bloom_sized_tokenizer`` builds a
byte-level BPE vocabulary of BLOOM's size (its 4 special tokens and 256 bytes, then words, pieces
of words with and without a leading space, numbers, punctuation runs and multi-byte UTF-8
characters, as BLOOM's multilingual vocabulary holds). What a library's mask costs grows with the
vocabulary's size and how its tokens share prefixes, which this keeps.
"""

from __future__ import annotations

import json
import random
import statistics
import time

NESTED_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string", "enum": ["Paris", "Lyon", "Nice"]},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "geo": {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                        "required": ["lat", "lon"], "additionalProperties": False},
            },
            "required": ["street", "city", "zip", "geo"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4},
    },
    "required": ["name", "age", "address", "tags"],
    "additionalProperties": False,
}
INSTANCE = {"name": "Ada Lovelace", "age": 36, "address": {"street": "12 rue des Fleurs", "city": "Paris",
            "zip": "75001", "geo": {"lat": 48.86, "lon": 2.35}}, "tags": ["math", "poet"]}


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte-to-printable-character map (byte-level BPE's alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    return chars


def bloom_sized_tokenizer(vocab_size: int = 250880, seed: int = 0) -> str:
    """A tokenizer.json (a string) of a byte-level BPE tokenizer with ``vocab_size`` tokens."""
    rng = random.Random(seed)
    chars = _byte_chars()
    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>", "<pad>"])}
    for b in range(256):
        vocab.setdefault(chars[b], len(vocab))
    letters = "abcdefghijklmnopqrstuvwxyz"
    alphabets = [(0x4E00, 0x9FFF), (0x0400, 0x04FF), (0x0900, 0x097F), (0x0600, 0x06FF), (0x00C0, 0x017F)]
    while len(vocab) < vocab_size:
        kind = rng.random()
        if kind < 0.55:  # a word or a piece of one, often with its leading space
            text = ("" if rng.random() < 0.4 else " ") + "".join(rng.choice(letters) for _ in range(rng.randint(2, 10)))
            if rng.random() < 0.2:
                text = text[:2].upper() + text[2:]
        elif kind < 0.8:  # characters of other scripts (2-3 UTF-8 bytes each)
            lo, hi = rng.choice(alphabets)
            text = ("" if rng.random() < 0.5 else " ") + "".join(chr(rng.randint(lo, hi)) for _ in range(rng.randint(1, 3)))
        elif kind < 0.9:
            text = rng.choice(["", " "]) + str(rng.randint(0, 99999))
        else:
            text = "".join(rng.choice(" \n\t.,;:!?\"'(){}[]<>-_=+*/\\#@$%&|") for _ in range(rng.randint(2, 4)))
        vocab.setdefault("".join(chars[b] for b in text.encode()), len(vocab))
    tokenizer = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for t, i in list(vocab.items())[:4]],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "vocab": vocab, "merges": []},
    }
    return json.dumps(tokenizer)


def _ms(start: float) -> float:
    return (time.perf_counter() - start) * 1000


def _walk_ms(compute_mask, consume, tokens) -> dict:
    """Median, mean and largest ms of one mask over a walk through ``tokens`` (mask, then the token)."""
    times = []
    for token in tokens:
        start = time.perf_counter()
        compute_mask()
        times.append(_ms(start))
        assert consume(token), token
    return {"median": statistics.median(times), "mean": statistics.fmean(times), "max": max(times)}


def measure_llguidance(tokenizer_json: str, vocab: int, eos: int, tokens: list[int]) -> dict:
    import llguidance
    import llguidance.torch as llt

    start = time.perf_counter()
    tok = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab, eos_token=eos)
    out = {"tokenizer_ms": _ms(start)}
    schema = json.dumps(NESTED_SCHEMA)
    start = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
    matcher = llguidance.LLMatcher(tok, grammar)
    llt.fill_next_token_bitmask(matcher, llt.allocate_token_bitmask(1, vocab))  # the first mask builds the lexer
    out["compile_first_ms"] = _ms(start)
    start = time.perf_counter()
    matcher = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_json_schema(schema))
    llt.fill_next_token_bitmask(matcher, llt.allocate_token_bitmask(1, vocab))
    out["compile_cached_ms"] = _ms(start)
    matcher = llguidance.LLMatcher(tok, grammar)
    mask = llt.allocate_token_bitmask(1, vocab)
    out["mask_ms"] = _walk_ms(lambda: llt.fill_next_token_bitmask(matcher, mask), matcher.consume_token, tokens)
    return out


def measure_xgrammar(tokenizer_json: str, vocab: int, eos: int, tokens: list[int]) -> dict:
    import xgrammar as xgr
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    start = time.perf_counter()
    hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tokenizer_json), eos_token="</s>")
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=[eos])
    compiler = xgr.GrammarCompiler(info)
    out = {"tokenizer_ms": _ms(start)}
    schema = json.dumps(NESTED_SCHEMA)
    start = time.perf_counter()
    compiled = compiler.compile_json_schema(schema)
    out["compile_first_ms"] = _ms(start)
    start = time.perf_counter()
    compiler.compile_json_schema(schema)
    out["compile_cached_ms"] = _ms(start)
    matcher = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, vocab)
    out["mask_ms"] = _walk_ms(lambda: matcher.fill_next_token_bitmask(mask), matcher.accept_token, tokens)
    return out


def measure_outlines_core(tokenizer_json: str, vocab: int, eos: int, tokens: list[int], budget_s: float) -> dict:
    import multiprocessing as mp

    # Its index is built over the whole vocabulary at compile time, which can take minutes: in a
    # child process, abandoned past ``budget_s``.
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_outlines_child, args=(tokenizer_json, vocab, eos, tokens, queue))
    child.start()
    child.join(budget_s)
    if child.is_alive():
        child.kill()
        return {"note": f"compile not done in {budget_s:.0f} s"}
    return queue.get() if child.exitcode == 0 else {"note": f"failed (exit code {child.exitcode})"}


def _outlines_child(tokenizer_json, vocab, eos, tokens, queue):
    import torch
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    chars = {c: b for b, c in _byte_chars().items()}
    start = time.perf_counter()
    table = {}
    for text, i in json.loads(tokenizer_json)["model"]["vocab"].items():
        if i != eos and i > 3:
            table.setdefault(bytes(chars[c] for c in text), []).append(i)
    vocabulary = Vocabulary(eos, table)
    out = {"tokenizer_ms": _ms(start)}
    regex = build_regex_from_schema(json.dumps(NESTED_SCHEMA))
    start = time.perf_counter()
    index = Index(regex, vocabulary)
    out["compile_first_ms"] = _ms(start)
    out["compile_cached_ms"] = None  # no cache of its own: a repeated schema builds its index again
    guide = Guide(index)
    mask = torch.zeros((vocab + 31) // 32, dtype=torch.int32)
    out["mask_ms"] = _walk_ms(lambda: guide.write_mask_into(mask.data_ptr(), mask.numel(), 4),
                              lambda t: guide.advance(t, return_tokens=False) is not None or True, tokens[:-1])
    queue.put(out)


def compare(vocab: int = 250880, budget_s: float = 120.0) -> list[tuple[str, dict]]:
    from tokenizers import Tokenizer

    tokenizer_json = bloom_sized_tokenizer(vocab)
    eos = 2
    tokens = Tokenizer.from_str(tokenizer_json).encode(json.dumps(INSTANCE)).ids + [eos]
    rows = []
    for name, run in (("llguidance", measure_llguidance), ("xgrammar", measure_xgrammar),
                      ("outlines-core", lambda *a: measure_outlines_core(*a, budget_s))):
        try:
            rows.append((name, run(tokenizer_json, vocab, eos, tokens)))
        except Exception as error:  # a library that cannot run here is a row that says why
            rows.append((name, {"note": f"{type(error).__name__}: {error}"[:200]}))
    return rows
