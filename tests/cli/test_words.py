"""What the commands print for people says what the code does: the names one types are never cut at 80
columns, and an example's comment names what the device profile picks."""

from __future__ import annotations

import re

from slm_align.ondevice.devices import list_profiles, load_profile
from slm_align.ondevice.devices.estimate import preferred_quant
from tests.helpers import run_cli


def test_devices_list_at_80_columns_shows_every_profile_name_whole(capsys, monkeypatch):
    import slm_align.cli.render

    monkeypatch.setattr(slm_align.cli.render.stdout, "width", 80)
    code, out, _ = run_cli(capsys, "devices", "list")
    first_cells = [line.split("│")[1].strip() for line in out.splitlines() if line.startswith("│")]
    names = [cell for cell in first_cells if cell]
    assert code == 0 and names == sorted(list_profiles())  # whole: not "iphone-15…", not wrapped
    assert max(len(line) for line in out.splitlines()) <= 80


def test_bundles_example_names_the_type_the_device_profile_picks(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    code, out, _ = run_cli(capsys, "bundle", "--help")
    examples = re.findall(r"--device ([\w-]+)\s+# exports the profile's (\S+) first", out)
    assert code == 0 and examples, "bundle --help shows no run bundled for a device"
    for device, quant in examples:
        assert quant == preferred_quant(load_profile(device)), device
