"""Serving: the continuous-batching engine (slots, scheduler, per-row options; no HTTP) and the
OpenAI-compatible HTTP app over it."""
