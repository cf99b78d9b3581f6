"""The built-in benchmark behind ``remat bench``: models, strategies, runner."""
