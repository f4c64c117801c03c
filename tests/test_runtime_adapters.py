"""Pickle through adapters (issue 20, finding 8): an adapter saved only as adapter_model.bin needs --allow-pickle."""

import pytest

from slm_align.errors import UserError
from slm_align.modeling import load_adapter


def test_a_pickle_only_adapter_is_refused_unless_allowed(tmp_path):
    (tmp_path / "adapter_config.json").write_text("{}")
    (tmp_path / "adapter_model.bin").write_bytes(b"not loaded")
    with pytest.raises(UserError, match="--allow-pickle") as refused:
        load_adapter(None, tmp_path)
    assert "\n" not in str(refused.value)
    with pytest.raises(UserError, match="does not fit"):  # allowed: peft gets to try (and fails on this stub)
        load_adapter(None, tmp_path, allow_pickle=True)
