#!/usr/bin/env python3
"""Creates checkpoints/bloom-tiny: the small trained BLOOM that ships with the repository.

It lets the CLI, the server and the chat shell run with no download and write English words and
phrases. The script fetches its corpus (the King James Bible from Debian's packages, public
domain, pinned and checksummed: see utils/kjv_corpus.py), holds out every 20th chapter, trains a
byte-level BPE tokenizer with BLOOM's special tokens and behaviour on the rest, then trains a small
BLOOM (transformers' BloomForCausalLM, plain PyTorch, seeded) and saves it in float16 safetensors
under the unprefixed BLOOM names, with its held-out perplexity in the README.

    utils/make_default_checkpoint.py [--out checkpoints/bloom-tiny] [--steps N]
    utils/make_default_checkpoint.py --corpus FILE --smoke --out DIR   # seconds: a check of the script

The tokenizer is reproducible byte for byte; the weights only on the same machine and thread count
(float summation order differs between CPUs).
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # run as a script, utils/ is on sys.path but the repo root is not

import torch  # noqa: E402
import transformers  # noqa: E402

from bloom_hpu.config import BloomConfig  # noqa: E402
from utils import kjv_corpus  # noqa: E402
from utils.bloom_tokenizer import train_tokenizer, write_tokenizer  # noqa: E402
from utils.random_checkpoint import write_weights  # noqa: E402

DEFAULT_OUT = REPO_ROOT / "checkpoints" / "bloom-tiny"


@dataclass(frozen=True)
class Recipe:
    tokenizer_vocab: int = 2000  # the model pads it to 2048, as BLOOM pads 250680 to 250880
    hidden_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    seq_len: int = 128  # training windows; ALiBi lets the model run on longer ones
    batch_size: int = 16
    steps: int = 2000
    lr: float = 2e-3
    warmup: int = 100
    weight_decay: float = 0.1
    seed: int = 0


# A check that the whole script runs, in seconds, on any small text.
SMOKE = Recipe(tokenizer_vocab=300, hidden_size=32, n_layer=1, n_head=2, seq_len=32, batch_size=4, steps=4, warmup=1)
VOCAB_MULTIPLE = 128

# Measured by hand on the shipped weights (the LAMBADA evaluation, samples), after training: kept
# here so that the README this script writes keeps them; rerunning the script makes them stale.
MEASURED = """\
## Measured by hand on these weights

Not run by the script: LAMBADA is the project's evaluation data and lives outside the repository.
On the whole test file (5,153 passages of modern fiction, never trained on; 57 s on one thread):

    ./bloom.py --eval ../shared/data/lambada_test.jsonl

| passages | accuracy | perplexity (per token) | last-word perplexity |
| --- | --- | --- | --- |
| 5153 | 0.0000 | 760.0 | 763.0 |

Modern fiction is far from a 1611 Bible, and predicting LAMBADA's last word (often a name
introduced pages earlier) is beyond a model of this size: it exists to show English, not to score.

The training time above was taken on a 2-core machine busy with other jobs' work at the same time
(one PyTorch thread was faster there than two).

Samples (greedy: `./bloom.py --max_length 40 PROMPT`; sampled: `./bloom.py --max_length 48
--options "do_sample=true,temperature=0.8,top_k=40" --seed 1 PROMPT`):

- greedy, "And the king said": *unto him, Thou shalt not be a great man, and thou shalt not be a
  great man. And he said, I will not be a great man, and I will not*
- greedy, "Why is the sky blue?": *and the day is the light of the sun, and the light of the earth,
  and the light of the earth. The earth is the light of*
- sampled, "It was the best of times": *: for all were come nigh unto them that were in the pasts. And
  the LORD said unto Moses, Get thee, and shew thee the man that hath said unto them, The*
"""


README = """\
# bloom-tiny: a small BLOOM trained on the King James Bible

A real, if tiny, BLOOM language model: it writes English words and phrases (in the style of a
seventeenth-century Bible, the only text it has read), so that `bloom.py`, the server and the chat
shell show something meaningful without a download. It is no substitute for a real model: the
facts and the grammar are shaky beyond a phrase or two. For real weights use `utils/fetch_weights.py`.

    ./bloom.py "It was the best of times"

