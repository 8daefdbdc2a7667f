"""--chat-template: a template file replaces the model's own, or gives one to a model without
one (a GGUF file of a base model often carries none); a missing file is refused at parse."""

from __future__ import annotations

from pathlib import Path

import pytest

from kenspec.server.runtime import load_runtime
from kenspec.server.settings import Settings, parse_settings

TEMPLATE = (
    "{% for message in messages %}<<{{ message['role'] }}>>{{ message['content'] }}"
    "{% endfor %}{% if add_generation_prompt %}<<assistant>>{% endif %}"
)


def test_the_template_file_renders_every_chat(base_settings: Settings, tmp_path: Path) -> None:
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE, encoding="utf-8")
    settings = base_settings.replace(chat_template=str(template), draft="none")
    target = load_runtime(settings).engine.target
    assert target.chat_text([{"role": "user", "content": "hi"}]) == "<<user>>hi<<assistant>>"
    own = load_runtime(base_settings.replace(draft="none")).engine.target
    assert own.chat_text([{"role": "user", "content": "hi"}]).startswith("<|im_start|>user")


def test_a_missing_template_file_is_refused(capsys) -> None:
    with pytest.raises(SystemExit):
        parse_settings(["--chat-template", "/no/such/chat.jinja"], env={})
    assert "--chat-template /no/such/chat.jinja: no such file" in capsys.readouterr().err
    assert parse_settings([], env={}).model.chat_template == ""
