"""The chat shell (./bloom.py --chat): the turn format and its truncation, the hyperparameters, and
the real shell driven in a pseudo-terminal as a person would (pexpect), its replies checked against
transformers' greedy generate on the same prompt text.

Two checkpoints: a random one (replies as transformers gives them), and ``marker_checkpoint``, a
random one doctored into a bigram machine whose greedy reply to any message is " Hi there" followed
by the turn marker "\\n<human>:", so that the shell must really cut a reply at the marker.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from pathlib import Path

import pexpect
import pytest
import torch
import torch.nn.functional as F

import bloom
from generation.chat.settings import Settings, SettingError, chat_options
from generation.chat.turns import BOT, HUMAN, Conversation, MarkerFormat, TemplateFormat, TurnTooLong, turn_format
from generation.request.options import OptionError

ROOT = Path(__file__).resolve().parent.parent
RANDOM = dict(hidden_size=64, n_layer=2, n_head=4, seed=7)
MARKER = "\n<human>:"
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TIMEOUT = 60
STARTUP = 240  # loading, and a first build of the CPU kernels on a busy machine


# ---------------------------------------------------------------------------------------------
# The conversation and its turn formats


def test_marker_format_turns_and_stops():
    chat = Conversation(MarkerFormat())
    assert chat.prompt() == "<bot>:" and chat.history() == ""
    chat.add(HUMAN, "Hello")
    assert chat.prompt() == "<human>: Hello\n<bot>:"
    chat.add(BOT, "Hi there")
    chat.add(HUMAN, "How are you?")
    assert chat.history() == "<human>: Hello\n<bot>: Hi there\n<human>: How are you?\n"
    assert chat.prompt() == chat.history() + "<bot>:"
    assert MARKER in chat.stops
    chat.reset()
    assert chat.turns == []


def test_fit_drops_the_oldest_turns_in_pairs():
    chat = Conversation(MarkerFormat())
    for i in range(4):
        chat.add(HUMAN, f"question {i}")
        chat.add(BOT, f"answer {i}")
    chat.add(HUMAN, "last")
    count = len  # characters stand in for tokens
    assert chat.fit(count, 10_000) == 0 and len(chat.turns) == 9
    budget = len("<human>: question 3\n<bot>: answer 3\n<human>: last\n<bot>:")
    assert chat.fit(count, budget) == 6
    assert chat.prompt() == "<human>: question 3\n<bot>: answer 3\n<human>: last\n<bot>:"
    assert chat.fit(count, budget - 1) == 2 and chat.prompt() == "<human>: last\n<bot>:"


def test_a_message_too_long_alone_is_taken_back_and_the_history_kept():
    chat = Conversation(MarkerFormat())
    chat.add(HUMAN, "hi")
    chat.add(BOT, "hello")
    chat.add(HUMAN, "x" * 100)
    with pytest.raises(TurnTooLong, match="more than the 50 that max_length leaves"):
        chat.fit(len, 50)
    assert chat.history() == "<human>: hi\n<bot>: hello\n"


def test_the_tokenizers_chat_template_is_rendered_as_transformers_renders_it(tiny_checkpoint):
    from transformers import PreTrainedTokenizerFast

    reference = PreTrainedTokenizerFast(tokenizer_file=str(tiny_checkpoint / "tokenizer.json"))
    reference.chat_template = CHATML

    class Tokenizer:
        config = {"chat_template": CHATML, "eos_token": "</s>"}

    fmt = turn_format(Tokenizer())
    assert isinstance(fmt, TemplateFormat)
    chat = Conversation(fmt)
    chat.add(HUMAN, "Hello")
    chat.add(BOT, "Hi")
    chat.add(HUMAN, "Bye")
    messages = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi"},
                {"role": "user", "content": "Bye"}]
    assert chat.prompt() == reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat.history() == reference.apply_chat_template(messages, tokenize=False)
    # The reply ends where the template closes the assistant's turn.
    assert chat.stops == ["<|im_end|>\n<|im_start|>user", "<|im_end|>"]
    assert isinstance(turn_format(type("T", (), {"config": {}})()), MarkerFormat)


# ---------------------------------------------------------------------------------------------
# Hyperparameters


def test_chat_defaults_and_what_overrides_them():
    opts = chat_options()
    assert (opts.do_sample, opts.temperature, opts.top_k, opts.repetition_penalty, opts.max_new_tokens) == \
        (True, 0.6, 40, 1.0, 128)
    assert opts.max_length == 1024 and not opts.ignore_eos
    # --options over the chat defaults, the flags over --options.
    opts = chat_options("temperature=0.9,top_k=5,max_length=300", temperature=0.3, do_sample=None)
    assert (opts.temperature, opts.top_k, opts.max_length, opts.do_sample) == (0.3, 5, 300, True)
    with pytest.raises(OptionError, match=r"max_tokens \(128\) must be below max_length \(100\)"):
        chat_options(max_length=100)


def test_hyperparameters_are_set_with_validation():
    settings = Settings(chat_options())
    assert settings.set("temperature=0.7 max_tokens=64") == "max_tokens = 64, temperature = 0.7"
    assert settings.options.temperature == 0.7 and settings.options.max_new_tokens == 64
    assert "temperature = 0.7" in settings.show() and "sample = true" in settings.show()
    for bad, message in [("temprature=1", "unknown hyperparameter 'temprature'"),
                         ("temperature=hot", "temperature expects a number, got 'hot'"),
                         ("top_k=-1", "top_k must be >= 0"), ("sample=maybe", "sample expects true or false"),
                         ("max_tokens=0", "max_tokens must be >= 1"), ("max_tokens=5000", "must be below max_length"),
                         ("temperature", "expected name=value")]:
        with pytest.raises(SettingError, match=message):
            settings.set(f"top_k=3 {bad}")
    assert settings.options.top_k == 40  # a bad assignment changes nothing, not even the good ones before it


@pytest.mark.parametrize("argv, message", [
    (["--temperature", "0.5", "hi"], "--temperature goes with --chat"),
    (["--chat", "hi"], "--chat reads its messages from the keyboard: prompts on the command line"),
    (["--chat", "--stream"], "--stream cannot be used with it"),
    (["--chat", "--max-tokens", "200", "--max_length", "100"], "max_tokens (200) must be below max_length (100)"),
    (["--chat", "--options", "num_beams=2"], "--chat streams one reply at a time"),
])
def test_bad_chat_flags_get_one_line(argv, message, capsys):
    assert bloom.main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err


# ---------------------------------------------------------------------------------------------
# The real shell in a pseudo-terminal


def make_marker_checkpoint(folder: Path, reply: str = " Hi there") -> Path:
    """A random checkpoint doctored into a bigram machine: attention and MLP outputs are zeroed,
    then one MLP unit per rule x -> y fires only on token x and writes y's embedding (the tied LM
    head) into the residual stream, so y wins the next step by a wide margin. The rules spell
    ``reply`` after the ``:`` of ``<bot>:``, then the turn marker, then the reply again."""
    from safetensors.torch import load_file, save_file

    from generation.run.batch import BloomTokenizer
    from utils.random_checkpoint import make_random_checkpoint

    folder = make_random_checkpoint(folder, hidden_size=128, n_layer=1, n_head=4, seed=3)
    tokenizer = BloomTokenizer(folder)
    opening = tokenizer.encode("<bot>:")
    chain = tokenizer.encode("<bot>:" + reply + MARKER + reply)[len(opening) - 1 :]
    rules = dict(zip(chain, chain[1:]))
    assert all(rules[x] == y for x, y in zip(chain, chain[1:])), "the chain must be a function of the token"
    w = load_file(folder / "model.safetensors")
    emb = w["word_embeddings.weight"]
    for name in w:
        if "layernorm" in name or name.startswith("ln_f"):
            w[name] = torch.ones_like(w[name]) if name.endswith("weight") else torch.zeros_like(w[name])
        elif ".self_attention.dense." in name or ".mlp." in name:
            w[name] = torch.zeros_like(w[name])
    up, up_bias = w["h.0.mlp.dense_h_to_4h.weight"], w["h.0.mlp.dense_h_to_4h.bias"]
    up_bias.fill_(-10.0)
    down = w["h.0.mlp.dense_4h_to_h.weight"]
    for unit, (x, y) in enumerate(rules.items()):
        seen = F.layer_norm(emb[x], emb[x].shape)  # what the MLP sees of token x
        up[unit], up_bias[unit] = seen / seen.norm(), -0.5 * seen.norm()
        down[:, unit] = 8.0 * emb[y] / emb[y].norm()
    save_file(w, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def marker_checkpoint(tmp_path_factory):
    return make_marker_checkpoint(tmp_path_factory.mktemp("marker"))


def reference_reply(folder: Path, prompt: str, max_new_tokens: int, eos: bool = True) -> str:
    """transformers' greedy continuation of ``prompt``, cut at the first turn marker, as shown."""
    from transformers import BloomForCausalLM

    from generation.run.batch import BloomTokenizer

    tokenizer = BloomTokenizer(folder)
    hf = BloomForCausalLM.from_pretrained(folder).eval()
    ids = tokenizer.encode(prompt)
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=3,
                          eos_token_id=2 if eos else None)
    text = tokenizer.decode(out[0, len(ids) :].tolist())
    for stop in MarkerFormat().stops:
        text = text.split(stop)[0]
    return text.lstrip()


