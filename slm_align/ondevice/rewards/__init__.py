"""Rewards, shared by RL, the headroom gate, evaluation and the runtime's task scoring: the protocol
(protocol.py), task columns (columns.py), the built-ins (answers.py, tool_calls.py, builtin.py) and
the within-prompt spread the gate measures (spread.py). Torch-free.
"""
