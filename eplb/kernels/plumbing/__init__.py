"""What every kernel leans on: where compiled code is cached (``_cache``) and the notice while it
compiles (``_compile_notice``), the small helpers several kernel files share (``common``: a random
stream, sorts, replica counts under a cap, the lightest replicas of a set), the views of a placement
(``layout``: ``phy2log`` to ``logcnt`` and ``log2phy``) and the online balancer's load window
(``load_window``: check and store one forward pass without allocating).

May use it: every kernel sub-package, and every layer above the kernels. It imports no other
kernel sub-package. Importing it runs nothing (``eplb.kernels`` registers the cache before any
kernel module is imported).
"""
