"""ringpipe's version string, in a module of its own so that any layer may read it without importing the package's faces."""

__all__ = ["__version__"]

__version__ = "0.1.0"
