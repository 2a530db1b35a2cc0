"""The request bodies as pydantic models: what ``/openapi.json`` documents and FastAPI checks first.

FastAPI checks a body's types against these before our code runs (a wrong type, a missing prompt,
an unknown key: a 400 naming the field, see ``errors.py``); the values are then checked by the
request core (``generation/request/parse.py``), which gets the body as the client sent it
(``model_dump(exclude_unset=True)``). The ranges documented here (JSON schema's ``minimum``...)
are read from the core's, so what clients and fuzzers read is what the core accepts; these models
check no range themselves. Types are strict: a number is not accepted as a string, nor the other
way round, as OpenAI's own API does not.

Besides OpenAI's fields, each body takes our search options (``top_k``, ``num_beams``,
``repetition_penalty``...) and the extensions vLLM's server accepts and load generators send
(``VLLM_EXTENSIONS``); those we cannot honour are refused with a 400 naming them
(``openai_format.vllm_extensions``).
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, WithJsonSchema

from ..request.parse import documented_range

Number = float  # strict mode: an int or a float, never a string


def ranged(name: str, chat: bool = False):
    """An optional field, documented with the range the request core accepts for it."""
    return Field(None, json_schema_extra=documented_range(name, chat))


def only(value):
    """A vLLM extension accepted with the value that turns it off, and documented so."""
    return Field(None, json_schema_extra={"enum": [value, None], "description": f"vLLM's; only {value!r} here"})


def unsupported(what: str = "vLLM's; not supported by this server"):
    """A field the server refuses (a 400 naming it): the schema says it must be left out."""
    return Field(None, json_schema_extra={"not": {}, "description": what})
# Text that is not empty (our check says why an empty prompt or stop string is refused).
Text = Annotated[StrictStr, WithJsonSchema({"type": "string", "minLength": 1})]


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Body):
    include_usage: StrictBool | None = None
    continuous_usage_stats: StrictBool | None = None  # vLLM: usage on every chunk


class _Options(_Body):
    """What completions and chat share: sampling, search, streaming, vLLM's extensions."""

    model: StrictStr | None = None
    max_tokens: StrictInt | None = ranged("max_tokens")
    temperature: Number | None = ranged("temperature")
    top_p: Number | None = ranged("top_p")
    n: StrictInt | None = ranged("n")
    stop: Union[Text, list[Text], None] = None
    seed: StrictInt | None = ranged("seed")
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    presence_penalty: Number | None = ranged("presence_penalty")
    frequency_penalty: Number | None = ranged("frequency_penalty")
    logit_bias: dict[str, Number] | None = None
    user: StrictStr | None = None
    # Our search options (docs/generation-options.md).
    top_k: StrictInt | None = ranged("top_k")
    num_beams: StrictInt | None = ranged("num_beams")
    repetition_penalty: Number | None = ranged("repetition_penalty")
    length_penalty: Number | None = ranged("length_penalty")
    no_repeat_ngram_size: StrictInt | None = ranged("no_repeat_ngram_size")
    early_stopping: Union[StrictBool, Literal["never"], None] = None
    min_new_tokens: StrictInt | None = ranged("min_new_tokens")
    # vLLM's extensions (openai_format.VLLM_EXTENSIONS says which are honoured).
    ignore_eos: StrictBool | None = None
    min_tokens: StrictInt | None = ranged("min_tokens")
    skip_special_tokens: StrictBool | None = only(True)
    spaces_between_special_tokens: StrictBool | None = only(True)
    include_stop_str_in_output: StrictBool | None = only(False)
    add_special_tokens: StrictBool | None = None
    use_beam_search: StrictBool | None = None
    min_p: Number | None = only(0)
    stop_token_ids: list[StrictInt] | None = Field(None, json_schema_extra={"maxItems": 0})
    priority: StrictInt | None = only(0)
    truncate_prompt_tokens: StrictInt | None = unsupported()
    prompt_logprobs: StrictInt | None = unsupported()
    return_tokens_as_token_ids: StrictBool | None = only(False)
    # Structured output (docs/structured-output.md): at most one of these.
    guided_json: Union[StrictStr, dict, None] = Field(None, description="vLLM's: a JSON schema every answer follows")
    guided_regex: StrictStr | None = Field(None, description="vLLM's: a regular expression every answer matches")
    guided_choice: list[StrictStr] | None = Field(None, json_schema_extra={"minItems": 1},
                                                  description="vLLM's: every answer is one of these strings")
    guided_grammar: StrictStr | None = Field(None, description="vLLM's: a Lark or GBNF grammar every answer follows")
    response_format: dict | None = Field(None, description='OpenAI\'s: {"type": "text" | "json_object"} or '
                                         '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}')


class CompletionBody(_Options):
    """``POST /v1/completions``."""

    prompt: Union[Text, list[Text], list[StrictInt], list[list[StrictInt]]] = Field(json_schema_extra={"minItems": 1})
    best_of: StrictInt | None = ranged("best_of")
    logprobs: StrictInt | None = ranged("logprobs")
    echo: StrictBool | None = None
    suffix: StrictStr | None = unsupported("not supported by this server")
    engine: StrictStr | None = None
    id: StrictStr | None = None
    request_id: StrictStr | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: StrictStr


class Message(_Body):
    role: Literal["system", "user", "assistant"]
    content: Union[StrictStr, list[TextPart]]
    name: StrictStr | None = None


class ChatBody(_Options):
    """``POST /v1/chat/completions``."""

    messages: list[Message] = Field(json_schema_extra={"minItems": 1})
    max_tokens: StrictInt | None = ranged("max_tokens", chat=True)  # chat: at least one token
    max_completion_tokens: StrictInt | None = ranged("max_completion_tokens", chat=True)
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = ranged("top_logprobs", chat=True)
    best_of: StrictInt | None = ranged("best_of")


def as_sent(body: _Body) -> dict:
    """The body as the client sent it (fields it left out or sent as null stay out); message
    contents given as text parts are joined into one string."""
    raw = body.model_dump(exclude_unset=True, exclude_none=True)  # null: as if left out
    for message in raw.get("messages", []):
        if isinstance(message.get("content"), list):
            message["content"] = "".join(part["text"] for part in message["content"])
    return raw
