"""Peak RSS growth of one guided denoising step (embedded model, TiledDenoiser) at two sizes: the figure
behind pipelines/fits.py LATENT_COPIES (latent-sized tensors that grow with the area). Run: python
benchmarks/denoise_memory.py (about 10 min on 2 loaded cores)."""
import time

from tilewise.memory import peak_rss_subprocess

setup = '''
import torch
from tilewise.pipelines import load_pipeline
from tilewise.diffusion import TiledDenoiser
loaded = load_pipeline(None); pipe = loaded.pipe
cond = loaded.encode("grass", "")
pipe.unet = TiledDenoiser(pipe.unet, tile_size=64, overlap=16, batch_size=8, progress=False)
pipe.set_progress_bar_config(disable=True)
pipe(**cond, height=64, width=64, num_inference_steps=1, output_type="latent")  # warm
'''
code = '''
pipe(**cond, height={side}, width={side}, num_inference_steps=1, guidance_scale=5.0, output_type="latent")
result = 0
'''
for side in (2048, 6144):
    t = time.time()
    p = peak_rss_subprocess(code=code.format(side=side), setup=setup, timeout=1200)
    lat = 4 * (side // 8) ** 2 * 4
    print(side, "growth MiB", round(p.growth_bytes / 2**20, 1), "latent MiB", lat / 2**20,
          "ratio", round(p.growth_bytes / lat, 2), "s", round(time.time() - t), flush=True)
