"""WeightLoadError: what loading raises, shared by the loader and the modules that load their own weights."""


class WeightLoadError(ValueError):
    """The checkpoint's tensors do not fill the model exactly."""
