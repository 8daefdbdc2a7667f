"""The OpenAI-compatible HTTP API: /v1/chat/completions, /v1/completions and /v1/models, served
beside gRPC by the same process, on the same engine (server.serving)."""
