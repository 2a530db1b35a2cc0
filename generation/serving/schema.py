"""The request bodies as pydantic models: what ``/openapi.json`` documents and FastAPI checks first.

FastAPI checks a body's types against these before our code runs (a wrong type, a missing prompt,
an unknown key: a 400 naming the field, see ``errors.py``); the values are then checked by the
request core (``generation/request/parse.py``), which gets the body as the client sent it
(``model_dump(exclude_unset=True)``). The ranges documented here (JSON schema's ``minimum``...)
are read from the core's, so what clients and fuzzers read is what the core accepts; these models
check no range themselves. Types are strict: a number is not accepted as a string, nor the other
way round, as OpenAI's own API does not (an integer may be written 3.0: JSON schema's integer).

Besides OpenAI's fields, each body takes our search options (``top_k``, ``num_beams``,
``repetition_penalty``...) and the extensions vLLM's server accepts and load generators send
(``VLLM_EXTENSIONS``); those we cannot honour are refused with a 400 naming them
(``openai_format.vllm_extensions``).
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictInt, StrictStr, WithJsonSchema

from ..request.parse import documented_range

Number = float  # strict mode: an int or a float, never a string


def _integral(value):
    """JSON schema's integer: a number with no fraction, so 3.0 is 3 (the core reads it so too)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


Integer = Annotated[StrictInt, BeforeValidator(_integral)]  # never a string or a boolean


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
# A prompt given as token ids: not empty, each id >= 0 (below the vocabulary and at most
# max_length - 1 of them: the served model's bounds, stated by ``state_the_model``).
TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
TokenIds = Annotated[list[Integer], WithJsonSchema(TOKEN_IDS)]
# OpenAI's response_format: what ``request/grammar.py`` reads of it (other keys are ignored).
RESPONSE_FORMAT = {"type": "object", "oneOf": [
    {"properties": {"type": {"enum": ["text", "json_object"]}}, "required": ["type"]},
    {"properties": {"type": {"const": "json_schema"},
                    "json_schema": {"type": "object", "properties": {"schema": {"type": "object"}},  # (its name: any)
                                    "required": ["schema"]}},
     "required": ["type", "json_schema"]}]}
ResponseFormat = Annotated[dict, WithJsonSchema(RESPONSE_FORMAT)]


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Body):
    include_usage: StrictBool | None = None
    continuous_usage_stats: StrictBool | None = None  # vLLM: usage on every chunk


class _Options(_Body):
    """What completions and chat share: sampling, search, streaming, vLLM's extensions."""

    model: StrictStr | None = None
    max_tokens: Integer | None = ranged("max_tokens")
    temperature: Number | None = ranged("temperature")
    top_p: Number | None = ranged("top_p")
    n: Integer | None = ranged("n")
    stop: Union[Text, list[Text], None] = None
    seed: Integer | None = ranged("seed")
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    presence_penalty: Number | None = ranged("presence_penalty")
    frequency_penalty: Number | None = ranged("frequency_penalty")
    logit_bias: dict[str, Number] | None = Field(None, json_schema_extra={"maxProperties": 0},
                                                description="not supported: {} only")
    user: StrictStr | None = None
    # Our search options (docs/generation-options.md).
    top_k: Integer | None = ranged("top_k")
    num_beams: Integer | None = ranged("num_beams")
    repetition_penalty: Number | None = ranged("repetition_penalty")
    length_penalty: Number | None = ranged("length_penalty")
    no_repeat_ngram_size: Integer | None = ranged("no_repeat_ngram_size")
    early_stopping: Union[StrictBool, Literal["never"], None] = None
    min_new_tokens: Integer | None = ranged("min_new_tokens")
    # vLLM's extensions (openai_format.VLLM_EXTENSIONS says which are honoured).
    ignore_eos: StrictBool | None = None
    min_tokens: Integer | None = ranged("min_tokens")
    skip_special_tokens: StrictBool | None = only(True)
    spaces_between_special_tokens: StrictBool | None = only(True)
    include_stop_str_in_output: StrictBool | None = only(False)
    add_special_tokens: StrictBool | None = None
    use_beam_search: StrictBool | None = None
    min_p: Number | None = only(0)
    stop_token_ids: list[Integer] | None = Field(None, json_schema_extra={"maxItems": 0})
    priority: Integer | None = only(0)
    truncate_prompt_tokens: Integer | None = unsupported()
    prompt_logprobs: Integer | None = unsupported()
    return_tokens_as_token_ids: StrictBool | None = only(False)
    # Structured output (docs/structured-output.md): at most one of these.
    guided_json: Union[StrictStr, dict, None] = Field(None, description="vLLM's: a JSON schema every answer follows")
    guided_regex: StrictStr | None = Field(None, description="vLLM's: a regular expression every answer matches")
    guided_choice: list[StrictStr] | None = Field(None, json_schema_extra={"minItems": 1},
                                                  description="vLLM's: every answer is one of these strings")
    guided_grammar: StrictStr | None = Field(None, description="vLLM's: a Lark or GBNF grammar every answer follows")
    response_format: ResponseFormat | None = Field(None, description='OpenAI\'s: {"type": "text" | "json_object"} or '
                                         '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}')


