"""The search, on the device: logits processors, the greedy/sampling token loop, beam search, and
where a row's text ends (EOS, stop strings)."""
