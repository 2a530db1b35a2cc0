"""The OpenAI API's request side, without HTTP: bodies -> checked requests, errors ->
``{"error": {...}}`` (the answers' shapes: ``responses.py``).

A body's fields are checked by the request core (``generation/request/parse.py``), the one parser of
request files and the server, so a field means the same in both. Here is only what the server alone
deals with: the model a body names, ``stream`` and ``stream_options``, vLLM's extensions, prompts
given as token ids, the chat template, and what the engine can run.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..request.parse import Request, RequestError, from_body, from_chat

# The default turn format when the tokenizer has no chat template: one "Role: content" line per
# message, then "Assistant:"; generation stops where the model starts the next turn.
DEFAULT_ROLES = {"system": "System", "user": "User", "assistant": "Assistant"}
TURN_STOPS = ["\nUser:", "\nSystem:"]


class ApiError(Exception):
    """An answer other than 200, as OpenAI shapes it."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param)


@dataclass
class Completion:
    """A checked request and what only the server does with it."""

    request: Request
    stream: bool = False
    include_usage: bool = False
    chat: bool = False
    model: str = ""  # the served model it asked for (the base model or a LoRA adapter's name)
    continuous_usage: bool = False  # vLLM's stream_options.continuous_usage_stats: usage on every chunk

    @property
    def offline(self) -> bool:
        """Searches the engine does not run row by row: the batch runner's path answers them."""
        r, o = self.request, self.request.options
        return (o.num_beams > 1 or (r.sampling and r.best_of > r.n) or r.max_tokens == 0
                or (r.echo and r.logprobs is not None) or o.no_repeat_ngram_size > 0 or o.min_new_tokens > 0)


# vLLM's extensions to the OpenAI bodies, as load generators (guidellm...) and vLLM's clients send
# them: the value each may take here, or how it is honoured. See docs/serving.md.
VLLM_EXTENSIONS = {
    "ignore_eos": "honoured: rows do not stop at EOS (greedy search and sampling)",
    "min_tokens": "honoured: as min_new_tokens (needless with ignore_eos, which already never stops early)",
    "use_beam_search": "honoured: beam search with best_of (else n) beams",
    "skip_special_tokens": "true only (special tokens are never in the text)",
    "spaces_between_special_tokens": "true only",
    "add_special_tokens": "either (BLOOM's tokenizer adds none)",
    "include_stop_str_in_output": "false only",
    "min_p": "0 only",
    "stop_token_ids": "[] only",
    "priority": "0 only",
    "return_tokens_as_token_ids": "false only",
    "truncate_prompt_tokens": "not supported",
    "prompt_logprobs": "not supported (echo with logprobs scores the prompt)",
    "guided_json": "honoured: a JSON schema every answer follows (docs/structured-output.md)",
    "guided_regex": "honoured: a regular expression every answer matches",
    "guided_choice": "honoured: every answer is one of these strings",
    "guided_grammar": "honoured: a Lark or GBNF grammar every answer follows",
    "response_format": "OpenAI's: json_object or json_schema (docs/structured-output.md)",
}
# The value that means "off" for the extensions that are accepted only off.
_OFF = {"skip_special_tokens": True, "spaces_between_special_tokens": True, "include_stop_str_in_output": False,
        "min_p": 0, "stop_token_ids": [], "priority": 0, "return_tokens_as_token_ids": False}
_UNSUPPORTED = ("truncate_prompt_tokens", "prompt_logprobs")


def vllm_extensions(body: dict) -> dict:
    """``body`` without the vLLM extensions that only switch something off (``use_beam_search``
    made into our fields; ``ignore_eos`` and ``min_tokens`` stay, for the request core); a 400
    naming any that asks for what we cannot do."""
    body = dict(body)
    body.pop("add_special_tokens", None)
    for name, off in _OFF.items():
        if name in body and body.pop(name) != off:
            raise bad_request(f"{name} is not supported by this server (only {off!r}); see docs/serving.md", name)
    for name in _UNSUPPORTED:
        if name in body:
            raise bad_request(f"{name} is not supported by this server; see docs/serving.md", name)
    if body.pop("use_beam_search", False):
        body["num_beams"] = max(2, body.get("best_of") or body.get("n") or 1)
        body.pop("best_of", None)
        body["temperature"] = 0
    return body


def streaming(body: dict) -> tuple[bool, bool, bool]:
    """(stream, stream_options.include_usage, vLLM's stream_options.continuous_usage_stats)."""
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad_request(f"stream must be true or false, got {stream!r}", "stream")
    options = body.get("stream_options") or {}
    if (not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}
            or not all(isinstance(v, bool) for v in options.values())):
        raise bad_request("stream_options must be an object with a boolean include_usage", "stream_options")
    return stream, options.get("include_usage", False), options.get("continuous_usage_stats", False)


def param_of(message: str, keys) -> str | None:
    """The field of ``keys`` a parser message names (its messages start with it, or quote it)."""
    for key in sorted(keys, key=len, reverse=True):  # (max_tokens before tokens)
        if message.startswith((key + " ", key + ":")) or f"'{key}'" in message:
            return key
    return None