- architecture: BLOOM, hidden size {hidden_size}, {n_layer} layers, {n_head} heads, vocabulary {vocab_size}
  ({live_vocab} tokenizer tokens, padded as BLOOM pads its vocabulary); {params:,} parameters
- weights: float16 safetensors (the unprefixed BLOOM names), loadable by
  `transformers.BloomForCausalLM.from_pretrained`
- tokenizer: byte-level BPE trained on the training split, with BLOOM's special tokens
  `<unk>`=0, `<s>`=1, `</s>`=2, `<pad>`=3 and BLOOM's pre-tokenizer; encodes any text
- corpus: {source}; fetched, checked and unpacked by `utils/kjv_corpus.py` (not committed).
  Each chapter is one paragraph; chapters are separated by a blank line. Every {every}th chapter is
  held out: {train_chapters} chapters ({train_tokens:,} tokens) to train on, {held_chapters} held out
  ({held_tokens:,} tokens).
- training: {steps} steps of {batch_size} random windows of {seq_len} tokens ({seen_tokens:,} tokens, about
  {epochs:.1f} epochs), AdamW (lr {lr}, {warmup} warm-up steps then cosine decay to a tenth, weight
  decay {weight_decay}, gradients clipped at 1), seed {seed}; {train_seconds:.0f} s on {machine}
  ({threads} PyTorch thread(s), torch {torch_version}, transformers {transformers_version})

## Quality

| split | loss (nats/token) | perplexity |
| --- | --- | --- |
| last 100 training steps | {train_loss:.3f} | {train_ppl:.1f} |
| held-out chapters (never trained on), windows of {seq_len} | {held_loss:.3f} | {held_ppl:.1f} |

A uniform guess over the vocabulary would have perplexity {live_vocab}.

