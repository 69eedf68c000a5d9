"""Model group ``toy2d`` for the ``toy2d`` dataset (FedRE [001] Fig. 2 toy; ``privfl/data/toy.py``).

A toy2d sample is a 2-D point stored as a 2x2 grey image, which the ``mlp`` extractor reads (its four
inputs carry the two coordinates; two hidden layers of 512, ReLU, d = 512 with the identity AP
mapping, a ``Linear(512, C)`` head on every client). The other built-in extractors need larger
images, so the toy's two clients have the same architecture and differ in their initialisation. No
new architecture is registered: every entry of ``MODELS`` must take real image sizes (the models'
tests build each at 28, 32 and 64 px).
"""

from __future__ import annotations

from privfl.models.zoo import MODEL_GROUPS

MODEL_GROUPS.register("toy2d", ("mlp",))
