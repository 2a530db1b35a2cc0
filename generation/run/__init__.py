"""Running one batch for the ``Generator``: text to padded tensors and the static-shape plan
(``batch``), the prefix cache's pool as the generator offers it (``prefix_pool``), log-probs by a
scoring pass (``logprobs``), a batch of requests answered (``request_batch``), results, streaming,
the transformers baseline (``vanilla``), warm-up and progress."""
