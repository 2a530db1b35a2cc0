"""A conversation as turns, and the text the model sees of it.

Two turn formats:

* ``MarkerFormat`` (the default, as OpenChatKit's bots): one line per turn, ``<human>: text`` and
  ``<bot>: text``; a reply is asked for with an open ``<bot>:`` and ends where the model starts
  the next turn (``\\n<human>:`` or ``\\n<bot>:``), the stop strings.
* ``TemplateFormat``: the tokenizer's ``chat_template`` (tokenizer_config.json), rendered with
  jinja2 as transformers renders it (``messages`` of role user/assistant,
  ``add_generation_prompt``). Its stop strings are what the template writes between the end of a
  reply and the start of the next user message.

``Conversation.fit`` drops the oldest turns (a human turn with its reply) until the prompt and the
reply's ``max_tokens`` fit ``max_length``.

The model reads the conversation as token ids, and the ids it read and wrote last turn stay what
it reads next turn as far as the text allows (``prompt_ids``): a reply is not encoded again from
its text, which need not give back the ids the model wrote. So the next turn's prompt starts with
exactly the tokens the prefix cache stored of the last (``docs/prefix-cache.md``), and the model
continues its own tokens, as it does within a reply.
"""

from __future__ import annotations

from dataclasses import dataclass

HUMAN, BOT = "human", "bot"


class TurnTooLong(ValueError):
    """The newest message alone does not fit; the message is meant for the user as is."""


@dataclass(frozen=True)
class Turn:
    role: str  # HUMAN or BOT
    text: str


class MarkerFormat:
    """``<human>: …`` / ``<bot>: …`` lines."""

    def __init__(self, human: str = "<human>", bot: str = "<bot>"):
        self.human, self.bot = human, bot
        self.stops = [f"\n{human}:", f"\n{bot}:"]

    def render(self, turns: list[Turn], open_reply: bool) -> str:
        lines = [f"{self.human if t.role == HUMAN else self.bot}: {t.text}\n" for t in turns]
        # No space after the open marker: the model writes it, as the first character of its reply.
        return "".join(lines) + (f"{self.bot}:" if open_reply else "")

    def describe(self) -> str:
        return f"turns as {self.human}: / {self.bot}: lines"


class TemplateError(ValueError):
    """The tokenizer's chat_template cannot be used; the message is meant for the user as is."""


class TemplateFormat:
    """The tokenizer's jinja2 ``chat_template``."""

    def __init__(self, template: str, special: dict[str, str]):
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise jinja2.TemplateError(message)

        # As transformers renders templates: sandboxed, trim_blocks and lstrip_blocks.
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        try:
            self._template = env.from_string(template)
        except jinja2.TemplateError as error:
            raise TemplateError(f"the tokenizer's chat_template is not a valid jinja2 template: {error}") from None
        self._special = special
        self.stops = self._turn_end()

    def render(self, turns: list[Turn], open_reply: bool) -> str:
        import jinja2

        messages = [{"role": "user" if t.role == HUMAN else "assistant", "content": t.text} for t in turns]
        try:
            return self._template.render(messages=messages, add_generation_prompt=open_reply, **self._special)
        except jinja2.TemplateError as error:
            raise TemplateError(f"the tokenizer's chat_template failed: {error}") from None

    def _turn_end(self) -> list[str]:
        """What the template writes after a reply before the next user message: the whole of it
        (trailing blanks cut: the next message's own text follows them), and its first line, which
        is where the model closes its turn (``<|im_end|>`` in ChatML)."""
        a, b, c = "\x00reply\x00", "\x00next\x00", "\x00first\x00"
        text = self.render([Turn(HUMAN, c), Turn(BOT, a), Turn(HUMAN, b)], open_reply=False)
        if a not in text or b not in text:
            raise TemplateError("the tokenizer's chat_template does not write the messages' contents")
        between = text[text.index(a) + len(a) : text.index(b)].rstrip()
        stops = [between] if between.strip() else []
        first_line = between.split("\n", 1)[0]
        if first_line.strip() and first_line != between:
            stops.append(first_line)
        return stops

    def describe(self) -> str:
        return "turns in the tokenizer's chat template"


def turn_format(tokenizer):
    """The tokenizer's chat template where it has one (a string), else ``<human>:`` / ``<bot>:``."""
    config = getattr(tokenizer, "config", {}) or {}
    template = config.get("chat_template")
    if isinstance(template, list):  # transformers' named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if not isinstance(template, str) or not template.strip():
        return MarkerFormat()
    special = {k: v for k, v in config.items() if k.endswith("_token") and isinstance(v, str)}
    special.setdefault("bos_token", "")
    special.setdefault("eos_token", "")
    return TemplateFormat(template, special)


class Conversation:
    """The turns so far, in one turn format."""

    def __init__(self, fmt):
        self.format = fmt
        self.turns: list[Turn] = []
        self.held: list[int] = []  # the ids the model read and wrote last turn

    @property
    def stops(self) -> list[str]:
        return self.format.stops

    def reset(self) -> None:
        self.turns.clear()
        self.held = []

    def prompt_ids(self, tokenizer) -> list[int]:
        """``prompt()`` as token ids: the longest start of ``held`` whose text the prompt starts
        with, then the rest of the prompt encoded (all of it encoded where nothing is held, or
        the oldest turns were dropped)."""
        text = self.prompt()
        for keep in range(len(self.held), 0, -1):
            start = tokenizer.decode(self.held[:keep])
            if text.startswith(start) and len(start) < len(text):
                return self.held[:keep] + tokenizer.encode(text[len(start):])
        return tokenizer.encode(text)

    def add(self, role: str, text: str) -> None:
        self.turns.append(Turn(role, text))

    def history(self) -> str:
        """The conversation so far as the model reads it (without the open reply)."""
        return self.format.render(self.turns, open_reply=False)

    def prompt(self) -> str:
        """The text sent to the model to get the next reply."""
        return self.format.render(self.turns, open_reply=True)

    def fit(self, count_tokens, budget: int) -> int:
        """Drop the oldest turns until ``count_tokens(prompt())`` is at most ``budget``; returns how
        many turns were dropped. The newest turn (the human's message) is never dropped: if it does
        not fit even alone, it is taken back, the history is kept, and TurnTooLong says so."""
        alone = count_tokens(self.format.render(self.turns[-1:], open_reply=True))
        if alone > budget:
            self.turns.pop()
            raise TurnTooLong(f"this message takes {alone} tokens with its turn markers, more than the "
                              f"{budget} that max_length leaves beside max_tokens; write less, lower "
                              "max_tokens, or start with a larger --max_length")
        dropped = 0
        while count_tokens(self.prompt()) > budget:
            # A human turn with the reply that followed it, so the history still opens with a human turn.
            take = 2 if len(self.turns) > 2 and self.turns[1].role == BOT else 1
            del self.turns[:take]
            dropped += take
        return dropped
