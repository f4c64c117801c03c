"""The torch-free device wing: what an app installs with ``slm-align[agent]``.

agent/ (the runtime: the loop over many conversations, backends, the store, A/B, server/),
tools/ and rewards/ (schemas, registry, parsing, built-ins; the reward protocol and built-ins),
devices/ (profiles, fit and speed estimates), templates/ (chat templates and their sandbox) and
gguf/ (every GGUF reader and writer). Nothing here imports torch or transformers when imported;
the GGUF writers that export calls load them inside the functions that convert.
"""
