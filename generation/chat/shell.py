"""The terminal loop of ``./bloom.py --chat``: a banner, a ``>>> `` prompt, replies streamed as
they are generated, and slash commands.

A reply is generated from the whole conversation (``turns.Conversation``) and ends at the model's
EOS, at ``max_tokens``, or where the model starts the next turn: the turn marker is a stop string,
which streaming (``streaming.generate_streaming``) never gives out, not even its first characters
(they are held back until the text is known not to be the marker).

Ctrl-C while a reply is generated stops it at the next step boundary and returns to the prompt (a
second Ctrl-C interrupts at once); the part already printed stays in the conversation, as the user
saw it. The reply is generated on the main thread, so the shell needs no other. Under a launcher (deepspeed, torchrun) the launcher
itself stops every rank on Ctrl-C, so there Ctrl-C ends the session (use /quit or Ctrl-D to leave
normally). Ctrl-D (end of input) leaves with status 0.
"""

from __future__ import annotations

import signal
import sys
import threading
from contextlib import contextmanager

from ..run.streaming import generate_streaming
from .lines import line_source, use_line_editing
from .settings import HYPERPARAMETERS, SettingError, Settings
from .turns import BOT, HUMAN, Conversation, TurnTooLong, turn_format

PROMPT = ">>> "

HELP = f"""Type a message and press Enter: the model replies. Commands:
  /help, /?                    this help
  /reset                       forget the conversation
  /hyperparameters             show the generation settings
  /hyperparameters k=v ...     change them, e.g. /hyperparameters temperature=0.7 max_tokens=64
                               ({', '.join(HYPERPARAMETERS)})
  /raw_prompt                  print the conversation exactly as the model reads it
  /raw_say TEXT                send TEXT to the model as is (no turn format, not kept in the conversation)
  /quit                        leave (Ctrl-D too)
Ctrl-C stops a reply being generated (what was printed stays in the conversation)."""


@contextmanager
def ctrl_c_sets(event: threading.Event, enabled: bool = True):
    """While inside: the first Ctrl-C sets ``event`` (the generation stops at its next step
    boundary), a second one interrupts at once. Only in the main thread, where Python runs signal
    handlers."""
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        if event.is_set():
            raise KeyboardInterrupt
        event.set()

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@contextmanager
def ctrl_c_interrupts(enabled: bool = True):
    """While inside: Ctrl-C raises KeyboardInterrupt, as in Python's own shell, even in a process
    that started with SIGINT ignored (a background job of a shell without job control inherits
    that, and Python keeps it), so that Ctrl-C at the prompt always gives a fresh prompt. Only in the
    main thread."""
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