def _is_id(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def token_prompts(prompt, tokenizer) -> list[list[int]] | None:
    """A prompt given as token ids (a list of ints, or a list of such lists, as OpenAI allows and
    lm-eval sends), checked against the vocabulary; None for text prompts."""
    if not isinstance(prompt, list) or not prompt:
        return None
    if all(_is_id(x) for x in prompt):
        prompts = [prompt]
    elif all(isinstance(p, list) and p and all(_is_id(x) for x in p) for p in prompt):
        prompts = prompt
    else:
        return None
    vocab = tokenizer.vocab_size
    if any(not 0 <= x < vocab for p in prompts for x in p):
        raise bad_request(f"prompt token ids must be between 0 and {vocab - 1}", "prompt")
    return prompts


def parse_completion(body, model: str | list[str], tokenizer=None) -> Completion:
    """``model``: the name the server serves, or its names (the base model first, then LoRA adapters)."""
    return _parse(body, model, tokenizer)


def parse_chat(body, model: str | list[str], tokenizer) -> Completion:
    if not isinstance(body, dict):
        raise bad_request(f"the body must be a JSON object, got {type(body).__name__}")
    for key in sorted(set(body) - CHAT_KEYS):
        raise bad_request(f"unknown key {key!r}", key)
    return _parse(body, model, tokenizer, chat=chat_prompt(body.get("messages"), tokenizer))


def _parse(body, model, tokenizer, chat: tuple[str, list[str]] | None = None) -> Completion:
    """A body -> a checked Completion; ``chat``: the prompt and turn stops a chat body's messages make."""
    if not isinstance(body, dict):
        raise bad_request(f"the body must be a JSON object, got {type(body).__name__}")
    chosen = check_model(body, model)
    body = vllm_extensions(body)
    stream, include_usage, continuous_usage = streaming(body)
    rest = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    ids = token_prompts(rest.get("prompt"), tokenizer) if tokenizer is not None and chat is None else None
    if ids is not None:
        # The request core checks text; the ids stay what is generated from and scored.
        rest["prompt"] = [tokenizer.decode(p) or " " for p in ids]  # (ids of special tokens only: no text)
    try:
        request = from_chat(rest, *chat) if chat is not None else from_body(rest, serving=True)
    except (RequestError, ValueError, TypeError, OverflowError) as error:
        raise bad_request(str(error), param_of(str(error), body)) from None
    request.prompt_ids = ids
    completion = Completion(request, stream, include_usage, chat is not None, chosen, continuous_usage)
    check_servable(completion)
    return completion


def check_servable(completion: Completion) -> None:
    """What the batch runner's path (``Completion.offline``) cannot add to its search: a 400."""
    r = completion.request
    if not completion.offline:
        return
    if r.ignore_eos:
        raise bad_request("ignore_eos works with greedy search and sampling (not with beams, best_of > n, "
                          "echo with logprobs, min_tokens or max_tokens 0)", "ignore_eos")
    if r.presence_penalty or r.frequency_penalty:
        raise bad_request("presence_penalty and frequency_penalty work with greedy search and sampling "
                          "(not with beams, best_of > n, echo with logprobs or max_tokens 0)", "presence_penalty")
    if completion.chat and r.logprobs is not None:
        raise bad_request("logprobs in chat work with greedy search and sampling (not with beams, best_of > n "
                          "or min_tokens)", "logprobs")


def check_model(body: dict, model: str | list[str]) -> str:
    """The served model the body asks for (the first of ``model`` when it names none)."""
    names = [model] if isinstance(model, str) else list(model)
    name = body.get("model")
    if name is None:
        return names[0]
    if name not in names:
        raise ApiError(404, f"the model {name!r} does not exist: this server serves {', '.join(map(repr, names))}",
                       "invalid_request_error", "model", "model_not_found")
    return name


# --- chat ---------------------------------------------------------------------------------------

CHAT_KEYS = {"messages", "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "n", "stop",
             "seed", "stream", "stream_options", "presence_penalty", "frequency_penalty", "repetition_penalty",
             "logprobs", "top_logprobs", "user", "num_beams", "length_penalty", "no_repeat_ngram_size",
             "early_stopping", "min_new_tokens", "logit_bias", "best_of", *VLLM_EXTENSIONS}


def chat_prompt(messages, tokenizer) -> tuple[str, list[str]]:
    """The prompt the messages make, and the stop strings that end the assistant's turn."""
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list", "messages")
    for m in messages:
        if (not isinstance(m, dict) or not isinstance(m.get("role"), str) or m["role"] not in DEFAULT_ROLES
                or not isinstance(m.get("content"), str) or set(m) - {"role", "content", "name"}):
            raise bad_request("each message must be {\"role\": system|user|assistant, \"content\": string}", "messages")
    template = getattr(tokenizer, "config", {}).get("chat_template")
    if template:
        import jinja2

        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
        prompt = env.from_string(template).render(messages=messages, add_generation_prompt=True,
                                                  bos_token=tokenizer.config.get("bos_token", ""),
                                                  eos_token=tokenizer.config.get("eos_token", ""))
        return prompt, []
    lines = [f"{DEFAULT_ROLES[m['role']]}: {m['content']}\n" for m in messages]
    return "".join(lines) + "Assistant:", list(TURN_STOPS)
