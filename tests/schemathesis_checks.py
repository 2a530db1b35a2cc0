"""schemathesis's ``positive_data_acceptance`` (no schema-valid body rejected) with the server's
refusals that no JSON schema can state, each named with its reason; loaded by the schemathesis
CLI as its hooks module (``SCHEMATHESIS_HOOKS``, tests/test_serving_clients.py).

Everything else a body must be is in the server's OpenAPI document (``serving/schema.py``), so a
schema-valid body refused for any other reason fails this check.
"""

from __future__ import annotations

import json

import schemathesis

# (what the refusal says, why the schema cannot state it)
UNSTATED = [
    ("leaves no room for new tokens", "a text prompt's length in tokens (the schema counts characters)"),
    ("--max_queue", "a body's rows against the server's --max_queue"),
    ("(--max_batch)", "sampled choices against the server's rows (greedy choices share one row: a relation "
     "between n and temperature)"),
    ("must be <= n", "a relation between two numbers (best_of >= n)"),
    ("must be at most max_tokens", "a relation between two numbers (min_tokens <= max_tokens)"),
    ("returns at most num_beams", "a relation between two numbers (n <= num_beams)"),
    ("for this model", "num_beams and top_k against the vocabulary"),
    ("work with greedy search and sampling", "an option the engine's row-by-row path alone runs, beside beams or "
     "best_of > n (ignore_eos, the penalties, chat logprobs)"),
]
# The grammar library's verdict on a constraint's content (a schema, regex or grammar it cannot
# compile, or that no text satisfies): the schema states the field's shape only.
GRAMMAR_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar")


def unstated(body, error: dict) -> bool:
    message, param = error.get("message", ""), error.get("param")
    if isinstance(body, dict) and param in GRAMMAR_FIELDS and param in body:
        return True
    return any(text in message for text, _ in UNSTATED)


@schemathesis.check
def schema_valid_bodies_are_accepted(ctx, response, case):
    """positive_data_acceptance: a schema-valid body gets no 400, save a refusal in UNSTATED."""
    meta = case.meta
    if meta is None or not meta.generation.mode.is_positive or response.status_code != 400:
        return None
    try:
        error = json.loads(response.content)["error"]
    except (ValueError, KeyError, TypeError):
        error = {}
    if unstated(case.body, error):
        return None
    raise AssertionError(f"Schema-valid body rejected: {error.get('message', response.content[:300])}")
