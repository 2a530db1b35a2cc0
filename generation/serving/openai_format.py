"""The OpenAI API's shapes, without HTTP: request bodies -> checked requests, engine results ->
response bodies and stream chunks, errors -> ``{"error": {...}}``.

Completion bodies go through the batch runner's own parser (``generation/requests.parse_request``), so
a field means the same in a request file and over HTTP; the server adds what only it serves
(``stream``, ``stream_options``, ``presence_penalty``, ``frequency_penalty``). Chat bodies become a
completion request on the prompt that the chat template makes of the messages.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field

from ..requests import MAX_LOGPROBS, Request, RequestError, parse_request
from ..logprobs import TokenText, clip_pieces, offsets_of
from ..options import MAX_INT
from .params import SamplingParams

OPENAI_FINISH = {"length": "length", "eos": "stop", "stop": "stop"}
SERVING_KEYS = ("stream", "stream_options", "presence_penalty", "frequency_penalty")
# The default turn format when the tokenizer has no chat template: one "Role: content" line per
# message, then "Assistant:"; generation stops where the model starts the next turn.
DEFAULT_ROLES = {"system": "System", "user": "User", "assistant": "Assistant"}
TURN_STOPS = ["\nUser:", "\nSystem:"]
CHAT_MAX_TOKENS = 1 << 30


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
    """A checked completion request: the batch runner's Request plus what the server adds."""

    request: Request
    stream: bool = False
    include_usage: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    chat: bool = False
    chat_logprobs: int | None = None  # chat: top_logprobs when logprobs is true
    prompt_ids: list[list[int]] | None = None  # prompts given as token ids
    extra_stops: list[str] = field(default_factory=list)
    model: str = ""  # the served model it asked for (the base model or a LoRA adapter's name)
    ignore_eos: bool = False  # vLLM's: rows do not stop at EOS
    continuous_usage: bool = False  # vLLM's stream_options.continuous_usage_stats: usage on every chunk

    @property
    def offline(self) -> bool:
        """Searches the engine does not run row by row: the batch runner's path answers them."""
        r, search = self.request, self.request.search
        return (search.get("num_beams", 1) > 1 or (r.sampling and r.best_of > r.n) or r.max_tokens == 0
                or (r.echo and r.logprobs is not None) or search.get("no_repeat_ngram_size", 0) > 0
                or search.get("min_new_tokens", 0) > 0)

    def params(self) -> SamplingParams:
        r, s = self.request, self.request.search
        return SamplingParams(
            max_tokens=r.max_tokens, temperature=s.get("temperature", 1.0) if r.sampling else 0.0,
            top_p=s.get("top_p", 1.0), top_k=s.get("top_k", 0), repetition_penalty=s.get("repetition_penalty", 1.0),
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty, seed=s.get("seed"),
            stop=r.stop, logprobs=r.logprobs if not self.chat else self.chat_logprobs, n=r.n,
            ignore_eos=self.ignore_eos)


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
    "guided_json": "not supported", "guided_regex": "not supported", "guided_choice": "not supported",
    "guided_grammar": "not supported", "response_format": "not supported",
}
# The value that means "off" for the extensions that are accepted only off.
_OFF = {"skip_special_tokens": True, "spaces_between_special_tokens": True, "include_stop_str_in_output": False,
        "min_p": 0, "stop_token_ids": [], "priority": 0, "return_tokens_as_token_ids": False}


@dataclass
class Extensions:
    ignore_eos: bool = False
    continuous_usage: bool = False
    min_tokens: int | None = None  # as sent (vLLM refuses more than max_tokens, and so do we)


