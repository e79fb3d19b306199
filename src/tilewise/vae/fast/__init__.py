"""Fast mode, the named approximation: GroupNorm statistics estimated instead of merged over every tile.

- `split`: where fast mode cuts a program (`fast_split`, `piece_cuts`, `split_program`, `split_pieces`)
  and its low pass (`low_pass`), shared by the run and its plan.
- `run`: `run_fast` (the sampled-tile estimator, pass by pass) and `crop_stats` (the crop estimator).
- `estimators`: the statistics themselves: from crops, or from a sample of the real tiles.
"""
