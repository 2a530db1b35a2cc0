"""``mark_step``: in lazy mode it ends the accumulated graph and launches it; counted here."""

COUNTS = {"mark_step": 0}


def mark_step():
    COUNTS["mark_step"] += 1
