"""The request bodies as pydantic models: what ``/openapi.json`` documents and FastAPI checks first.

FastAPI validates a body against these types before our code runs (a wrong type, a missing prompt,
an unknown key: a 400 naming the field, see ``app.py``); the ranges, the model name and what the
engine can run are then checked by ``openai_format.py``, which gets the body as the client sent it
(``model_dump(exclude_unset=True)``). Types are strict: a number is not accepted as a string, nor
the other way round, as OpenAI's own API does not.

Besides OpenAI's fields, each body takes our search options (``top_k``, ``num_beams``,
``repetition_penalty``...) and the extensions vLLM's server accepts and load generators send
(``VLLM_EXTENSIONS``); those we cannot honour are refused with a 400 naming them
(``openai_format.vllm_extensions``).
"""

from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, StrictStr

Number = float  # strict mode: an int or a float, never a string


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Body):
    include_usage: StrictBool | None = None
    continuous_usage_stats: StrictBool | None = None  # vLLM: usage on every chunk


class _Options(_Body):
    """What completions and chat share: sampling, search, streaming, vLLM's extensions."""

    model: StrictStr | None = None
    max_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    n: StrictInt | None = None
    stop: Union[StrictStr, list[StrictStr], None] = None
    seed: StrictInt | None = None
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    logit_bias: dict[str, Number] | None = None
    user: StrictStr | None = None
    # Our search options (docs/generation-options.md).
    top_k: StrictInt | None = None
    num_beams: StrictInt | None = None
    repetition_penalty: Number | None = None
    length_penalty: Number | None = None
    no_repeat_ngram_size: StrictInt | None = None
    early_stopping: Union[StrictBool, Literal["never"], None] = None
    min_new_tokens: StrictInt | None = None
    # vLLM's extensions (openai_format.VLLM_EXTENSIONS says which are honoured).
    ignore_eos: StrictBool | None = None
    min_tokens: StrictInt | None = None
    skip_special_tokens: StrictBool | None = None
    spaces_between_special_tokens: StrictBool | None = None
    include_stop_str_in_output: StrictBool | None = None
    add_special_tokens: StrictBool | None = None
    use_beam_search: StrictBool | None = None
    min_p: Number | None = None
    stop_token_ids: list[StrictInt] | None = None
    priority: StrictInt | None = None
    truncate_prompt_tokens: StrictInt | None = None
    prompt_logprobs: StrictInt | None = None
    return_tokens_as_token_ids: StrictBool | None = None
    guided_json: Union[StrictStr, dict, None] = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None
    response_format: dict | None = None


class CompletionBody(_Options):
    """``POST /v1/completions``."""

    prompt: Union[StrictStr, list[StrictStr], list[StrictInt], list[list[StrictInt]]]
    best_of: StrictInt | None = None
    logprobs: StrictInt | None = None
    echo: StrictBool | None = None
    suffix: StrictStr | None = None
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

    messages: list[Message]
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None
    best_of: StrictInt | None = None


def as_sent(body: _Body) -> dict:
    """The body as the client sent it (fields it left out or sent as null stay out); message
    contents given as text parts are joined into one string."""
    raw = body.model_dump(exclude_unset=True, exclude_none=True)  # null: as if left out
    for message in raw.get("messages", []):
        if isinstance(message.get("content"), list):
            message["content"] = "".join(part["text"] for part in message["content"])
    return raw
