"""Llama-family decoders written for the paged KV cache: `config` (torch-free: the launcher's
start-up checks read it), `llama`, `layers`, `loader` (build_model)."""
