"""The HTTP/tokenizer process: OpenAI-compatible API, chat template, tokenize and
detokenize, stop strings, SSE. Talks to the scheduler only through `EngineClient`."""
