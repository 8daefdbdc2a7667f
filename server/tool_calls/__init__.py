"""Tool calls (function calling): the tools a request offers, how they reach the model through
its chat template, the grammar that keeps a call's arguments to its function's schema, and
the parser that turns the model's own call format back into OpenAI's ``tool_calls``.

- ``request``: the request's ``tools``, ``tool_choice`` and ``parallel_tool_calls``, and the
  calls and results in a chat's history, checked as either API sends them.
- ``formats``: a model's call format (Hermes/Qwen2.5 ``<tool_call>``, Llama 3 JSON, Mistral
  ``[TOOL_CALLS]``, or kenspec's own prompt for a template that knows no tools), the chat
  rendered with the tools, and the grammar of a turn.
- ``parser``: the output, round by round, split into content and call deltas.
"""

# --tool-call-format's values (formats.detect)
FORMATS = ("auto", "hermes", "llama3_json", "mistral", "prompt")
