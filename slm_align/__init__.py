"""slm-align: align small language models safely and ship them to edge devices."""

__version__ = "0.1.0"
