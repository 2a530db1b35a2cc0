"""The OpenAI API's answers: response bodies, their choices and log-probs, stream chunks, usage."""

from __future__ import annotations

import json
import time
import uuid

from ..run.logprobs import TokenText, clip_pieces, offsets_of

OPENAI_FINISH = {"length": "length", "eos": "stop", "stop": "stop"}


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


def zero_usage() -> dict:
    return {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}


def add_usage(usage: dict, more: dict | None) -> dict:
    """The usage of two parts of one answer (prompts of a list, choices), prompt caching included."""
    if not more:
        return usage
    total = {k: usage.get(k, 0) + more.get(k, 0) for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    details = [u["prompt_tokens_details"] for u in (usage, more) if "prompt_tokens_details" in u]
    if details:
        total["prompt_tokens_details"] = {"cached_tokens": sum(d.get("cached_tokens", 0) for d in details)}
    return total
