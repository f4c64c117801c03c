"""The headroom gate (stage.py): is there room for RL or preference tuning above the SFT prior?
Its verdict's types live a layer down, in :mod:`slm_align.envelope.gate`."""
