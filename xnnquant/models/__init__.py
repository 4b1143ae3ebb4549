"""Small float forward passes of real models, to produce real activations, and the
project's own calibration and evaluation sentences."""

from . import minilm, sentences

__all__ = ["minilm", "sentences"]
