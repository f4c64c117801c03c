"""``module:attribute`` on the command line (slm_align.config.named): imported, or refused in one line naming what
is wrong."""

from __future__ import annotations

import sys

import pytest

from slm_align.config.named import import_named
from slm_align.errors import UserError


def test_a_named_object_is_imported_or_refused_in_one_line(tmp_path, monkeypatch):
    (tmp_path / "probe_rewards_mod.py").write_text("def brevity(completions, **kwargs):\n    return [1.0]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "probe_rewards_mod", raising=False)
    brevity = import_named("probe_rewards_mod:brevity", "reward")
    assert brevity(["x"]) == [1.0] and sys.modules["probe_rewards_mod"].brevity is brevity
    with pytest.raises(UserError, match=r"^reward probe_rewards_mod:missing: module probe_rewards_mod has no missing$"):
        import_named("probe_rewards_mod:missing", "reward")
    with pytest.raises(UserError, match=r"^--environment no_such_mod:Env: cannot import module no_such_mod "
                                        r"\(.*\); is it on PYTHONPATH\?$"):
        import_named("no_such_mod:Env", "--environment")
