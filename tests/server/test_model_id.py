"""The model id the HTTP API lists (GET /v1/models) and expects in a request's model field."""

from __future__ import annotations

import pytest

from kenspec.server.lifecycle import served_model_id
from kenspec.server.settings import ModelSettings


@pytest.mark.parametrize(
    ("model", "served_name", "expected"),
    [
        ("models/smollm2-135m-instruct", "", "smollm2-135m-instruct"),
        ("models/smollm2-135m-instruct/", "", "smollm2-135m-instruct"),
        ("models/gemma-3-270m/gemma-3-270m-q4_k_m.gguf", "", "gemma-3-270m-q4_k_m"),
        ("models/gemma-3-270m", "", "gemma-3-270m"),  # a folder holding the file
        ("models/gemma-3-270m/gemma-3-270m-q4_k_m.gguf", "gemma", "gemma"),
    ],
)
def test_the_id_is_the_flag_or_the_folder_or_the_gguf_file_without_its_suffix(
    model: str, served_name: str, expected: str
) -> None:
    assert served_model_id(ModelSettings(model=model, served_model_name=served_name)) == expected
