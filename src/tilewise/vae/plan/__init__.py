"""Plans of a TiledVAE run, made before anything runs: what it will stage, hold and dispatch.

- `records`: `Plan`, `Pass`, `Stage`, `PassKind` and `Choices` (what a plan settles and the run follows).
- `make`: `make_plan` puts a run's passes together; `passes`: one pass (one Executor run) or the untiled
  run; `fast`: fast mode's passes and the choices a GPU plan makes among them.
- `settle`: which plan a run follows within a memory budget, for the device it is made for.
- `counts`: FLOPs, kernel launches and transfers counted from the tile boxes; `live`: device bytes held
  op by op; `ranks`: what each rank of a multi-process run stages.
"""
