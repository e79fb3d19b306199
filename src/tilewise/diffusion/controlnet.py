"""TiledControlNet: a ControlNet whose residuals are computed per tile by the TiledDenoiser that gets them.

`pipe.controlnet = tw.TiledControlNet(pipe.controlnet)` beside `pipe.unet = tw.TiledDenoiser(pipe.unet,
...)` (or `pipe.transformer`) in a stock ControlNet pipeline: when the pipeline calls the ControlNet on the
whole latent, the wrapper records the call and returns deferred residuals (`tilewise.diffusion.residuals`)
in the ControlNet's own return structure; the pipeline's arithmetic on them (guess mode's zeros and batch
concatenation, MultiControlNet's sums) is recorded too. The denoiser then runs the real ControlNet on each
tile's latent with the tile's crop of the control image (its box times the image's factor over the
latent), the rows its call needs and the tile's positions, and adds that tile's residuals: the ControlNet's
memory and attention cost stay one tile's. With one tile covering the latent the result is the stock
pipeline's.

Conditioning scale, guess mode and control guidance start / end are the pipeline's (they are arguments
of the recorded call). A ControlNet with `global_pool_conditions` (shuffle) pools over the tile, not the
image: an approximation, logged. Regional prompts replace the denoiser's prompt only; the ControlNet
keeps the pipeline's.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..wrapper import ModelWrapper
from .adapters.controlnets import control_family
from .adapters.transformer import bind_call
from .residuals import ControlCall

logger = logging.getLogger(__name__)


class TiledControlNet(ModelWrapper):
    """A ControlNet (SD 1.x / SDXL / union, SD3, Flux; single or Multi) run per tile by a TiledDenoiser.

    An nn.Module holding the ControlNet as its submodule `controlnet`; it presents the model like every
    tilewise wrapper (`tilewise.wrapper`: isinstance checks, config, `pipe.to`, `save_pretrained`). Its call
    takes the ControlNet's arguments and returns deferred residuals, which only a TiledDenoiser computes.
    """

    wrapped = "controlnet"

    def __init__(self, controlnet: torch.nn.Module) -> None:
        super().__init__()
        if not isinstance(controlnet, torch.nn.Module) or isinstance(controlnet, TiledControlNet):
            kind = type(controlnet).__name__
            raise ValueError(f"controlnet must be a ControlNet nn.Module (not already tiled), got {kind}")
        self.family = control_family(controlnet)
        nets = getattr(controlnet, "nets", [controlnet])
        if any(getattr(getattr(n, "config", None), "global_pool_conditions", False) for n in nets):
            logger.warning("TiledControlNet: global_pool_conditions pools the ControlNet's features over "
                           "each tile, not over the image: an approximation of the untiled ControlNet")
        self._wrap(controlnet)

    def forward(self, *args: Any, **kwargs: Any):
        """The ControlNet's call, recorded: its residuals as deferred leaves in its own return structure."""
        given = bind_call(self.controlnet, args, kwargs, who="TiledControlNet")
        if given.get(self.family.sample_arg) is None:
            raise TypeError(f"TiledControlNet.forward() for {type(self.controlnet).__name__} needs "
                            f"{self.family.sample_arg}")
        return self.family.outputs(ControlCall(self.controlnet, self.family, given))
