"""The K-FAC maths of one layer, with no communication: factors, their shapes and packed form, decompositions, state.

``layers`` (:class:`~spdkfac.kfac.layers.KFACLayer` and which modules are
preconditioned), ``layer_types/`` (one helper per supported module class,
registered), ``methods/`` (one class per ``compute_method``, registered),
``factor_shape``, ``linalg``, ``conv_gram``, ``eigenbasis``, ``state`` (what a
checkpoint holds) and ``summary`` (the start-up coverage summary).
"""
