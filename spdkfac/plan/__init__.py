"""The decisions every rank makes alike and the simulator replays, as pure functions of plain data.

``work_plan`` (the plan of one configuration), ``factor_fusion`` (which
factors share an all-reduce, Eq. 15), ``placement`` (who decomposes each
factor, Algorithm 1), ``grad_workers`` and ``grad_worker_choice`` (KAISA's
gradient workers and the ``'auto'`` fraction).
"""