{measured}
Made by `utils/make_default_checkpoint.py`: the tokenizer is reproducible byte for byte; the
weights are seeded but float summation differs between machines and thread counts, so a rerun
elsewhere gives a model of the same quality, not the same bytes.
"""


def machine() -> str:
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name}, {os.cpu_count()} cores"


def encode(tokenizer, paragraphs: list[str]) -> torch.Tensor:
    """All paragraphs as one stream of token ids, separated by a blank line. [n_tokens]"""
    separator = tokenizer.encode("\n\n").ids
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(paragraphs):
        ids += encoding.ids + separator
    return torch.tensor(ids, dtype=torch.long)


def learning_rate(step: int, recipe: Recipe) -> float:
    if step < recipe.warmup:
        return recipe.lr * (step + 1) / recipe.warmup
    progress = (step - recipe.warmup) / max(1, recipe.steps - recipe.warmup)
    return recipe.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def make_model(recipe: Recipe, vocab_size: int) -> transformers.BloomForCausalLM:
    config = transformers.BloomConfig(vocab_size=vocab_size, hidden_size=recipe.hidden_size, n_layer=recipe.n_layer,
                                      n_head=recipe.n_head, bos_token_id=1, eos_token_id=2, pad_token_id=3)
    torch.manual_seed(recipe.seed)
    return transformers.BloomForCausalLM(config)


def train(model, ids: torch.Tensor, recipe: Recipe, log=print) -> float:
    """Trains in place on random windows of `ids`; returns the mean loss of the last 100 steps."""
    decay = [p for p in model.parameters() if p.dim() >= 2]  # matrices; not biases or LayerNorms
    rest = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": recipe.weight_decay},
                                   {"params": rest, "weight_decay": 0.0}], lr=recipe.lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(recipe.seed)
    offsets = torch.arange(recipe.seq_len + 1)
    losses = []
    model.train()
    for step in range(recipe.steps):
        starts = torch.randint(0, len(ids) - recipe.seq_len - 1, (recipe.batch_size, 1), generator=gen)
        window = ids[starts + offsets]  # [batch, seq_len + 1]
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, recipe)
        logits = model(window[:, :-1]).logits  # [batch, seq_len, vocab]
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), window[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        if step % 100 == 0 or step == recipe.steps - 1:
            log(f"step {step}/{recipe.steps}: loss {loss.item():.3f}")
    model.eval()
    tail = losses[-100:]
    return sum(tail) / len(tail)


@torch.no_grad()
def held_out_loss(model, ids: torch.Tensor, seq_len: int) -> float:
    """Mean next-token loss over consecutive windows of `seq_len` tokens covering `ids`."""
    total, count = 0.0, 0
    for start in range(0, len(ids) - 1, seq_len):
        window = ids[start : start + seq_len + 1].unsqueeze(0)
        logits = model(window[:, :-1]).logits
        total += torch.nn.functional.cross_entropy(logits[0], window[0, 1:], reduction="sum").item()
        count += window.shape[1] - 1
    return total / count


def save(model, recipe: Recipe, out: Path) -> BloomConfig:
    hf = model.config
    config = BloomConfig(vocab_size=hf.vocab_size, hidden_size=hf.hidden_size, n_layer=hf.n_layer, n_head=hf.n_head)
    config.save(out)
    # BloomModel's names, without transformers' `transformer.` prefix; the LM head is tied to them.
    tensors = {k: v.detach().to(torch.float16) for k, v in model.transformer.state_dict().items()}
    write_weights(out, tensors, "safetensors")
    return config


def make_default_checkpoint(out_dir: str | Path = DEFAULT_OUT, recipe: Recipe = Recipe(),
                            corpus_file: Path | None = None, cache: Path = kjv_corpus.DEFAULT_CACHE,
                            log=print) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if corpus_file is None:
        corpus, source = kjv_corpus.load(cache), kjv_corpus.SOURCE
    else:  # any text: paragraphs are its non-empty lines
        paragraphs = [line for line in corpus_file.read_text().splitlines() if line.strip()]
        corpus, source = kjv_corpus.split(paragraphs), str(corpus_file)
    tokenizer = train_tokenizer(corpus.train, recipe.tokenizer_vocab)
    write_tokenizer(tokenizer, out)
    train_ids, held_ids = encode(tokenizer, corpus.train), encode(tokenizer, corpus.held_out)
    live_vocab = tokenizer.get_vocab_size()
    vocab_size = -(-live_vocab // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    log(f"corpus: {len(train_ids)} training tokens, {len(held_ids)} held out; vocabulary {live_vocab}")

    model = make_model(recipe, vocab_size)
    started = time.perf_counter()
    train_loss = train(model, train_ids, recipe, log)
    train_seconds = time.perf_counter() - started
    config = save(model, recipe, out)
    # Measured on the saved (float16) weights, as users will run them.
    saved = transformers.BloomForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    held_loss = held_out_loss(saved, held_ids, recipe.seq_len)
    log(f"trained in {train_seconds:.0f} s; held-out perplexity {math.exp(held_loss):.1f}")

    (out / "README.md").write_text(README.format(
        **asdict(recipe), vocab_size=config.vocab_size, live_vocab=live_vocab,
        params=sum(p.numel() for p in model.transformer.parameters()), source=source, every=kjv_corpus.HELD_OUT_EVERY,
        train_chapters=len(corpus.train), held_chapters=len(corpus.held_out), train_tokens=len(train_ids),
        held_tokens=len(held_ids), seen_tokens=recipe.steps * recipe.batch_size * recipe.seq_len,
        epochs=recipe.steps * recipe.batch_size * recipe.seq_len / len(train_ids), train_seconds=train_seconds,
        machine=machine(), threads=torch.get_num_threads(), torch_version=torch.__version__,
        transformers_version=transformers.__version__, train_loss=train_loss, train_ppl=math.exp(train_loss),
        held_loss=held_loss, held_ppl=math.exp(held_loss), measured=MEASURED))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder to write (default: %(default)s)")
    parser.add_argument("--steps", type=int, help=f"training steps (default: {Recipe.steps})")
    parser.add_argument("--corpus", type=Path, help="train on this text file (paragraph a line) instead of the KJV")
    parser.add_argument("--cache", type=Path, default=kjv_corpus.DEFAULT_CACHE,
                        help="download folder (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1,
                        help="PyTorch threads (default: %(default)s; on shared cores one thread is the fastest)")
    parser.add_argument("--smoke", action="store_true",
                        help="a tiny model and a few steps: checks the script in seconds")
    args = parser.parse_args(argv)
    recipe = SMOKE if args.smoke else Recipe()
    if args.steps is not None:
        recipe = replace(recipe, steps=args.steps)
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    try:
        out = make_default_checkpoint(args.out, recipe, args.corpus, args.cache,
                                      log=lambda line: print(line, file=sys.stderr, flush=True))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:  # no corpus, no network, unwritable --out
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