def spawn(*args: str, launcher: list[str] = (), preexec_fn=None) -> pexpect.spawn:
    """``./bloom.py ARGS`` in a pseudo-terminal; with ``launcher``, ``python LAUNCHER bloom.py ARGS``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TERM": "dumb", "PYTHONPATH": str(ROOT)}
    bloom_py = str(ROOT / "bloom.py")
    # Through this interpreter, not the script's shebang: the suite runs without an activated venv.
    program, argv = sys.executable, [*launcher, bloom_py, *args]
    return pexpect.spawn(program, argv, cwd=str(ROOT), env=env, encoding="utf-8", codec_errors="replace",
                         timeout=TIMEOUT, dimensions=(50, 400), preexec_fn=preexec_fn)


def ask(shell: pexpect.spawn, line: str) -> str:
    """Type ``line``; what the shell printed before its next prompt (the echo of the line left out)."""
    shell.sendline(line)
    shell.expect_exact(line)  # the terminal's echo
    shell.expect_exact(">>> ")
    return shell.before.replace("\r\n", "\n").removeprefix("\n")


def test_ctrl_c_at_the_prompt_gives_a_fresh_prompt_even_when_started_with_sigint_ignored(marker_checkpoint):
    """A shell without job control starts its background jobs with SIGINT ignored, and Python keeps
    that: the chat must still take Ctrl-C at its prompt (as it does during a reply)."""
    shell = spawn("--chat", "--weights", str(marker_checkpoint), "--sample", "f", "--max_length", "64", "--max_tokens",
                  "48", "--cpu_path", "plain", preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    shell.expect_exact(">>> ", timeout=STARTUP)
    shell.sendintr()
    shell.expect_exact(">>> ", timeout=20)
    assert ask(shell, "hello") == "Hi there\n"
    shell.sendeof()
    shell.expect(pexpect.EOF)
    assert shell.wait() == 0


def test_a_session_with_the_marker_model(marker_checkpoint):
    # PyTorch's plain operations: this session is about the shell, not the CPU kernels.
    shell = spawn("--chat", "--weights", str(marker_checkpoint), "--sample", "f", "--max_length", "64", "--max_tokens",
                  "48", "--cpu_path", "plain")
    shell.expect_exact(">>> ", timeout=STARTUP)
    assert "Chat with marker0" in shell.before and "Type a message, /help for commands" in shell.before

    # The reply is cut at the turn marker, and no part of the marker was ever printed.
    want = reference_reply(marker_checkpoint, "<human>: hello\n<bot>:", 48)
    assert want == "Hi there"
    assert ask(shell, "hello") == "Hi there\n"
    assert ask(shell, "/raw_prompt") == "<human>: hello\n<bot>: Hi there\n"

    for command in ("/help", "/?"):
        text = ask(shell, command)
        assert all(c in text for c in ("/reset", "/hyperparameters", "/raw_prompt", "/raw_say", "/quit"))
    assert ask(shell, "/hyperparameters temperature=0.7") == "set: temperature = 0.7\n"
    shown = ask(shell, "/hyperparameters")
    assert "temperature = 0.7" in shown and "sample = false" in shown and "max_tokens = 48" in shown
    assert ask(shell, "/hyperparameters temperature=-1").startswith("error: temperature must be > 0")
    assert ask(shell, "/nonsense") == "error: unknown command /nonsense; /help lists the commands\n"

    # /raw_say: the text as is, no turn format, no stop at the marker, not kept.
    assert ask(shell, "/raw_say <bot>:").startswith(" Hi there\n<human>: Hi there")
    assert ask(shell, "/raw_prompt") == "<human>: hello\n<bot>: Hi there\n"

    # 64 - 40 = 24 tokens for the prompt: two turns no longer fit; the shell says so once.
    ask(shell, "/hyperparameters max_tokens=40")
    second = ask(shell, "how are you")
    assert second.startswith("(the conversation no longer fits max_length=64") and second.endswith("Hi there\n")
    assert ask(shell, "and now") == "Hi there\n"  # said once only
    assert ask(shell, "/raw_prompt") == "<human>: and now\n<bot>: Hi there\n"
    assert ask(shell, "/reset") == "(the conversation is forgotten)\n"
    assert ask(shell, "/raw_prompt") == "(the conversation is empty)\n"

    shell.sendline("/quit")
    shell.expect(pexpect.EOF)
    assert shell.wait() == 0  # the process's own exit status (close() would end a slow exit with a signal)


def test_greedy_replies_equal_transformers_and_ctrl_c_stops_a_reply(make_ckpt):
    folder = make_ckpt(**RANDOM)
    shell = spawn("--chat", "--weights", str(folder), "--sample", "f", "--max-tokens", "24", "--max_length", "4096",
                  "--ignore_eos", "t")
    shell.expect_exact(">>> ", timeout=STARTUP)  # the CPU kernels may be built first
    first = ask(shell, "Hello, who are you?")
    history = "<human>: Hello, who are you?\n<bot>:"
    assert first == reference_reply(folder, history, 24, eos=False) + "\n"
    history += " " + first.strip() + "\n<human>: Tell me more.\n<bot>:"
    assert ask(shell, "Tell me more.") == reference_reply(folder, history, 24, eos=False) + "\n"

    # A long reply, stopped by Ctrl-C as soon as it starts: the prompt comes back.
    ask(shell, "/hyperparameters max_tokens=4000")
    shell.sendline("Tell me a long story.")
    shell.expect_exact("Tell me a long story.")
    shell.expect(r"\S")  # the reply has started
    shell.sendintr()
    shell.expect_exact("(stopped)")
    shell.expect_exact(">>> ")
    assert ask(shell, "/hyperparameters max_tokens=8").startswith("set:")
    # The partial reply stays in the conversation, and the shell goes on.
    assert "<human>: Tell me a long story.\n<bot>: " in ask(shell, "/raw_prompt")
    shell.sendintr()  # Ctrl-C at the prompt: a fresh prompt
    shell.expect_exact(">>> ")
    shell.sendeof()  # Ctrl-D leaves cleanly
    shell.expect(pexpect.EOF)
    status = shell.wait()
    assert status == 0, (shell.signalstatus, shell.before)


@pytest.mark.slow
def test_a_chat_under_deepspeed_on_two_ranks(make_ckpt):
    """Slow-ish (two ranks start, ~20 s): rank 0 reads the keyboard, both ranks generate, only rank
    0 prints, and the reply equals transformers' on the whole model."""
    folder = make_ckpt(**RANDOM)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    shell = spawn("--chat", "--weights", str(folder), "--device", "cpu", "--sample", "f", "--max_tokens", "16",
                  "--max_length", "256", "--cpu_path", "plain", launcher=["-m", "deepspeed.launcher.runner", "--num_gpus", "2",
                                                   "--master_port", str(port)])
    shell.expect_exact(">>> ", timeout=STARTUP)
    reply = ask(shell, "Hello there")
    assert reply == reference_reply(folder, "<human>: Hello there\n<bot>:", 16) + "\n"
    assert ask(shell, "/hyperparameters temperature=0.7") == "set: temperature = 0.7\n"  # printed once
    shell.sendeof()
    shell.expect(pexpect.EOF, timeout=120)
    assert shell.wait() == 0, shell.before


