"""A wrapper module that presents the model it wraps: the shared shell of TiledVAE and TiledDenoiser.

A transparent proxy in the way `unittest.mock`'s `spec` is one: the wrapper is an `nn.Module` holding the
model as its submodule `wrapped` names (so `pipe.to(...)`, `.half()`, `.eval()`, `.cpu()` move and cast
the model and return the wrapper), and it presents the model's identity where diffusers looks for it:

- `__class__` (hence `isinstance`) and `__module__` report the wrapped model's class, so a pipeline's
  type checks pass (`fuse_qkv_projections` checks `isinstance(vae, AutoencoderKL)`), `model_index.json`
  names the wrapped class and `pipe.save_pretrained` saves the wrapped model with its own
  `save_pretrained` (stock `from_pretrained` then loads it with no tilewise installed). `type(w)` is
  still the wrapper's class.
- parameters, buffers and `state_dict` are the wrapped model's, without a prefix; `dtype`, `device`,
  `config` and every other attribute the wrapper does not define read through to the model; setting an
  attribute the model has and the wrapper does not sets it on the model.
"""

from __future__ import annotations

from typing import Any

import torch


def _new(cls):
    """Unpickling: a bare instance whose state `nn.Module.__setstate__` then restores."""
    return object.__new__(cls)


class ModelWrapper(torch.nn.Module):
    """nn.Module shell presenting the model registered as submodule `wrapped` (see the module docstring)."""

    wrapped = "model"  # the attribute (and submodule) that holds the wrapped model
    _transient: tuple[str, ...] = ()  # caches rebuilt on demand, not copied or pickled

    def _wrap(self, model: torch.nn.Module) -> None:
        """Register the model (after the wrapper's own settings, which then stay the wrapper's)."""
        setattr(self, self.wrapped, model)
        self.__dict__["__module__"] = type(model).__module__

    def _inner(self):
        modules = self.__dict__.get("_modules")
        return None if modules is None else modules.get(self.wrapped)

    @property
    def __class__(self):  # noqa: F811 - a property on purpose: the wrapped model's class (module docstring)
        inner = self._inner()
        return type(self) if inner is None else type(inner)

    def __reduce_ex__(self, protocol):
        state = {k: v for k, v in self.__getstate__().items() if k not in self._transient}
        return (_new, (type(self),), state)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = self._inner()
            if inner is None or name == self.wrapped:
                raise
            return getattr(inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        inner = self._inner()
        if (inner is None or name.startswith("_") or name in self.__dict__ or hasattr(type(self), name)
                or isinstance(value, torch.nn.Module) or not hasattr(inner, name)):
            super().__setattr__(name, value)
        else:
            setattr(inner, name, value)

    @property
    def dtype(self) -> torch.dtype:
        """The wrapped model's dtype."""
        return self._inner().dtype

    @property
    def device(self) -> torch.device:
        """The wrapped model's device."""
        return self._inner().device

    def state_dict(self, *args, **kwargs):
        """The wrapped model's state dict (its keys, no wrapper prefix)."""
        return self._inner().state_dict(*args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        return self._inner().load_state_dict(*args, **kwargs)

    def named_parameters(self, *args, **kwargs):
        return self._inner().named_parameters(*args, **kwargs)

    def named_buffers(self, *args, **kwargs):
        return self._inner().named_buffers(*args, **kwargs)
