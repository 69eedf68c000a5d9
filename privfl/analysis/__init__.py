"""Analysis of trained runs: Grad-CAM of any module of any client, t-SNE of prototypes and representations.

The CLI is ``python -m privfl.analyze gradcam|tsne`` (:mod:`privfl.analyze`); these modules hold the
parts it is built from, usable from Python as well.
"""

from privfl.analysis.gradcam import GradCamResult, run_gradcam
from privfl.analysis.loading import RunModels
from privfl.analysis.modules import resolve_spatial_module, trace_outputs
from privfl.analysis.tsne import Space, collect, embed, separation

__all__ = ["GradCamResult", "RunModels", "Space", "collect", "embed", "resolve_spatial_module", "run_gradcam", "separation", "trace_outputs"]
