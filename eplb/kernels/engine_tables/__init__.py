"""What an engine's own code computes, reproduced over plain arrays: SGLang's static dispatch table
from CPython's ``random`` stream (``sglang_table``) and DeepSeek's published greedy placement, in
float32 as published (``deepseek_greedy``).

May use it: :mod:`eplb.engines` (the engines' dispatch rules) and the planning methods that
reproduce the published algorithm. It imports only :mod:`eplb.kernels.plumbing`.
"""
