"""One HTTP request's prompts in the engine, and the events coming back for them.

The engine's scheduler thread calls each prompt's sink; the sink moves the event into the
request's asyncio queue on the server's loop (``loop_handoff.Mailbox``).
"""

from __future__ import annotations

import asyncio

from ..request.options import OptionError
from ..request.validate import check_against_model
from .engine import EngineError, QueueFull
from .handles import ENGINE_STOPPED, EngineStopped
from .loop_handoff import Mailbox, drain
from .openai_format import ApiError, Completion, bad_request, param_of
from .params import SamplingParams


class Answer:
    """Submits a checked request's prompts to the engine (on a worker thread: tokenizing a large
    body must not hold the event loop); ``events`` then receives (prompt, Event) pairs."""

    def __init__(self, engine, completion: Completion, mailbox: Mailbox):
        self.engine, self.completion = engine, completion
        self.events: asyncio.Queue = asyncio.Queue()
        self.handles = []
        request = completion.request
        prompts = len(request.prompt_ids or request.prompts)
        if prompts > engine.config.max_queue:
            raise bad_request(f"the request has {prompts} prompts; this server queues at most "
                              f"{engine.config.max_queue} (--max_queue): send fewer at a time", "prompt")
        self.prompt_ids = request.prompt_ids or engine.tokenizer.encode_batch(request.prompts)
        if engine.flush_events is None:
            engine.flush_events = lambda: drain(mailbox.loop)
        try:
            self._submit(mailbox)
        except EngineError as error:
            self.cancel()
            param = "messages" if completion.chat and error.param == "prompt" else error.param
            raise bad_request(f"prompt {len(self.handles) + 1}: {error}" if len(self.prompt_ids) > 1 else str(error),
                              param) from None
        except QueueFull as error:
            self.cancel()
            raise ApiError(503, str(error), "server_error", None, "queue_full") from None
        except EngineStopped as error:
            self.cancel()
            raise ApiError(503, str(error), "server_error", None, ENGINE_STOPPED) from None

    def _submit(self, mailbox: Mailbox) -> None:
        engine, completion, request = self.engine, self.completion, self.completion.request

        def sink(prompt: int):
            return lambda event: mailbox.post(self.events, (prompt, event))

        # The LoRA adapter the request's model names (0: the base model).
        lora = getattr(engine, "lora", None)
        adapter = lora.names.get(completion.model, 0) if lora is not None else 0
        if completion.offline:
            # Its search options against the model, on this thread (no collective: under tensor
            # parallelism only rank 0 answers HTTP; the memory is checked inside the offline
            # answer, which every rank makes).
            try:
                check_against_model(request.to_options(), engine.generator.model.config.vocab_size)
            except (OptionError, ValueError) as error:
                raise bad_request(str(error), param_of(str(error), request.raw)) from None
            self.handles.append(engine.submit_offline(request, self.prompt_ids, sink(0), adapter))
            return
        params = SamplingParams.of(request, adapter)
        for p, ids in enumerate(self.prompt_ids):
            self.handles.append(engine.submit(ids, params, sink(p)))

    @property
    def expected(self) -> int:
        """Final events to wait for: one "record" offline, one "done" per prompt otherwise."""
        return 1 if self.completion.offline else len(self.handles)

    @property
    def choices_per_prompt(self) -> int:
        return self.completion.request.n

    def cancel(self) -> None:
        for handle in self.handles:
            handle.cancel()
