"""A streamed answer: server-sent events, one chunk per delta of a choice, as OpenAI sends them."""

from __future__ import annotations

from ..run.logprobs import TokenText
from .in_flight import Answer
from .openai_format import ApiError
from .response_bodies import (OPENAI_FINISH, add_usage, chat_choice, chat_logprobs, completion_logprobs, envelope, new_id,
                        sse, zero_usage)


class Chunks:
    """The chunks of one answer's stream, and what they have sent so far (each choice's text
    offset and token ids: a token's text and log-probs depend on the tokens before it)."""

    def __init__(self, answer: Answer, text_of: TokenText):
        self.completion, self.text_of = answer.completion, text_of
        c = self.completion
        self.id, self.kind = new_id(c.chat), "chat.completion.chunk" if c.chat else "text_completion"
        self.given: dict[int, int] = {}  # characters of each choice's completion sent so far (text_offset)
        self.sent: dict[int, list[int]] = {}  # token ids of each choice sent so far
        self.prompt_tokens = sum(len(ids) for ids in answer.prompt_ids)

    def event(self, choice: dict, usage: dict | None = None) -> str:
        return sse(envelope(self.kind, self.id, self.completion.model, [choice], usage))

    def delta(self, index: int, text: str = "", finish: str | None = None, token_ids=(), lps=None) -> str:
        """A chunk of choice ``index``'s text (and log-probs) or its end; what it sent is counted."""
        c, before = self.completion, self.sent.get(index, [])
        if c.chat:
            logprobs = chat_logprobs(self.text_of, list(token_ids), lps, text, before) if lps else None
            choice = {"index": index, "delta": {"content": text} if text else {}, "logprobs": logprobs,
                      "finish_reason": finish}
        else:
            logprobs = completion_logprobs(self.text_of, list(token_ids), lps, text, self.given.get(index, 0),
                                           before) if lps else None
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        chunk = self.event(choice, self.running_usage(token_ids))
        self.given[index] = self.given.get(index, 0) + len(text)
        self.sent.setdefault(index, []).extend(token_ids)
        return chunk

    def running_usage(self, token_ids=()) -> dict | None:
        """vLLM's continuous_usage_stats: the usage so far on every chunk (None without it)."""
        if not self.completion.continuous_usage:
            return None
        completion = sum(map(len, self.sent.values())) + len(token_ids)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion}

    def openings(self, choices: int, prompts: list[str], per_prompt: int):
        """Before any token: chat's role chunk per choice; an echoed prompt (engine path)."""
        c = self.completion
        for index in range(choices):
            if c.chat:
                yield self.event({"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None}, self.running_usage())
            elif c.request.echo and not c.offline:
                yield self.event({"index": index, "text": prompts[index // per_prompt], "logprobs": None,
                                  "finish_reason": None}, self.running_usage())

    def record(self, record: dict):
        """An offline answer arrives whole: each choice is one chunk (chat: its text, then its
        finish), with the final usage on each when usage is continuous."""
        every = record["usage"] if self.completion.continuous_usage else None
        for choice in record["choices"]:
            if not self.completion.chat:
                yield sse(envelope(self.kind, self.id, self.completion.model, [choice], every))
                continue
            message = chat_choice(choice)
            text, finish = message["message"]["content"], message["finish_reason"]
            for delta, reason in (({"content": text}, None), ({}, finish)):
                yield self.event({"index": message["index"], "delta": delta, "logprobs": None,
                                  "finish_reason": reason}, every)


async def stream(answer: Answer, text_of: TokenText):
    """The answer's server-sent events, ``data: [DONE]`` last; a closed stream cancels its rows."""
    c, chunks = answer.completion, Chunks(answer, text_of)
    per_prompt = answer.choices_per_prompt
    usage, finals = zero_usage(), 0
    try:
        for chunk in chunks.openings(len(answer.prompt_ids) * per_prompt, c.request.prompts, per_prompt):
            yield chunk
        while finals < answer.expected:
            p, event = await answer.events.get()
            index = p * per_prompt + event.index
            if event.kind == "delta":
                yield chunks.delta(index, event.text, None, event.token_ids, event.logprobs)
            elif event.kind == "finish":
                yield chunks.delta(index, "", OPENAI_FINISH[event.finish_reason])
            elif event.kind == "done":
                finals += 1
                usage = add_usage(usage, event.usage)
            elif event.kind == "record":
                finals += 1
                usage = add_usage(usage, event.record["usage"])
                for chunk in chunks.record(event.record):
                    yield chunk
            elif event.kind == "error":
                yield sse(ApiError(500, event.message, "server_error").body())
                break
        if c.include_usage:
            yield sse(envelope(chunks.kind, chunks.id, c.model, [], usage))
        yield "data: [DONE]\n\n"
    finally:
        answer.cancel()  # a closed stream frees its rows at the engine's next step
