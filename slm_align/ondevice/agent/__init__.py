"""The on-device runtime: chat, tools and the preference store. Imports neither
torch nor transformers."""
