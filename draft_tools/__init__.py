"""Offline tools for building a KenLM draft: self-distil a corpus from the target, train and
replay-evaluate a draft; `python -m draft_tools build` does all of it in one resumable command.
They use the engine's draft classes but are not part of the server."""