def vllm_extensions(body: dict) -> tuple[dict, Extensions]:
    """``body`` without vLLM's extensions (mapped onto our fields where they mean the same), and
    those the server itself honours; a 400 naming any that asks for what we cannot do."""
    body = dict(body)
    extensions = Extensions(ignore_eos=bool(body.pop("ignore_eos", False)))
    body.pop("add_special_tokens", None)
    for name, off in _OFF.items():
        if name in body and body.pop(name) != off:
            raise bad_request(f"{name} is not supported by this server (only {off!r}); see docs/serving.md", name)
    for name in ("truncate_prompt_tokens", "prompt_logprobs", "guided_json", "guided_regex", "guided_choice",
                 "guided_grammar", "response_format"):
        if name in body:
            raise bad_request(f"{name} is not supported by this server; see docs/serving.md", name)
    min_tokens = extensions.min_tokens = body.pop("min_tokens", None)
    if min_tokens is not None and (not _is_id(min_tokens) or not 0 <= min_tokens <= MAX_INT):
        raise bad_request(f"min_tokens must be between 0 and {MAX_INT}, got {min_tokens}", "min_tokens")
    if min_tokens and not extensions.ignore_eos:
        body["min_new_tokens"] = min_tokens
    if body.pop("use_beam_search", False):
        body["num_beams"] = max(2, body.get("best_of") or body.get("n") or 1)
        body.pop("best_of", None)
        body["temperature"] = 0
    options = body.get("stream_options")
    if isinstance(options, dict) and "continuous_usage_stats" in options:
        options = dict(options)
        extensions.continuous_usage = bool(options.pop("continuous_usage_stats"))
        body["stream_options"] = options
    return body, extensions


def _param_of(message: str, keys) -> str | None:
    """The field a parser message names (its messages start with it, or quote it)."""
    for key in keys:
        if message.startswith(key + " ") or f"'{key}'" in message:
            return key
    return None


def _number(body: dict, name: str, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise bad_request(f"{name} must be a number between {low} and {high}, got {value!r}", name)
    return float(value)


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
    if not isinstance(body, dict):
        raise bad_request(f"the body must be a JSON object, got {type(body).__name__}")
    chosen = check_model(body, model)
    body, extensions = vllm_extensions(body)
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad_request(f"stream must be true or false, got {stream!r}", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_usage"} or not isinstance(
            options.get("include_usage", False), bool):
        raise bad_request("stream_options must be an object with a boolean include_usage", "stream_options")
    presence = _number(body, "presence_penalty", -2.0, 2.0)
    frequency = _number(body, "frequency_penalty", -2.0, 2.0)
    rest = {k: v for k, v in body.items() if k not in SERVING_KEYS}
    ids = token_prompts(rest.get("prompt"), tokenizer) if tokenizer is not None else None
    if ids is not None:
        # The batch runner's parser checks text; the ids stay what is generated from and scored.
        rest["prompt"] = [tokenizer.decode(p) or " " for p in ids]  # (ids of special tokens only: no text)
    for name, value in rest.items():  # JSON has no NaN or Infinity, though Python's parser reads them
        if isinstance(value, float) and not math.isfinite(value):
            raise bad_request(f"{name} must be a finite number, got {value}", name)
    if isinstance(rest.get("top_p"), (int, float)) and not 0 < rest["top_p"] <= 1:
        raise bad_request(f"top_p must be in (0, 1], got {rest['top_p']}", "top_p")
    try:
        request = parse_request(json.dumps(rest), 0)
    except (RequestError, ValueError, TypeError, OverflowError) as error:
        raise bad_request(str(error), _param_of(str(error), sorted(body, key=len, reverse=True))) from None
    request.prompt_ids = ids
    completion = Completion(request, stream, options.get("include_usage", False), presence, frequency, prompt_ids=ids,
                            model=chosen, ignore_eos=extensions.ignore_eos,
                            continuous_usage=extensions.continuous_usage)
    if extensions.min_tokens is not None and extensions.min_tokens > request.max_tokens:
        raise bad_request(f"min_tokens ({extensions.min_tokens}) must be at most max_tokens ({request.max_tokens})",
                          "min_tokens")
    if completion.offline and extensions.ignore_eos:
        raise bad_request("ignore_eos works with greedy search and sampling (not with beams, best_of > n, "
                          "echo with logprobs, min_tokens or max_tokens 0)", "ignore_eos")
    if completion.offline and (presence or frequency):
        raise bad_request("presence_penalty and frequency_penalty work with greedy search and sampling "
                          "(not with beams, best_of > n, echo with logprobs or max_tokens 0)", "presence_penalty")
    return completion


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


def parse_chat(body, model: str | list[str], tokenizer) -> Completion:
    if not isinstance(body, dict):
        raise bad_request(f"the body must be a JSON object, got {type(body).__name__}")
    for key in sorted(set(body) - CHAT_KEYS):
        raise bad_request(f"unknown key {key!r}", key)
    prompt, stops = chat_prompt(body.get("messages"), tokenizer)
    logprobs = body.get("logprobs", False)
    if logprobs is not None and not isinstance(logprobs, bool):
        raise bad_request(f"logprobs must be true or false, got {logprobs!r}", "logprobs")
    top = body.get("top_logprobs")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_LOGPROBS):
        raise bad_request(f"top_logprobs must be an integer between 0 and {MAX_LOGPROBS}", "top_logprobs")
    if top and not logprobs:  # as OpenAI and vLLM: alternatives without logprobs would be silently dropped
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    completion_body = {k: v for k, v in body.items()
                       if k not in ("messages", "max_completion_tokens", "logprobs", "top_logprobs")}
    completion_body["prompt"] = prompt
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    # No max_tokens: the rest of the server's max_length (the engine caps every budget at it).
    completion_body["max_tokens"] = CHAT_MAX_TOKENS if max_tokens is None else max_tokens
    user_stops = body.get("stop")
    if isinstance(user_stops, str):
        user_stops = [user_stops]
    if user_stops is not None and not isinstance(user_stops, list):
        raise bad_request("stop must be a string or a list of strings", "stop")
    completion_body["stop"] = (user_stops or []) + stops
    completion = parse_completion(completion_body, model)
    if completion.request.max_tokens < 1:
        raise bad_request("max_tokens must be at least 1", "max_tokens")
    completion.chat = True
    completion.chat_logprobs = (top or 0) if logprobs else None
    if completion.offline and logprobs:
        raise bad_request("logprobs in chat work with greedy search and sampling (not with beams, best_of > n "
                          "or min_tokens)", "logprobs")
    return completion


