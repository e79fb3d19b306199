"""The tiled VAE engine: `TiledVAE` (the face) over a tile interpreter, its plan, fast mode and staging.

- `tiled`: `TiledVAE`, the wrapper with AutoencoderKL's calls.
- `plan`: `Plan` / `Pass` / `Stage` records, the arithmetic that fills them, `plan_ranks`.
- `executor`: runs a tile program segment by segment over a tile grid (exact mode).
- `fast`: fast mode's passes; `estimators`: its statistics from crops or from sampled tiles.
- `staging`: where full-size values live between segments (device, host, disk) and heap trimming.
- `stats`: exact GroupNorm moments and their merge across tiles; `bands`: row bands of big tiles.
- `sharding`: tile rows over the ranks of a process group.
"""

from .plan import Pass, Plan, RankPlan, Stage, plan_ranks
from .tiled import ATTENTIONS, MODES, TiledVAE

__all__ = ["ATTENTIONS", "MODES", "Pass", "Plan", "RankPlan", "Stage", "TiledVAE", "plan_ranks"]