class Typed:
    """Lines typed at the shell, for a shell run in this process."""

    def __init__(self, *lines: str):
        self.lines = list(lines)

    def read(self, prompt: str) -> str | None:
        return self.lines.pop(0) if self.lines else None


def test_a_checkpoint_with_a_chat_template_talks_through_it(make_ckpt, tmp_path):
    """The shell in this process on a checkpoint whose tokenizer_config.json has a ChatML template:
    the prompt is the template's, and the greedy reply is transformers' on that prompt."""
    import io
    import json
    import shutil

    from transformers import PreTrainedTokenizerFast

    from bloom_hpu.runtime.cpu import CpuOptions
    from generation.chat.shell import ChatShell
    from generation.generator import Generator

    folder = tmp_path / "templated"
    shutil.copytree(make_ckpt(**RANDOM), folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHATML}))
    generator = Generator.from_pretrained(folder, device="cpu", cpu=CpuOptions(path="plain"))
    out = io.StringIO()
    options = chat_options(max_length=128, max_new_tokens=12, do_sample=False)
    shell = ChatShell(generator, Settings(options), Conversation(turn_format(generator.tokenizer)),
                      Typed("Hello", "/raw_prompt"), out=out)
    assert shell.run() == 0

    reference = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    reference.chat_template = CHATML
    prompt = reference.apply_chat_template([{"role": "user", "content": "Hello"}], tokenize=False,
                                           add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    want = reference_reply(folder, prompt, 12)
    for stop in ("<|im_end|>\n<|im_start|>user", "<|im_end|>"):
        want = want.split(stop)[0]
    lines = out.getvalue().splitlines()
    assert "chat template" in lines[0]
    history = prompt.removesuffix("<|im_start|>assistant\n") + f"<|im_start|>assistant\n{want.strip()}<|im_end|>\n"
    assert out.getvalue().endswith(f"{want}\n{history}\n")


def test_rank_0_broadcasts_each_line_and_heartbeats_while_nobody_types(monkeypatch):
    """The line protocol of a tensor-parallel chat, with the collective recorded (the 2-rank run
    above covers it for real, but not a user who thinks for minutes)."""
    import time

    from bloom_hpu.tp import Parallel
    from generation.chat.lines import BroadcastLines

    sent = []
    monkeypatch.setattr(torch.distributed, "broadcast", lambda t, src: sent.append(t.clone()))

    class Slow:
        def read(self, prompt):
            time.sleep(0.35)
            return "héllo"

    assert BroadcastLines(Parallel(0, 2), Slow(), heartbeat=0.1).read(">>> ") == "héllo"
    assert BroadcastLines(Parallel(0, 2), Typed()).read(">>> ") is None  # Ctrl-D
    lengths = [int(t[0]) for t in sent if t.dtype == torch.int64]
    assert len(lengths) >= 3 and set(lengths[:-2]) == {-2}  # heartbeats while the user thinks
    assert lengths[-2:] == [len("héllo".encode()), -1]

    replay = iter(sent)
    monkeypatch.setattr(torch.distributed, "broadcast", lambda t, src: t.copy_(next(replay)))
    rank1 = BroadcastLines(Parallel(1, 2))
    assert rank1.read(">>> ") == "héllo" and rank1.read(">>> ") is None


def test_the_next_prompt_keeps_the_ids_the_model_read_and_wrote(tiny_checkpoint):
    """A reply is not encoded again from its text: the next prompt starts with the ids of the last
    prompt and of the reply as written (so the prefix cache's tail of the last turn matches it),
    as far as the conversation's text agrees with them."""
    from generation.run.batch import BloomTokenizer

    tokenizer = BloomTokenizer(tiny_checkpoint)
    conversation = Conversation(MarkerFormat())
    conversation.add(HUMAN, "Hi")
    first = conversation.prompt_ids(tokenizer)
    assert first == tokenizer.encode("<human>: Hi\n<bot>:")
    # The model wrote " Hello" one character a token, which encoding the text would not give back.
    written = [tokenizer.encode(c)[0] for c in " Hello"]
    assert tokenizer.encode(" Hello") != written
    conversation.add(BOT, "Hello")
    conversation.add(HUMAN, "And?")
    conversation.held = first + written
    ids = conversation.prompt_ids(tokenizer)
    assert ids[: len(first) + len(written)] == first + written
    assert tokenizer.decode(ids) == conversation.prompt()
    # What it wrote past the reply's text (the start of a next turn marker) is kept as far as the
    # text agrees: "\n<human>:" is what the format writes next.
    conversation.held = first + written + tokenizer.encode("\n<human>:")
    ids = conversation.prompt_ids(tokenizer)
    assert ids[: len(conversation.held)] == conversation.held and tokenizer.decode(ids) == conversation.prompt()
    # Turns dropped, or a reset: nothing held agrees, and the prompt is encoded afresh.
    conversation.turns = conversation.turns[2:]
    assert conversation.prompt_ids(tokenizer) == tokenizer.encode(conversation.prompt())
    conversation.reset()
    assert conversation.held == []


def test_each_turn_continues_the_ids_the_model_wrote_and_finds_them_in_the_prefix_cache(make_ckpt):
    """The shell in this process on random weights (whose replies need not encode back to the ids
    written): every prompt sent starts with the previous prompt and the reply's ids as written (as
    far as the conversation's text keeps them), each reply is transformers' greedy continuation of
    the ids sent, and the prefix cache serves everything the previous turn computed."""
    import io

    from transformers import BloomForCausalLM

    from bloom_hpu.runtime.cpu import CpuOptions
    from generation.chat.shell import ChatShell
    from generation.generator import Generator

    folder = make_ckpt(**RANDOM)
    generator = Generator.from_pretrained(folder, device="cpu", cpu=CpuOptions(path="plain"), prefix_cache="16MB")
    calls = []
    generate = generator.generate

    def spy(prompts, *args, **kwargs):
        results = generate(prompts, *args, **kwargs)
        calls.append((prompts[0], results[0]))
        return results

    generator.generate = spy
    options = chat_options(max_length=512, max_new_tokens=16, do_sample=False)
    messages = ("Hello there", "Tell me more about it", "And then?", "Why so?")
    shell = ChatShell(generator, Settings(options), Conversation(turn_format(generator.tokenizer)),
                      Typed(*messages), out=io.StringIO())
    assert shell.run() == 0
    assert len(calls) == len(messages)
    hf = BloomForCausalLM.from_pretrained(folder).eval()
    tokenizer = generator.tokenizer
    kept_reply_ids = 0
    for turn, (sent, result) in enumerate(calls):
        assert isinstance(sent, list)
        with torch.no_grad():
            out = hf.generate(torch.tensor([sent]), max_new_tokens=16, do_sample=False, pad_token_id=3, eos_token_id=2)
        assert result.token_ids == out[0, len(sent):].tolist()[: len(result.token_ids)]
        if turn == 0:
            continue
        before, wrote = calls[turn - 1][0], calls[turn - 1][1].token_ids
        text = tokenizer.decode(sent)
        kept = max(n for n in range(len(wrote) + 1) if text.startswith(tokenizer.decode(before + wrote[:n])))
        assert sent[: len(before) + kept] == before + wrote[:kept]
        kept_reply_ids += kept
        # Stored after the last turn: its prompt and reply but the reply's last token (never fed back).
        assert result.cached_tokens == min(len(before) + kept, len(before) + len(wrote) - 1, len(sent) - 1)
    assert kept_reply_ids > 0


def test_the_shell_feeds_back_the_ids_written_not_their_text_encoded_again(tiny_checkpoint):
    """The first reply's ids made one token per character (the same text, ids the encoder would
    not give): the next prompt carries those ids, not the text's encoding."""
    import io

    from bloom_hpu.runtime.cpu import CpuOptions
    from generation.chat.shell import ChatShell
    from generation.generator import Generator

    generator = Generator.from_pretrained(tiny_checkpoint, device="cpu", cpu=CpuOptions(path="plain"))
    tokenizer, generate, sent, written = generator.tokenizer, generator.generate, [], []

    def spy(prompts, *args, **kwargs):
        results = generate(prompts, *args, **kwargs)
        sent.append(prompts[0])
        if not written:  # the first reply, one token per character
            sequence = results[0].sequences[0]
            written.extend(tokenizer.encode(c)[0] for c in sequence.text)
            assert tokenizer.decode(written) == sequence.text and written != tokenizer.encode(sequence.text)
            sequence.token_ids = list(written)
        return results

    generator.generate = spy
    options = chat_options(max_length=256, max_new_tokens=12, do_sample=False)
    shell = ChatShell(generator, Settings(options), Conversation(turn_format(tokenizer)),
                      Typed("Hello there", "And then?"), out=io.StringIO())
    assert shell.run() == 0
    kept = len(tokenizer.decode(written).rstrip())  # the conversation keeps the reply's text stripped
    assert sent[1][: len(sent[0]) + kept] == sent[0] + written[:kept]
    assert sent[1] != tokenizer.encode(tokenizer.decode(sent[1]))
