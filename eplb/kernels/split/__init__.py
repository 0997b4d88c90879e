"""How an expert's tokens split among its replicas and what the split gives: optimal dispatch and
the GPU loads under any shares (``shares``), the slot swaps that lower the optimal-dispatch peak
(``dispatch_swaps``), balancing a layer whose slots carry fixed shares, as an
engine's dispatch rule fixes them (``fixed_shares``), the expected peak of a placement over a series
and the searches that lower it (``expected_peak``), and the simulator's tokens and activated slots
per GPU (``gpu_work``).

May use it: the layers above the kernels (analysis, planning and up). It imports only
:mod:`eplb.kernels.plumbing`.
"""
