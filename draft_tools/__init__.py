"""Offline tools for building a KenLM draft: self-distil a corpus from the target, train and
replay-evaluate a draft. They use the engine's draft classes but are not part of the server."""
