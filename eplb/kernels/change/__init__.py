"""What a deployment change or a failure asks of a placement: make a carried placement whole again
(``repair``), where each new replica's weights are copied from (``weight_copies``), which failure
domain alone holds an expert (``failure_domains``) and spreading replicas over domains
(``domain_spread``).

May use it: the layers above the kernels (analysis, planning, serving). It imports
:mod:`eplb.kernels.plumbing` and :mod:`eplb.kernels.search` (a spread layer is packed as a search
packs it).
"""
