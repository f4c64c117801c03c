"""Tools an agent can call, shared by the on-device runtime, the reward functions, the task data
and RL: schemas from signatures (schema.py), the registry (registry.py), call parsing
(parse.py), grammars (grammar.py) and the built-in tools (builtin.py). Stdlib and jsonschema
only: no torch, no transformers.
"""
