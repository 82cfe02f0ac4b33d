"""A/B measurement on the user's own launch: does ACP-SGD pay on this cluster and model?

``hvd-acp-ab`` (:mod:`.__main__`) runs inside ``horovodrun`` or, with
``--ddp``, ``torchrun``; it times each method of :mod:`hvd_acp.methods` in
rotating rounds on the same ranks and devices (:mod:`.runner`), and reports
medians, paired ratios with intervals and verdicts, and one recommendation
(:mod:`.report`, statistics in :mod:`.rounds`).
"""
