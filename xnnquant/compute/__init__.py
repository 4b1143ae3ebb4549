"""The quantizers' compute: loops compiled with numba (``jit``, ``loops``), ranges on every
core (``parallel``), and special functions numpy lacks (``special``)."""
