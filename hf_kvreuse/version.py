"""The library's version (a leaf module: saved manifests record it without importing the package)."""

__version__ = "0.2.0"
