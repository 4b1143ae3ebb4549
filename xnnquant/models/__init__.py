"""Small float forward passes of real models, to produce real activations."""

from . import minilm

__all__ = ["minilm"]
