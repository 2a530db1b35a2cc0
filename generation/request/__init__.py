"""What a user may ask, checked once at the edge: the generation options (``options``), one request
in the OpenAI completions shape (``parse``), structured-output grammars (``grammar``), and the checks
against the checkpoint, the model and the memory (``validate``, ``memory``)."""
