"""Fixtures for the data tests (helpers live in data_helpers.py)."""

import pytest
from data_helpers import make_char_tokenizer


@pytest.fixture(scope="session")
def tokenizer():
    return make_char_tokenizer()
