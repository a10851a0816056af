"""The parameter update after preconditioning: first-order rules, the ``base`` option, update fusion, AdamW.

``rules`` (the rules on tensors every optimizer here shares),
``base_update`` (momentum SGD, AdamW or LAMB on the preconditioned gradient),
``update_fusion`` (the update moved into the forward or backward pass) and
``adamw`` (distributed AdamW, DHO2's baseline).
"""
