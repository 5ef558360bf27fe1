"""Token sequences from memory-mapped ``.bin``/``.idx`` datasets, batched by a token budget."""
