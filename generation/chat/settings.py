"""The chat's hyperparameters: their defaults, the command-line flags and ``--options`` that set
them at start, and ``/hyperparameters name=value`` that changes them during a session.

Defaults are those of OpenChatKit-style bots: sampling on, temperature 0.6, top_k 40,
repetition_penalty 1.0, 128 new tokens. A chat also needs room for its history, so its
``max_length`` (prompt + reply, the static cache length) defaults to 1024 rather than 128, with
prompts and the attention window in buckets of 128 tokens (``bucket_width``) so that a short
conversation does not pay for 1024 slots in every step. Precedence: these defaults, then
``--options``, then ``--max_length`` and the chat flags.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..request.options import OPTIONS_BY_NAME, GenerationOptions, OptionError, build_options, coerce, parse_options

CHAT_MAX_LENGTH = 1024
CHAT_BUCKET_WIDTH = 128
# Generation options whose chat defaults differ from the library's. ignore_eos: a reply ends at
# the model's EOS, as a turn marker ends it.
CHAT_DEFAULTS = dict(do_sample=True, temperature=0.6, top_k=40, repetition_penalty=1.0, max_new_tokens=128,
                     max_length=CHAT_MAX_LENGTH, bucket_width=CHAT_BUCKET_WIDTH, ignore_eos=False)

# The names a chat user sees -> the generation option each one sets.
HYPERPARAMETERS = {
    "max_tokens": "max_new_tokens",
    "sample": "do_sample",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "repetition_penalty": "repetition_penalty",
}


# The hyperparameters bloom.py also takes as flags (--max_tokens, --sample...).
CHAT_FLAGS = ("max_tokens", "sample", "temperature", "top_k", "repetition_penalty")
KINDS = {bool: "true or false", int: "an integer", float: "a number"}


class SettingError(ValueError):
    """A bad ``/hyperparameters`` argument; the message is meant for the user as is."""


def chat_options(options_text: str = "", **flags) -> GenerationOptions:
    """The chat's options at start. ``flags``: values given on the command line (None: not given),
    under generation-option names (max_length, max_new_tokens, do_sample, temperature...)."""
    given, _ = parse_options(options_text) if options_text else ({}, {})
    values = {k: v for k, v in CHAT_DEFAULTS.items() if k not in given}
    values.update({k: v for k, v in flags.items() if v is not None})
    opts = build_options(options_text, **values)
    check_room(opts)
    return opts


def check_room(opts: GenerationOptions) -> None:
    if opts.max_new_tokens >= opts.max_length:
        raise OptionError(f"max_tokens ({opts.max_new_tokens}) must be below max_length ({opts.max_length}): "
                          "the conversation needs room too")


@dataclass
class Settings:
    """The options every reply is generated with; ``/hyperparameters`` changes them."""

    options: GenerationOptions

    def show(self) -> str:
        lines = [f"  {name} = {_shown(getattr(self.options, option))}" for name, option in HYPERPARAMETERS.items()]
        lines.append(f"  max_length = {self.options.max_length} (prompt + reply; set at start with --max_length)")
        return "\n".join(lines)

    def set(self, assignments: str) -> str:
        """Apply ``name=value [name=value ...]`` (all or nothing); returns what changed, shown."""
        changes = {}
        for item in assignments.replace(",", " ").split():
            name, eq, raw = item.partition("=")
            if not eq or not raw:
                raise SettingError(f"expected name=value, got {item!r} (e.g. /hyperparameters temperature=0.7)")
            if name not in HYPERPARAMETERS:
                raise SettingError(f"unknown hyperparameter {name!r}; choose among {', '.join(HYPERPARAMETERS)}")
            option = HYPERPARAMETERS[name]
            try:
                changes[option] = coerce(option, raw)
            except OptionError:
                raise SettingError(f"{name} expects {KINDS[OPTIONS_BY_NAME[option].type]}, got {raw!r}") from None
        try:
            updated = self.options.updated(**changes)
            check_room(updated)
        except OptionError as error:
            raise SettingError(_user_names(str(error))) from None
        self.options = updated
        return ", ".join(f"{name} = {_shown(getattr(updated, HYPERPARAMETERS[name]))}"
                         for name in HYPERPARAMETERS if HYPERPARAMETERS[name] in changes)


def _shown(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _user_names(message: str) -> str:
    """An option error in the names the chat shows (max_new_tokens -> max_tokens...)."""
    for name, option in HYPERPARAMETERS.items():
        if name != option:
            message = message.replace(option, name)
    return message