# --- responses ----------------------------------------------------------------------------------


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def token_pieces(text_of: TokenText, token_ids: list[int], text: str, before: list[int] = ()) -> list[str]:
    """The text each of ``token_ids`` adds after the ids ``before`` it (a stream's earlier chunks:
    a UTF-8 character may straddle two chunks), cut to ``text`` (a stop string may start inside the
    last token)."""
    return clip_pieces(text_of.pieces(list(before) + list(token_ids))[len(before):], len(text))


def completion_logprobs(text_of: TokenText, token_ids: list[int], logprobs: list, text: str, start: int = 0,
                        before: list[int] = ()) -> dict:
    """The legacy completions' logprobs object of generated tokens (engine path); ``start``: where
    ``text`` begins in the choice's text."""
    pieces = token_pieces(text_of, token_ids, text, before)
    top = []
    for lp in logprobs:
        alternatives = {text_of.label(i): v for i, v in lp.top}
        alternatives.setdefault(text_of.label(lp.token_id), lp.logprob)
        top.append(alternatives)
    return {"tokens": pieces, "token_logprobs": [lp.logprob for lp in logprobs], "top_logprobs": top,
            "text_offset": offsets_of(pieces, start)}


def chat_logprobs(text_of: TokenText, token_ids: list[int], logprobs: list, text: str, before: list[int] = ()) -> dict:
    pieces = token_pieces(text_of, token_ids, text, before)

    def entry(token_id, value, piece=None):
        label = piece if piece is not None else text_of.label(token_id)
        return {"token": label, "logprob": value, "bytes": list(text_of.token_bytes(token_id))}

    content = [dict(entry(lp.token_id, lp.logprob, piece), top_logprobs=[entry(i, v) for i, v in lp.top])
               for piece, lp in zip(pieces, logprobs)]
    return {"content": content}


def chat_choice(choice: dict) -> dict:
    """A choice of the batch runner's record (the offline path: beams, min_tokens...) as a chat
    choice. Chat asks for no log-probs there (``parse_chat`` refuses them)."""
    return {"index": choice["index"], "message": {"role": "assistant", "content": choice["text"]}, "logprobs": None,
            "finish_reason": choice["finish_reason"]}


def envelope(kind: str, response_id: str, model: str, choices: list, usage: dict | None = None) -> dict:
    body = {"id": response_id, "object": kind, "created": int(time.time()), "model": model, "choices": choices}
    if usage is not None:
        body["usage"] = usage
    return body


def sse(data) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"