class ChatShell:
    def __init__(self, generator, settings: Settings, conversation: Conversation, lines, *, out=None,
                 interruptible: bool = True, name: str = "BLOOM"):
        self.generator = generator
        self.settings = settings
        self.conversation = conversation
        self.lines = lines
        self.out = out or sys.stdout
        self.interruptible = interruptible  # False under a launcher: Ctrl-C ends the session
        self.name = name
        self.warned_truncation = False
        self.written: list[int] = []  # the token ids of the last reply (``stream``)
        self.commands = {
            "help": self.do_help, "?": self.do_help, "reset": self.do_reset,
            "hyperparameters": self.do_hyperparameters, "raw_prompt": self.do_raw_prompt,
            "raw_say": self.do_raw_say, "quit": self.do_quit,
        }

    def say(self, text: str = "", end: str = "\n") -> None:
        self.out.write(text + end)
        self.out.flush()

    def run(self) -> int:
        with ctrl_c_interrupts(enabled=self.interruptible):
            return self._session()

    def _session(self) -> int:
        opts = self.settings.options
        self.say(f"Chat with {self.name} ({self.conversation.format.describe()}; max_length {opts.max_length}, "
                 f"{opts.max_new_tokens} new tokens per reply).")
        self.say("Type a message, /help for commands, /quit or Ctrl-D to leave.")
        while True:
            try:
                line = self.lines.read(PROMPT)
            except KeyboardInterrupt:
                if not self.interruptible:
                    raise
                self.say()  # Ctrl-C at the prompt: a fresh prompt, as in Python's shell
                continue
            if line is None:  # Ctrl-D
                self.say()
                return 0
            if not self.handle(line):
                return 0

    def handle(self, line: str) -> bool:
        """One typed line; False when the session should end."""
        text = line.strip()
        if not text:
            return True
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            self.say("error: that line is not UTF-8 text")
            return True
        if text.startswith("/"):
            name, _, argument = text[1:].partition(" ")
            command = self.commands.get(name)
            if command is None:
                self.say(f"error: unknown command /{name}; /help lists the commands")
                return True
            return command(argument.strip()) is not False
        self.reply_to(text)
        return True

    # --- the conversation ------------------------------------------------------------------------

    def reply_to(self, text: str) -> None:
        opts = self.settings.options
        self.conversation.add(HUMAN, text)
        tokenizer = self.generator.tokenizer
        try:
            dropped = self.conversation.fit(lambda s: len(tokenizer.encode(s)), opts.max_length - opts.max_new_tokens)
            prompt = self.conversation.prompt_ids(tokenizer)
        except ValueError as error:  # TurnTooLong, or a chat template that fails on these messages
            if not isinstance(error, TurnTooLong):
                self.conversation.turns.pop()
            self.say(f"error: {error}")
            return
        if dropped and not self.warned_truncation:
            self.say(f"(the conversation no longer fits max_length={opts.max_length} with max_tokens="
                     f"{opts.max_new_tokens}: its oldest turns are dropped from now on)")
            self.warned_truncation = True
        reply = self.stream(prompt, self.conversation.stops, strip=True)
        if reply is None:
            self.conversation.turns.pop()  # nothing was generated: the message is taken back
        else:
            self.conversation.add(BOT, reply.strip())
            self.conversation.held = prompt + self.written

    def stream(self, prompt: str | list[int], stops: list[str], strip: bool) -> str | None:
        """Print the reply to ``prompt`` as it comes; returns its text (None after an error), and
        keeps the token ids written in ``self.written`` (none where the reply was stopped).
        ``strip``: leave out the blanks a reply starts with (the space after ``<bot>:``)."""
        shown: list[str] = []
        self.written = []

        def show(piece: str) -> None:
            if strip and not shown:
                piece = piece.lstrip()
                if not piece:
                    return
            shown.append(piece)
            self.out.write(piece)
            self.out.flush()

        stop_now = threading.Event()
        try:
            with ctrl_c_sets(stop_now, enabled=self.interruptible):
                result = generate_streaming(self.generator, prompt, self.settings.options, show,
                                            stop=stops or None, cancelled=stop_now)
            if result is not None:
                self.written = result.token_ids
        except KeyboardInterrupt:  # a second Ctrl-C, or one under a launcher
            if not self.interruptible:
                raise
            stop_now.set()
        except ValueError as error:  # the prompt or the options against the model: the session goes on
            self.say(f"{chr(10) if shown else ''}error: {error}")
            return None
        if stop_now.is_set():
            self.say("\n(stopped)" if shown else "(stopped)")
        else:
            self.say()
        return "".join(shown)

    # --- commands ---------------------------------------------------------------------------------

    def do_help(self, argument: str) -> None:
        self.say(HELP)

    def do_reset(self, argument: str) -> None:
        self.conversation.reset()
        self.warned_truncation = False
        self.say("(the conversation is forgotten)")

    def do_hyperparameters(self, argument: str) -> None:
        if not argument:
            self.say(self.settings.show())
            return
        try:
            self.say(f"set: {self.settings.set(argument)}")
        except SettingError as error:
            self.say(f"error: {error}")

    def do_raw_prompt(self, argument: str) -> None:
        history = self.conversation.history()
        self.say(history if history else "(the conversation is empty)", end="" if history.endswith("\n") else "\n")

    def do_raw_say(self, argument: str) -> None:
        if not argument:
            self.say("error: /raw_say needs the text to send, e.g. /raw_say Once upon a time")
            return
        self.stream(argument, [], strip=False)

    def do_quit(self, argument: str) -> bool:
        return False


def run_chat(generator, options, parallel, name: str = "BLOOM") -> int:
    """The shell on ``generator``; every rank of a tensor-parallel run calls it (rank 0 reads)."""
    use_line_editing()
    shell = ChatShell(generator, Settings(options), Conversation(turn_format(generator.tokenizer)),
                      line_source(parallel), interruptible=parallel.world_size <= 1, name=name)
    return shell.run()
