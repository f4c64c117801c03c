"""Packaging for devices: bundles, their files, README, signatures and adapter updates."""
