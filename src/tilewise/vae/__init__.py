"""The tiled VAE engine: `TiledVAE` (the face) over a tile interpreter, its plans, fast mode and staging.

- `tiled`: `TiledVAE`, the wrapper with AutoencoderKL's calls; `planning`: its plans, and `plan_ranks`;
  `settings`: the checked record of its settings, the vocabularies, and `Job` (one call's work); `checks`:
  the input and whether a run fits; `devices`: the device profiles plans are shaped for; `runner`: a 2-D
  call's run.
- `plan/`: `Plan` / `Pass` / `Stage` records, how they are made and counted, `settle` within a budget.
- `run/`: the executor (segments, tiles, row bands), staging, statistics, attention, sharding.
- `fast/`: fast mode's passes and its statistics estimators.
- `video/`: the 3-D causal VAEs (frames, caches, causal steps).
"""

from .plan.ranks import RankPlan
from .plan.records import Pass, PassKind, Plan, Stage
from .planning import plan_ranks
from .run.finite import NonFiniteError
from .run.options import Choices
from .settings import Attention, Kind, Mode, Place, Settings
from .tiled import ATTENTIONS, MODES, TiledVAE

__all__ = ["ATTENTIONS", "MODES", "Attention", "Choices", "Kind", "Mode", "NonFiniteError", "Pass",
           "PassKind", "Place", "Plan", "RankPlan", "Settings", "Stage", "TiledVAE", "plan_ranks"]
