"""The 3-D causal VAEs (Qwen-Image, Wan 2.1 / 2.2, LTX-Video): the same tiles with a time axis.

- `face`: what TiledVAE does for them (checks, decode, encode, decode_to, plan), with their return types.
- `executor`: `VideoExecutor` runs a video program over a tile grid and the model's causal steps.
- `plan`: `VideoPlan`, counted from the program and the tile layout as the executor runs them.
"""
