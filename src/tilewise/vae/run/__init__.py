"""Running a tile program: the interpreter and what it stands on.

- `executor`: `Executor` runs a program over a tile grid segment by segment (`cut`, `tile_grid`),
  `context`: `ExecContext` (what sync ops read), `RunResult` (what a run made); `options`: `RunOptions`,
  how a pass runs (the record plans count); `batches`: same-shape tiles run as one batch.
- `staging`: where full-size values live between segments (device, host, disk), which of those a plan
  may choose, heap trimming; `copies`: device -> host copies on a side stream.
- `stats`: exact GroupNorm moments merged over tiles; `finite`: NaN / inf checks, one sync a segment.
- `bands`: big tiles in row bands; `attention`: every token's keys and values, query bands;
  `sharding`: tile rows over the ranks of a process group.
"""
