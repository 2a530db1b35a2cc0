"""A whole (not streamed) answer: wait for every choice's end, then one JSON body."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import Response

from ..run.logprobs import TokenText
from .in_flight import Answer
from .openai_format import ApiError
from .response_bodies import (OPENAI_FINISH, add_usage, chat_choice, chat_logprobs, completion_logprobs, envelope, new_id,
                        zero_usage)

POLL_S = 0.25  # how often a waiting request looks whether its client is still there


@dataclass
class Ended:
    """What the events of an answer left: each choice's sequence (with its prompt) and log-probs,
    the usage, or the batch runner's record (the offline path)."""

    sequences: dict = field(default_factory=dict)  # choice index -> (prompt index, Sequence)
    logprobs: dict = field(default_factory=dict)  # choice index -> [TokenLogprob]
    usage: dict = field(default_factory=zero_usage)
    record: dict | None = None


async def collect(request: Request, answer: Answer, text_of: TokenText):
    """The answer's JSON body, or a 499 when the client went away before it was done."""
    ended = await wait_for_all(request, answer)
    if ended is None:
        return Response(status_code=499)
    c = answer.completion
    kind = "chat.completion" if c.chat else "text_completion"
    if ended.record is not None:
        record = ended.record
        choices = [chat_choice(choice) for choice in record["choices"]] if c.chat else record["choices"]
        return envelope(kind, new_id(c.chat), c.model, choices, record["usage"])
    choices = [choice(answer, index, *ended.sequences[index], ended.logprobs.get(index), text_of)
               for index in sorted(ended.sequences)]
    return envelope(kind, new_id(c.chat), c.model, choices, ended.usage)


async def wait_for_all(request: Request, answer: Answer) -> Ended | None:
    """Every event of the answer, gathered; None (its rows cancelled) if the client goes away."""
    ended, finals = Ended(), 0
    try:
        while finals < answer.expected:
            try:
                p, event = await asyncio.wait_for(answer.events.get(), POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    return None
                continue
            index = p * answer.choices_per_prompt + event.index
            if event.kind == "delta" and event.logprobs is not None:
                ended.logprobs.setdefault(index, []).extend(event.logprobs)
            elif event.kind == "finish":
                ended.sequences[index] = (p, event.sequence)
            elif event.kind in ("done", "record"):
                finals += 1
                ended.record = event.record if event.kind == "record" else None
                ended.usage = add_usage(ended.usage, event.usage or (ended.record or {}).get("usage"))
            elif event.kind == "error":
                raise ApiError(500, event.message, "server_error")
    finally:
        answer.cancel()  # (no-op for finished requests)
    return ended


def choice(answer: Answer, index: int, prompt: int, seq, lps: list | None, text_of: TokenText) -> dict:
    """One choice of an engine's answer (greedy search or sampling) as OpenAI's body has it."""
    request = answer.completion.request
    lps = lps if request.logprobs is not None else None
    reason = OPENAI_FINISH[seq.finish_reason]
    if answer.completion.chat:
        logprobs = chat_logprobs(text_of, seq.token_ids, lps, seq.text) if lps is not None else None
        return {"index": index, "message": {"role": "assistant", "content": seq.text}, "logprobs": logprobs,
                "finish_reason": reason}
    echoed = request.prompts[prompt] if request.echo else ""
    logprobs = completion_logprobs(text_of, seq.token_ids, lps, seq.text) if lps is not None else None
    return {"index": index, "text": echoed + seq.text, "logprobs": logprobs, "finish_reason": reason}
