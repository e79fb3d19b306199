"""The recipes' options records say what the keyword forms they stand for say: names and defaults."""

import dataclasses
import inspect

import pytest

from tilewise.diffusion import UpscaleOptions, upscale
from tilewise.pipelines import GenerateOptions, VaeFileOptions, decode_file, encode_file, generate


def _defaults(fn, skip: set[str], rename: dict[str, str] | None = None) -> dict:
    rename = rename or {}
    missing = {inspect.Parameter.empty: dataclasses.MISSING}
    return {rename.get(p.name, p.name): missing.get(p.default, p.default)
            for p in inspect.signature(fn).parameters.values()
            if p.name not in skip and p.kind is not inspect.Parameter.VAR_KEYWORD}


def _fields(cls) -> dict:
    return {f.name: f.default for f in dataclasses.fields(cls)}


def test_each_keyword_form_has_its_records_fields_and_defaults():
    assert _defaults(generate, {"loaded"}) == {**_fields(GenerateOptions), "regions": None}  # None: ()
    paths = {"latents_path": "source", "image_path": "source"}
    assert _defaults(decode_file, {"loaded"}, paths) == _fields(VaeFileOptions)
    decode_only = {"bits", "frames_per_call"}  # (the PNG depth written; SVD's decode_chunk_size)
    assert _defaults(encode_file, {"loaded"}, paths) == {k: v for k, v in _fields(VaeFileOptions).items()
                                                         if k not in decode_only}
    runtime = {"pipe", "image", "generator", "callback", "controlnet"}  # objects, not options
    assert _defaults(upscale, runtime) == _fields(UpscaleOptions)


def test_records_are_frozen_and_regions_a_tuple():
    o = GenerateOptions("grass", 64, 64, regions=[((0, 0, 8, 8), "brick")])
    assert o.regions == (((0, 0, 8, 8), "brick"),) and GenerateOptions("grass", 64, 64).regions == ()
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.width = 128


@pytest.mark.parametrize("kw, needle", [
    (dict(scale=0), "scale must be > 0, got 0"),
    (dict(strength=0), r"strength must be in \(0, 1\], got 0"),
    (dict(strength=0.01), r"leaves no denoising step .* use at least 100 steps"),
    (dict(inversion_steps=-1), r"inversion_steps must be an int in \[0, 1000\] \(0: fresh .*\), got -1"),
])
def test_upscale_options_are_checked_when_built(kw, needle):
    with pytest.raises(ValueError, match=needle):
        UpscaleOptions(**kw)