class CompletionBody(_Options):
    """``POST /v1/completions``."""

    # max_tokens 0 (scoring the prompt) asks for echo: true, else there is nothing to return.
    model_config = ConfigDict(json_schema_extra={"anyOf": [
        {"properties": {"max_tokens": {"not": {"const": 0}}}},
        {"properties": {"echo": {"const": True}}, "required": ["echo"]}]})

    prompt: Union[Text, list[Text], TokenIds, list[TokenIds]] = Field(json_schema_extra={"minItems": 1})
    best_of: Integer | None = ranged("best_of")
    logprobs: Integer | None = ranged("logprobs")
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

    # top_logprobs above 0 asks for logprobs: true (as OpenAI and vLLM).
    model_config = ConfigDict(json_schema_extra={"anyOf": [
        {"properties": {"top_logprobs": {"enum": [0, None]}}},
        {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]}]})

    messages: list[Message] = Field(json_schema_extra={"minItems": 1})
    max_tokens: Integer | None = ranged("max_tokens", chat=True)  # chat: at least one token
    max_completion_tokens: Integer | None = ranged("max_completion_tokens", chat=True)
    logprobs: StrictBool | None = None
    top_logprobs: Integer | None = ranged("top_logprobs", chat=True)
    best_of: Integer | None = ranged("best_of")


def state_the_model(openapi: dict, vocab_size: int, max_length: int) -> dict:
    """``openapi`` (FastAPI's document of the bodies above) with the bounds the served model sets on
    a prompt of token ids: each id below ``vocab_size``, at most ``max_length - 1`` ids (one
    token must fit after them). A text prompt's bound is in tokens, which no JSON schema can state:
    a text too long for ``max_length`` is a 400 naming ``prompt`` (or ``messages``).

    The ranges are put back as the models state them: FastAPI writes every bound as a float, and
    2**63 - 1 (the seed's maximum) is 2**63 as a float, one more than the core accepts."""
    schemas = openapi["components"]["schemas"]
    for model in (CompletionBody, ChatBody):
        exact = model.model_json_schema()["properties"]
        for name, field in schemas[model.__name__]["properties"].items():
            field.update({w: exact[name][w] for w in ("minimum", "maximum", "exclusiveMinimum") if w in exact[name]})
    prompt = schemas["CompletionBody"]["properties"]["prompt"]
    for form in prompt["anyOf"]:
        ids = form if form.get("items") == TOKEN_IDS["items"] else form.get("items", {})
        if ids.get("items") == TOKEN_IDS["items"]:
            ids["items"] = dict(ids["items"], maximum=vocab_size - 1)
            ids["maxItems"] = max_length - 1
    return openapi


def as_sent(body: _Body) -> dict:
    """The body as the client sent it (fields it left out or sent as null stay out); message
    contents given as text parts are joined into one string."""
    raw = body.model_dump(exclude_unset=True, exclude_none=True)  # null: as if left out
    for message in raw.get("messages", []):
        if isinstance(message.get("content"), list):
            message["content"] = "".join(part["text"] for part in message["content"])
    return raw
